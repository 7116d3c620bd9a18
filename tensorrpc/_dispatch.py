"""The engine's workers: they run the calls `ServerProtocol` accepted, on the one shell.

Functions over `tensorrpc._server.Server`: ``max_concurrency`` worker tasks take calls
from `ServerProtocol.queue`, decode them, run the handler in a cancel scope (sync handlers
in threads through the shell's `anyio.CapacityLimiter`), encode the outcome, ask the
protocol for the reply's frames and send them. Why a fixed pool over a plain deque:
docs/internals.md.

Rules:

1. A worker runs its calls inside one cancel scope, replaced only after a call got it
   cancelled (CANCEL, deadline, shutdown): a new scope per call costs ~5 us on asyncio.
2. A stream waiting for credit, or a batched call waiting for its batch, holds no worker:
   the protocol stops counting it busy (`ServerProtocol.park`, `batch_wait`) and a
   replacement worker starts if the pool would shrink; a worker beyond the pool's size
   exits once its call is done. A batched call's deadline goes to its batcher
   (`tensorrpc._batch_runner`), not to the worker's scope.
3. The memory of every zero-copy reply is held until ZMQ's tracker says it is sent.
"""

from __future__ import annotations

import functools
import logging
import math
import traceback
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread

from tensorrpc import _codec, _context, _streams
from tensorrpc._batching import ItemRefused
from tensorrpc._compression import OFF_LOOP_BYTES, ZSTD
from tensorrpc._exceptions import (
    DecodeError,
    EncodeError,
    ErrorCode,
    PermissionDeniedError,
    TensorRPCError,
    TensorTransportError,
    ValidationError,
)
from tensorrpc._interceptors import intercept
from tensorrpc._protocol import Flags
from tensorrpc._release import (
    held_nbytes,
    hold_back,
    later,
    later_if_large,
    nbytes,
    resume,
    threshold as release_threshold,
)
from tensorrpc._schema import bad_result_message
from tensorrpc._server_calls import MISSING, ServerCall as Call
from tensorrpc._zmq import Waiters
from tensorrpc.transports._shm_memory import LeaseCollector

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Sequence
    from contextvars import Token

    from anyio.abc import TaskGroup
    from typing_extensions import Buffer

    from tensorrpc._compression import Compression
    from tensorrpc._server import Server
    from tensorrpc._service import ServiceSpec
    from tensorrpc._streams import RequestStream
    from tensorrpc.transports._policy import PolicyPlacer

__all__ = ["RequestItems", "close", "scalar_results", "start", "type_name", "wake_one"]

logger = logging.getLogger("tensorrpc.server")

_SHM_RESULTS_ALL: Final = int(Flags.SHM_RESULTS_ALL)
_SHM_BITS: Final = int(Flags.SHM_RESULTS | Flags.SHM_RESULTS_ALL)
_COMPRESS: Final = int(Flags.COMPRESS)
# How long a cancelled async generator may take to run its ``finally`` blocks.
_ACLOSE_TIMEOUT_S: Final = 1.0
# A worker yields to the event loop after this many calls in a row without waiting.
_FAIRNESS_STREAK: Final = 32
# Values of these types hold no tensor.
_SCALARS: Final = frozenset({int, float, str, bytes, bool, type(None)})

#: A checked, encoded reply and its placer (to abort if the reply does not go).
_Encoded = tuple[_codec.Encoded, "PolicyPlacer | None"]


class _OffLoop:
    """A result to encode on a worker thread (its frames to compress are large)."""

    __slots__ = ("compression", "wire")

    def __init__(self, wire: object, compression: Compression | None) -> None:
        self.wire = wire
        self.compression = compression


def scalar_results(spec: ServiceSpec) -> frozenset[str]:
    """The methods whose results (or stream items) can hold no tensor: a reply of theirs
    needs no placer."""
    return frozenset(
        name
        for name, method in spec.methods.items()
        if method.result_type.exact is not None and method.result_type.exact <= _SCALARS
    )


def type_name(exc: BaseException) -> str:
    """How ``ErrorInfo.type`` spells an exception's type: ``module.qualname`` (§4)."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def _drop_request_items(stream: RequestStream) -> None:
    """The request items a handler left untaken: large ones are freed off the loop."""
    left = stream.drop()
    if left:
        later_if_large(left, sum(nbytes(buffers) for buffers in left))


def _inflates(call: Call) -> bool:
    """Whether decoding the CALL's arguments decompresses enough to leave the loop."""
    payload = call.payload
    return payload is not None and _codec.compressed_bytes(payload, call.buffers) >= OFF_LOOP_BYTES


# -- the pool ---------------------------------------------------------------------------------


def start(server: Server, tg: TaskGroup) -> None:
    """Start the pool in ``tg`` (inside the event loop)."""
    server._tg = tg
    server._waiters = Waiters()
    for _ in range(server._capacity):
        _spawn(server)


def _spawn(server: Server) -> None:
    assert server._tg is not None
    server._workers += 1
    server._tg.start_soon(_worker, server)


def wake_one(server: Server) -> None:
    """A call was queued: wake an idle worker, or start one if waiting calls left the
    pool short (rule 2)."""
    if server._idle:
        assert server._waiters is not None
        server._waiters.wake(server._idle.pop())
    elif (
        server._parked
        and not server._pool_closed
        and server._workers - server._parked < server._capacity
    ):
        _spawn(server)


def close(server: Server) -> None:
    """Workers finish what is queued, then exit (``server._pool_done`` is set then)."""
    server._pool_closed = True
    idle, server._idle = server._idle, []
    if server._waiters is not None:
        for waiter in idle:
            server._waiters.wake(waiter)
    if server._workers == 0:
        server._pool_done.set()


async def _worker(server: Server) -> None:
    try:
        while await _run_calls(server):
            pass
    finally:
        server._workers -= 1
        if server._workers == 0 and server._pool_closed:
            server._pool_done.set()


async def _run_calls(server: Server) -> bool:
    """Run calls in one cancel scope until one gets it cancelled; False: exit the pool."""
    stopped: Call | None = None
    streak = 0
    proto = server._proto
    queue = proto.queue
    waiters = server._waiters
    assert waiters is not None
    try:
        with anyio.CancelScope() as scope:
            while stopped is None:
                if not queue:
                    # Park until a call is queued, or exit the pool (rule 2).
                    if server._pool_closed or server._workers - server._parked > server._capacity:
                        return False
                    waiter = waiters.new()
                    server._idle.append(waiter)
                    await waiters.wait(waiter)
                    streak = 0
                    continue
                call = proto.next_call()
                assert call is not None
                try:
                    await _run(server, call, scope)
                except Exception:
                    logger.exception("internal error running %s", call.spec.qualname)
                    _error(server, call, ErrorCode.INTERNAL, "internal engine error")
                finally:
                    if scope.cancel_called:
                        stopped = call  # answered below, outside the spent scope
                    else:
                        _done(server, call)
                streak += 1
                if streak >= _FAIRNESS_STREAK:
                    # Handlers that never wait would otherwise keep this worker from
                    # yielding while the queue stays full.
                    streak = 0
                    await waiters.checkpoint()
        if stopped is not None:
            await _reply(server, stopped)
    finally:
        if stopped is not None:
            _done(server, stopped)
    return True


def _done(server: Server, call: Call) -> None:
    request = call.request
    if (
        call.keep is not None
        or call.cancelled
        or (request is not None and request.keep is not None)
    ):
        _end_args(server, call)
        server._flush()
    if request is not None:  # the items its handler did not take
        _drop_request_items(request)
    server._proto.done(call, server._now())
    if call.observed is not None:  # observe: the worker is done with the call
        call.observed.finished("cancelled" if call.cancelled else "ok", 0)


def _park(server: Server) -> None:
    """A call stops holding its worker (rule 2): start another if the pool would shrink."""
    server._parked += 1
    short = server._workers - server._parked < server._capacity
    if short and server._proto.queue and not server._idle and not server._pool_closed:
        _spawn(server)


# -- one call -------------------------------------------------------------------------------


def _error(
    server: Server,
    call: Call,
    code: ErrorCode,
    message: str,
    type_name: str = "",
    tb: str = "",
    path: tuple[str | int, ...] = (),
) -> None:
    _detach(server, call, final=True)
    if server._proto.error_reply(call, code, message, type_name, tb, path):
        server._flush()
        if call.observed is not None:  # observe: an ERROR reply to an observed call
            call.observed.error(code.name)


def _refused(server: Server, call: Call, deadline: float) -> bool:
    """Whether a call a worker took must not run (cancelled, shutdown, already late)."""
    if call.cancelled:
        return True
    if server._proto.hard_stop:
        server._proto.stop(call)
        _reply_stopped(server, call)
        return True
    if deadline != math.inf and server._now() >= deadline:
        message = f"{call.spec.qualname} was already past its deadline when a worker took it"
        _error(server, call, ErrorCode.DEADLINE_EXCEEDED, message)
        return True
    return False


async def _run(server: Server, call: Call, scope: anyio.CancelScope) -> None:
    """Run one call inside its worker's ``scope`` and reply; if ``scope`` gets cancelled
    for it, the worker replies once it has left the spent scope (`_reply`)."""
    proto = server._proto
    deadline = call.deadline  # on the event loop's clock, as the shell fed the protocol
    finite = deadline != math.inf
    # Only a call that may be refused pays for the checks (the hot path).
    if (finite or call.cancelled or proto.hard_stop) and _refused(server, call, deadline):
        return
    size = nbytes(call.buffers) if call.buffers else 0
    args = await _decode_off_loop(server, call) if _inflates(call) else _decode(server, call)
    if args is None:
        return
    if call.request is not None:  # the handler's one argument: its request items
        args.append(RequestItems(server, call))
    proto.started(call, server._now())
    if call.observed is not None:  # observe: the handler starts (in this task)
        call.observed.started()
    token = _context.enter(call, server._engine_id)  # call_context() sees it
    if call.spec.streaming:
        await _stream(server, call, args, deadline, token)
        later_if_large(args, size)  # a large CALL's frames are freed off the loop
        return
    call.scope = scope
    batched = call.spec.batch is not None
    if finite and not batched:
        scope.deadline = deadline
    try:
        if call.spec.is_async and not server._interceptors and not batched:  # the hot path
            call.result = await call.fn(*args)  # type: ignore[misc]
        else:  # sync, batched, or interceptors around the handler
            call.result = await _proceed(server, call, args, deadline)
    except Exception as exc:
        call.failure = exc
    finally:
        _context.leave(token)
        call.scope = None
        if finite:
            scope.deadline = math.inf
    # The arguments go before the reply, which then releases their leases; what they hand
    # to the release thread is owned by `_reply_and_free` alone (rule 2 of `_release`).
    await _reply_and_free(server, call, scope, _drop_args(args, size))


def _drop_args(args: list[Any], size: int) -> list[object]:
    """Drop a call's arguments (tensors on the client's regions die now); what must die
    off the loop (a large CALL's frames, one-off mappings) is held back and returned,
    for `_reply_and_free` to hand to the release thread once the reply is sent."""
    held = hold_back()
    try:
        later_if_large(args.copy(), size)
        args.clear()
    finally:
        resume()
    return held


async def _reply_and_free(
    server: Server, call: Call, scope: anyio.CancelScope, held: list[object]
) -> None:
    """Reply (unless ``scope`` was cancelled for the call), then free ``held`` off the loop:
    the release thread's wake-up and unmapping never delay the reply."""
    try:
        if not scope.cancel_called:
            await _reply(server, call)
    finally:
        if held:
            later(held)
        del held


def _proceed(server: Server, call: Call, args: list[Any], deadline: float) -> Awaitable[Any]:
    """The handler through the interceptors (none: the handler itself)."""
    if not server._interceptors:
        return _handler(server, call, args, deadline)
    handler = functools.partial(_handler, server, call, args, deadline)
    return intercept(server._interceptors, _context.call_context(), handler)


async def _handler(server: Server, call: Call, args: list[Any], deadline: float) -> Any:
    """Run a unary handler (the innermost ``proceed`` of the interceptors)."""
    if call.spec.batch is not None:  # parked while it waits for its batch (rule 2)
        server._proto.batch_wait(call)
        _park(server)
        try:
            return await call.fn(deadline, *args)  # type: ignore[misc]
        finally:
            server._parked -= 1
            server._proto.batch_back(call)
    if call.spec.is_async:
        return await call.fn(*args)  # type: ignore[misc]
    return await anyio.to_thread.run_sync(
        call.fn, *args, limiter=server._limiter, abandon_on_cancel=True
    )


def _undecodable(server: Server, call: Call, exc: Exception) -> None:
    """Answer arguments that failed to decode or validate."""
    if isinstance(exc, ValidationError):
        _error(server, call, ErrorCode.INVALID_ARGUMENT, str(exc), path=tuple(exc.field_path))
    elif isinstance(exc, DecodeError):
        _error(server, call, ErrorCode.DECODE, str(exc))
    else:
        _error(server, call, ErrorCode.TENSOR_TRANSPORT, str(exc))


def _decode(server: Server, call: Call) -> list[Any] | None:
    """Decode and validate the arguments; on failure reply with an ERROR and return None."""
    payload, buffers = call.take_args()
    if buffers:
        server._policy.received_frames(buffers)
    # Handles are resolved against the process the kernel attested for the session, and
    # only from a message on that connection (``payload``'s); the argument tensors are
    # kept under ``(session, call_id)`` until the first reply.
    session = call.session
    lazy = None
    if session.shm is not None:
        keep = (session, call.call_id)
        lazy = server._policy.peers.lazy_resolver(session, frame=payload, keep=keep)
    try:
        try:
            wire = _codec.decode(payload, buffers, server._codec, resolver=lazy)
        finally:
            if lazy is not None and lazy.inner is not None:
                # Tensors may sit on the client's regions under these leases.
                server._proto.args_resolved(call, lazy.inner.leases)
        return call.spec.decode_args(wire)
    except (ValidationError, DecodeError, TensorTransportError) as exc:
        _undecodable(server, call, exc)
    return None


async def _decode_off_loop(server: Server, call: Call) -> list[Any] | None:
    """`_decode` of arguments with large compressed frames: decompressed on a worker
    thread (zstd releases the GIL). A client that may send torch_shm handles never
    compresses (docs/protocol.md §6): its CALLs are decoded on the loop, with the
    resolver; elsewhere a handle is refused."""
    shm = call.session.shm
    if shm is not None and shm.we_receive:
        return _decode(server, call)
    payload, buffers = call.take_args()
    if buffers:
        server._policy.received_frames(buffers)
    decode = functools.partial(_codec.decode, payload, buffers, server._codec)
    try:
        return call.spec.decode_args(await anyio.to_thread.run_sync(decode))
    except (ValidationError, DecodeError, TensorTransportError) as exc:
        _undecodable(server, call, exc)
    return None


def _encode(server: Server, call: Call, value: object) -> _Encoded | _OffLoop | None:
    """Check and encode a result or stream item (and its placer, to abort if it does not
    go); on failure reply ERROR, return None; `_OffLoop` when large frames are to be
    compressed (then `_encode_off_loop` encodes them)."""
    # The CALL's flags say how the client wants result tensors; it only asks for
    # torch_shm when it can attach to ours, and shm.peer_receives says it told us so.
    results = call.results
    shm = call.session.shm
    placer = None
    if results & _SHM_BITS and shm is not None and call.spec.name not in server._scalar_results:
        mode = "torch_shm" if results & _SHM_RESULTS_ALL else "auto"
        placer = server._policy.placer(mode, call.session, peer_receives=shm.peer_receives)
    try:
        wire = call.spec.check_result(value)
        compression = None
        # Compressed results when asked, never with torch_shm.
        if results & _COMPRESS and not results & _SHM_BITS and ZSTD in call.session.compression:
            compression = server._compression
        try:
            encoded = _codec.encode(
                wire, server._codec, placer=placer, compression=compression, off_loop=OFF_LOOP_BYTES
            )
        except _codec.OffLoop:  # only without a placer: nothing to abort
            return _OffLoop(wire, compression)
    except (ValidationError, EncodeError) as exc:
        if placer is not None:
            placer.abort()
        _bad_result(server, call, exc)
        return None
    except TensorTransportError as exc:
        _error(server, call, ErrorCode.TENSOR_TRANSPORT, str(exc))
        return None
    return _checked(server, call, encoded, placer)


async def _encode_off_loop(server: Server, call: Call, job: _OffLoop) -> _Encoded | None:
    """`_encode` of a result with large frames to compress, on a worker thread (zstd
    releases the GIL: the loop keeps serving meanwhile)."""
    encode = functools.partial(_codec.encode, job.wire, server._codec, compression=job.compression)
    del job
    try:
        encoded = await anyio.to_thread.run_sync(encode)
    except EncodeError as exc:
        _bad_result(server, call, exc)
        return None
    return _checked(server, call, encoded, None)


def _bad_result(server: Server, call: Call, exc: ValidationError | EncodeError) -> None:
    message = bad_result_message(call.spec.qualname, exc)
    path = tuple(exc.field_path) if isinstance(exc, ValidationError) else ()
    _error(server, call, ErrorCode.BAD_RESULT, message, type_name(exc), path=path)


def _checked(
    server: Server, call: Call, encoded: _codec.Encoded, placer: PolicyPlacer | None
) -> _Encoded | None:
    """An encoded result, checked against the client's message size limit."""
    try:
        # A frame over the client's MAXMSGSIZE makes its ZMQ drop the connection
        # (and every call on it) without a word: refuse it here instead.
        _codec.check_message_size(
            encoded,
            server._socket_options.maxmsgsize,
            call.session.max_message_bytes,
            lambda: ("the results", f"client {call.session.name!r}"),
        )
        if encoded.buffers:
            server._policy.sent_frames(encoded.buffers)
        return encoded, placer
    except (ValidationError, EncodeError) as exc:
        if placer is not None:
            placer.abort()
        _bad_result(server, call, exc)
    except TensorTransportError as exc:
        _error(server, call, ErrorCode.TENSOR_TRANSPORT, str(exc))
    return None


def _detach(server: Server, call: Call, *, final: bool = False) -> None:
    """The client takes its argument regions back with our first reply, and its request
    items' regions with the ``final`` one (the protocol ends their leases when it builds
    that reply): tensors still alive on them get pages of their own first."""
    keep = call.keep
    if keep is not None:
        server._policy.memory.detach(keep)
    if final and call.request is not None and call.request.keep is not None:
        server._policy.memory.detach(call.request.keep)


def _placed_inline(
    server: Server, call: Call, placer: PolicyPlacer | None, *, final: bool = False
) -> bool:
    """`_detach` here when neither it nor the reply's pool copies move a large buffer (the
    common case: no coroutine); False: `_place_off_loop` has it to do."""
    if placer is not None and placer.pending_bytes:
        return False
    keep = call.keep
    items = call.request.keep if final and call.request is not None else None
    if keep is None and items is None:
        return True  # nothing to detach (the small call)
    memory = server._policy.memory
    large = release_threshold()
    if (keep is not None and memory.detach_bytes(keep) >= large) or (
        items is not None and memory.detach_bytes(items) >= large
    ):
        return False
    _detach(server, call, final=final)
    return True


async def _place_off_loop(
    server: Server,
    call: Call,
    placer: PolicyPlacer | None,
    encoded: _codec.Encoded,
    *,
    final: bool = False,
) -> bool:
    """`_detach`, and copy the reply's large tensors into the pool (`PolicyPlacer.fill`),
    on a worker thread (the copies release the GIL: the loop keeps serving). False: it
    failed, ERROR sent."""
    keep = call.keep
    items = call.request.keep if final and call.request is not None else None
    memory = server._policy.memory
    # A reply without frames holds its tensors only for their copies into the pool.
    sources = encoded.keepalive if not encoded.buffers else None

    def copy() -> None:
        # The reply's copies first, then its sources go (here, off the loop): a result
        # that is an argument (an echo) is copied out of the client's region while that
        # region is still leased to us, and is dead by the detach, which then has no
        # private pages to make for it (64 MiB of fresh pages cost tens of ms of faults).
        try:
            if placer is not None:
                placer.fill()
                if sources is not None:
                    sources.clear()
        finally:
            if keep is not None:
                memory.detach(keep)
            if items is not None:
                memory.detach(items)

    try:
        # Not abandoned on cancellation: the region must not be released mid-copy.
        await anyio.to_thread.run_sync(copy)
    except BaseException as exc:
        if placer is not None:
            placer.abort()
        if not isinstance(exc, OSError):
            raise
        message = f"cannot copy {call.spec.qualname}'s result into shared memory: {exc.strerror}"
        _error(server, call, ErrorCode.TENSOR_TRANSPORT, message)
        return False
    return True


def _end_args(server: Server, call: Call) -> None:
    """A call that ends without a reply (cancelled, client gone): argument tensors still
    alive get pages of their own, then the protocol RELEASEs the argument leases the call
    owes the client (`ServerProtocol.args_done`)."""
    if call.session.shm is None:  # the session ended: its regions are forgotten
        server._proto.args_done(call)
        return
    _detach(server, call, final=True)
    unread: tuple[int, ...] = ()
    if call.cancelled and call.payload is not None:  # never decoded: read its lease ids
        unread = _lease_ids(server, call.payload, call.buffers)
    unread_items: list[int] = []
    stream = call.request
    if call.cancelled and stream is not None:  # items never taken: their lease ids
        unread_items = [
            lease
            for payload, buffers in stream.items
            for lease in _lease_ids(server, payload, buffers)
        ]
        _drop_request_items(stream)  # a large one is freed off the loop
    server._proto.args_done(call, unread, unread_items)


def _lease_ids(server: Server, payload: Buffer, buffers: Sequence[Buffer]) -> tuple[int, ...]:
    """The lease ids the handles of a message never decoded name (nothing attached)."""
    collector = LeaseCollector()
    try:
        _codec.decode(payload, buffers, server._codec, resolver=collector)
    except TensorRPCError:  # undecodable: it named no lease we could release
        logger.debug("lease ids of a cancelled call unreadable", exc_info=True)
    return tuple(collector.leases)


def _reply_stopped(server: Server, call: Call) -> None:
    """The call's scope was cancelled: say why, unless the client gave up on it."""
    name = call.spec.qualname
    if call.shutdown:
        grace = server._config.grace_period
        message = (
            f"engine {server._engine_id!r} shut down before {name} finished "
            f"(grace period {grace} s)"
        )
        _error(server, call, ErrorCode.DRAINING, message)
    else:
        message = f"{name} ran past its deadline and was cancelled"
        _error(server, call, ErrorCode.DEADLINE_EXCEEDED, message)


async def _reply(server: Server, call: Call) -> None:
    """Answer a unary call from its outcome (nothing if the client gave up on it)."""
    if call.cancelled or (call.request is not None and _refused_item(server, call)):
        return
    if call.failure is not None:
        _reply_exception(server, call, call.failure)
        return
    if call.result is MISSING:
        _reply_stopped(server, call)
        return
    result, call.result = call.result, None  # the send keeps what it needs
    done = _encode(server, call, result)
    del result  # a large result dies with the send
    if isinstance(done, _OffLoop):
        done = await _encode_off_loop(server, call, done)
    if done is None:
        return
    encoded, placer = done
    if not _placed_inline(server, call, placer, final=True) and not await _place_off_loop(
        server, call, placer, encoded, final=True
    ):
        return
    if not server._proto.result(call, encoded.payload, encoded.buffers):
        if placer is not None:  # cancelled meanwhile: no reply
            placer.abort()
        return
    await server._send_reply(call, encoded.keepalive if encoded.buffers else None)
    if encoded.keepalive and not encoded.buffers:
        _copied_sent(encoded.keepalive)


def _refused_item(server: Server, call: Call) -> bool:
    """A request item was refused: the call's answer is that ERROR, whatever the handler
    made of it."""
    request = call.request
    if request is None or request.refused is None:
        return False
    code, message, path = request.refused
    _error(server, call, code, message, path=path)
    return True


def _reply_exception(server: Server, call: Call, exc: BaseException) -> None:
    if isinstance(exc, ItemRefused):  # batching: the batcher ended the item
        _error(server, call, exc.code, str(exc))
    elif isinstance(exc, PermissionDeniedError):  # an interceptor or the handler refused
        _error(server, call, ErrorCode.PERMISSION_DENIED, str(exc), type_name(exc))
    else:
        tb = "".join(traceback.format_exception(exc))
        _error(server, call, ErrorCode.REMOTE, str(exc), type_name(exc), tb)


def _copied_sent(keepalive: list[object]) -> None:
    """A reply whose tensors were copied into the pool went: free their sources (a large
    one off the loop)."""
    later_if_large(keepalive, held_nbytes(keepalive))


# -- streams ----------------------------------------------------------------------------------


async def _stream(
    server: Server, call: Call, args: list[Any], deadline: float, token: Token[Any]
) -> None:
    """Run a stream and end it (``token``: undo the call's context when done)."""
    try:
        await _run_stream(server, call, args, deadline)
    finally:
        _context.leave(token)


async def _run_stream(server: Server, call: Call, args: list[Any], deadline: float) -> None:
    gen: AsyncGenerator[Any, None] | None = None
    failure: BaseException | None = None
    finished = False

    async def run() -> None:  # the innermost ``proceed`` of the interceptors
        nonlocal gen, finished
        gen = call.fn(*args)  # type: ignore[assignment]
        assert gen is not None
        finished = await _pump(server, call, gen)

    with anyio.CancelScope(deadline=deadline) as scope:
        call.scope = scope
        try:
            if server._interceptors:
                await intercept(server._interceptors, _context.call_context(), run)
            else:
                await run()
        except Exception as exc:
            failure = exc
        finally:
            if gen is not None and not finished:
                with anyio.move_on_after(_ACLOSE_TIMEOUT_S, shield=True):
                    try:
                        await gen.aclose()
                    except Exception:
                        logger.exception("%s failed to close", call.spec.qualname)
    call.scope = None
    if call.cancelled or call.answered or _refused_item(server, call):
        return
    if failure is not None:
        _reply_exception(server, call, failure)
    elif finished:
        _detach(server, call, final=True)
        if server._proto.stream_end(call):
            server._flush()
    else:
        _reply_stopped(server, call)


async def _pump(server: Server, call: Call, gen: AsyncGenerator[Any, None]) -> bool:
    """Send the generator's items as credit allows; True when it finished."""
    proto = server._proto
    while True:
        if not proto.may_send_item(call):
            if call.cancelled or call.answered or not await _wait_credit(server, call):
                return False
            continue
        try:
            item = await gen.__anext__()
        except StopAsyncIteration:
            return True
        done = _encode(server, call, item)
        del item
        if isinstance(done, _OffLoop):
            done = await _encode_off_loop(server, call, done)
        if done is None:
            return False  # the ERROR is sent: nothing more
        encoded, placer = done
        if not _placed_inline(server, call, placer) and not await _place_off_loop(
            server, call, placer, encoded
        ):
            return False  # the ERROR is sent: nothing more
        if not proto.stream_item(call, encoded.payload, encoded.buffers):
            if placer is not None:  # cancelled while the generator ran: nothing more
                placer.abort()
            return False
        await server._send_reply(call, encoded.keepalive if encoded.buffers else None)
        if encoded.keepalive and not encoded.buffers:
            _copied_sent(encoded.keepalive)
        # Not held until the next item: the sent item's last references are the
        # pending send's (released off the loop once ZMQ is done with it).
        del done, encoded, placer
        if call.observed is not None:  # observe: a stream item went out
            call.observed.item()


async def _wait_credit(server: Server, call: Call) -> bool:
    """Park until credit arrives; False (ERROR sent) when the client has too many parked."""
    reason = server._proto.park(call)
    if reason is not None:
        _error(server, call, ErrorCode.OVERLOADED, reason)
        return False
    server._parked += 1
    if server._workers - server._parked < server._capacity and not server._pool_closed:
        _spawn(server)  # the pool keeps its size while this stream waits
    try:
        event = call.credit_event = anyio.Event()
        await event.wait()
    finally:
        call.credit_event = None
        server._parked -= 1
        server._proto.unpark(call)
    return True


# -- request items ----------------------------------------------------------------------------


class RequestItems:
    """What a request-streaming handler iterates: the call's items, validated one by one.

    An item that fails to decode or validate ends the iteration with its error; the call
    is then answered with it (``DECODE``, or ``INVALID_ARGUMENT`` with its path), whatever
    the handler does with the exception.
    """

    __slots__ = ("_call", "_server")

    def __init__(self, server: Server, call: Call) -> None:
        self._server = server
        self._call = call

    def __aiter__(self) -> RequestItems:
        return self

    async def __anext__(self) -> Any:
        call = self._call
        server = self._server
        stream = call.request
        assert stream is not None
        while True:
            # After the final reply the client has its item regions back: nothing more.
            if stream.refused is not None or call.answered or call.cancelled:
                raise StopAsyncIteration
            item = _streams.take_item(server._proto, call)
            if item is not None:
                break
            if stream.half_closed:
                raise StopAsyncIteration
            event = stream.waiter = anyio.Event()
            try:
                await event.wait()
            finally:
                stream.waiter = None
        if server._proto.pending:
            server._flush()  # the CREDIT it earned
        payload, buffers = item
        index = stream.taken - 1
        decode_item = call.spec.decode_item
        assert decode_item is not None
        try:
            return decode_item(await self._decode(payload, buffers), index)
        except ValidationError as exc:
            stream.refused = (ErrorCode.INVALID_ARGUMENT, str(exc), tuple(exc.field_path))
            raise
        except DecodeError as exc:
            stream.refused = (ErrorCode.DECODE, f"request item {index}: {exc}", ())
            raise
        except TensorRPCError as exc:
            stream.refused = (ErrorCode.TENSOR_TRANSPORT, f"request item {index}: {exc}", ())
            raise

    async def _decode(self, payload: Any, buffers: Any) -> Any:
        """An item's wire value; large frames to decompress are decoded on a worker thread,
        as a CALL's arguments are (`_decode_off_loop`)."""
        call, server = self._call, self._server
        shm = call.session.shm
        codec = server._codec
        if (shm is None or not shm.we_receive) and _codec.compressed_bytes(
            payload, buffers
        ) >= OFF_LOOP_BYTES:
            return await anyio.to_thread.run_sync(_codec.decode, payload, buffers, codec)
        # Resolved as the arguments are (`_decode`), kept under a key of their own until
        # the final reply (`_streams` rule 6).
        session = call.session
        lazy = None
        if session.shm is not None:
            keep = (session, call.call_id, "items")
            lazy = server._policy.peers.lazy_resolver(session, frame=payload, keep=keep)
        try:
            return _codec.decode(payload, buffers, codec, resolver=lazy)
        finally:
            if lazy is not None and lazy.inner is not None:
                # Its tensors may sit on the client's regions until the final reply.
                server._proto.items_resolved(call, lazy.inner.leases)
