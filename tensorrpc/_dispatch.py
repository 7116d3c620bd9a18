"""The engine's worker pool: takes accepted calls from the protocol and runs their handlers.

``max_concurrency`` worker tasks take calls from `ServerProtocol.queue`, decode
them (codec and ``decode_args``), run the handler in a cancel scope (sync handlers in
worker threads through a `anyio.CapacityLimiter`) and send the reply. A fixed pool
of tasks taking from a plain deque and parking on an Event when it is empty was measured
faster than a memory object stream (several checkpoints per item) or a task per call
(a task creation per call); see docs/internals.md.

Rules:

1. A worker runs its calls inside one cancel scope, replaced only after a call got it
   cancelled (CANCEL, deadline, shutdown): a new scope per call costs ~5 us on asyncio.
2. The protocol decides whether a reply may go and builds its frames
   (`ServerProtocol.result`, `stream_item`, `stream_end`, `error_reply`), and which
   argument leases a call that ends without a reply owes the client
   (`ServerProtocol.args_done`); this module encodes values and sends.
3. A stream that waits for credit does not hold a worker: it parks (the protocol stops
   counting it busy) and, if the pool would otherwise shrink, a replacement worker
   starts; a worker beyond the pool's size exits once its call is done.
4. The memory of every zero-copy reply is held until ZMQ's tracker says it is sent.
5. A batched unary call (``@rpc(batch=Batching(...))``) does not hold a worker while it
   waits for its batch: its task parks as a stream waiting for credit does (the protocol
   stops counting it busy, `ServerProtocol.batch_wait`), and a replacement worker starts
   when a call is queued and no worker is free. Its deadline goes to the batcher
   (`tensorrpc._batch_runner`), not to the worker's scope: the batcher ends it at its
   deadline, queued or running.
"""

from __future__ import annotations

import functools
import logging
import math
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread

from tensorrpc import _codec, _context
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
from tensorrpc._release import held_nbytes, later_if_large, nbytes, threshold as release_threshold
from tensorrpc._schema import bad_result_message
from tensorrpc._server_calls import MISSING, ServerCall
from tensorrpc._stream_io import RequestItems
from tensorrpc._zmq import Waiters, loop_clock
from tensorrpc.transports._shm_memory import LeaseCollector

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
    from contextvars import Token

    from anyio.abc import TaskGroup
    from typing_extensions import Buffer

    from tensorrpc._compression import Compression
    from tensorrpc._server_protocol import ServerProtocol
    from tensorrpc._streams import RequestStream
    from tensorrpc.transports._links import LazyResolver
    from tensorrpc.transports._policy import PolicyPlacer, TransportPolicy

__all__ = ["Call", "Dispatcher"]

logger = logging.getLogger("tensorrpc.server")

_SHM_RESULTS_ALL: Final = int(Flags.SHM_RESULTS_ALL)
_SHM_BITS: Final = int(Flags.SHM_RESULTS | Flags.SHM_RESULTS_ALL)
_COMPRESS: Final = int(Flags.COMPRESS)
# How long a cancelled async generator may take to run its ``finally`` blocks.
_ACLOSE_TIMEOUT_S: Final = 1.0
# A worker yields to the event loop after this many calls in a row without waiting.
_FAIRNESS_STREAK: Final = 32


#: The calls this pool runs (the protocol's record carries the shell's slots too).
Call = ServerCall


def _items_kept(call: Call) -> bool:
    """Whether request item tensors of ``call`` may sit on the client's regions."""
    return call.request is not None and call.request.keep is not None


def _gone(call: Call) -> bool:
    # A function, not an attribute test, so that mypy does not keep a narrowing of
    # ``call.cancelled`` from before an await (other tasks set it meanwhile).
    return call.cancelled


def _drop_request_items(stream: RequestStream) -> None:
    """The request items a handler left untaken: large ones are freed off the loop."""
    left = stream.drop()
    if left:
        later_if_large(left, sum(nbytes(buffers) for buffers in left))


def type_name(exc: BaseException) -> str:
    """How ``ErrorInfo.type`` spells an exception's type: always ``module.qualname``
    (``builtins.ValueError``), docs/protocol.md §4."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def _inflates(call: Call) -> bool:
    """Whether decoding the CALL's arguments decompresses enough to leave the loop."""
    payload = call.payload
    return payload is not None and _codec.compressed_bytes(payload, call.buffers) >= OFF_LOOP_BYTES


@dataclass(frozen=True, slots=True)
class _OffLoop:
    """A result to encode on a worker thread (its frames to compress are large)."""

    wire: object
    compression: Compression | None


class Dispatcher:
    """Runs the calls a `ServerProtocol` accepted, on a pool of worker tasks.

    Args:
        proto: The engine's protocol machine.
        engine_id: For messages.
        max_concurrency: Worker tasks (calls running at once).
        sync_workers: Threads running sync handlers at once.
        codec: Codec limits.
        policy: The tensor transport policy (placers, resolvers, statistics).
        maxmsgsize: Our largest frame (0: none), for the result size check.
        grace_period: For the DRAINING message.
        flush: Send what the protocol queued (ERROR, STREAM_END, RELEASE), no waiting.
        send_reply: Send a reply, waiting a bounded time; ``(call, frames, keepalive)``.
        compression: How results are compressed for a call that asks (``COMPRESS``) from
            a client that decodes zstd; None: never.
        interceptors: The engine's interceptors, outermost first (`tensorrpc._interceptors`).
    """

    def __init__(
        self,
        proto: ServerProtocol,
        *,
        engine_id: str,
        max_concurrency: int,
        sync_workers: int,
        codec: _codec.CodecConfig,
        policy: TransportPolicy,
        maxmsgsize: int,
        grace_period: float,
        flush: Callable[[], None],
        send_reply: Callable[[Call, list[object] | None], Awaitable[None]],
        compression: Compression | None = None,
        interceptors: tuple[Any, ...] = (),
    ) -> None:
        self._proto = proto
        self._compression = compression
        self._engine_id = engine_id
        self._capacity = max_concurrency
        self._limiter = anyio.CapacityLimiter(sync_workers)
        self._codec = codec
        self._policy = policy
        self._maxmsgsize = maxmsgsize
        self._grace_period = grace_period
        self._flush = flush
        self._send_reply = send_reply
        self._interceptors = interceptors
        self._idle: list[Any] = []  # the parked workers' wake-ups (`Waiters`)
        self._waiters: Waiters | None = None
        self._now: Callable[[], float] = anyio.current_time
        self._closed = False
        self._workers = 0
        self._parked = 0
        self._tg: TaskGroup | None = None
        self.done = anyio.Event()

    def start(self, tg: TaskGroup) -> None:
        """Start the pool in ``tg`` (inside the event loop)."""
        self._tg = tg
        self._waiters = Waiters()
        self._now = loop_clock()
        for _ in range(self._capacity):
            self._spawn()

    def _spawn(self) -> None:
        assert self._tg is not None
        self._workers += 1
        self._tg.start_soon(self._worker)

    def wake_one(self) -> None:
        """A call was queued: wake one idle worker, or start one if parked calls left the
        pool short (rule 5)."""
        if self._idle:
            assert self._waiters is not None
            self._waiters.wake(self._idle.pop())
        elif self._parked and not self._closed and self._workers - self._parked < self._capacity:
            self._spawn()

    def close(self) -> None:
        """Workers finish what is queued, then exit (`done` is set when all have)."""
        self._closed = True
        idle, self._idle = self._idle, []
        if self._waiters is not None:
            for waiter in idle:
                self._waiters.wake(waiter)
        if self._workers == 0:
            self.done.set()

    # -- the pool ---------------------------------------------------------------------------

    async def _worker(self) -> None:
        try:
            while await self._run_calls():
                pass
        finally:
            self._workers -= 1
            if self._workers == 0 and self._closed:
                self.done.set()

    async def _run_calls(self) -> bool:
        """Run calls in one cancel scope until one gets it cancelled; False: exit the pool."""
        stopped: Call | None = None
        streak = 0
        queue = self._proto.queue
        waiters = self._waiters
        assert waiters is not None
        try:
            with anyio.CancelScope() as scope:
                while stopped is None:
                    if not queue:
                        if not self._may_park():
                            return False
                        # Park until a call is queued (inline: one coroutine less per call).
                        waiter = waiters.new()
                        self._idle.append(waiter)
                        await waiters.wait(waiter)
                        streak = 0
                        continue
                    call = self._proto.next_call()
                    assert call is not None
                    try:
                        await self._run(call, scope)
                    except Exception:
                        logger.exception("internal error running %s", call.spec.qualname)
                        self._error(call, ErrorCode.INTERNAL, "internal engine error")
                    finally:
                        if scope.cancel_called:
                            stopped = call  # answered below, outside the spent scope
                        else:
                            self._done(call)
                    streak += 1
                    if streak >= _FAIRNESS_STREAK:
                        # Handlers that never wait would otherwise keep this worker from
                        # yielding while the queue stays full.
                        streak = 0
                        await waiters.checkpoint()
            if stopped is not None:
                await self._reply(stopped)
        finally:
            if stopped is not None:
                self._done(stopped)
        return True

    def _may_park(self) -> bool:
        """Whether a worker that found no call waits for one (False: it exits instead)."""
        return not self._closed and self._workers - self._parked <= self._capacity

    def _done(self, call: Call) -> None:
        if call.keep is not None or call.cancelled or _items_kept(call):
            self._end_args(call)
            self._flush()
        if call.request is not None:  # the items its handler did not take
            _drop_request_items(call.request)
        self._proto.done(call, self._now())
        if call.observed is not None:  # observe: the worker is done with the call
            call.observed.finished("cancelled" if call.cancelled else "ok", 0)

    # -- one call ---------------------------------------------------------------------------

    def _error(
        self,
        call: Call,
        code: ErrorCode,
        message: str,
        type_name: str = "",
        tb: str = "",
        path: tuple[str | int, ...] = (),
    ) -> None:
        self._detach(call, final=True)
        if self._proto.error_reply(call, code, message, type_name, tb, path):
            self._flush()
            if call.observed is not None:  # observe: an ERROR reply to an observed call
                call.observed.error(code.name)

    def _refused(self, call: Call, deadline: float) -> bool:
        """Whether a call a worker took must not run (cancelled, shutdown, already late)."""
        if call.cancelled:
            return True
        if self._proto.hard_stop:
            self._proto.stop(call)
            self._reply_stopped(call)
            return True
        if deadline != math.inf and self._now() >= deadline:
            self._error(
                call,
                ErrorCode.DEADLINE_EXCEEDED,
                f"{call.spec.qualname} was already past its deadline when a worker took it",
            )
            return True
        return False

    async def _run(self, call: Call, scope: anyio.CancelScope) -> None:
        """Run one call inside its worker's ``scope`` and reply.

        If ``scope`` gets cancelled for this call (CANCEL, deadline, shutdown), the outcome
        is left in ``call.result``/``call.failure`` and the worker replies once it has left
        the spent scope (see `_reply`).
        """
        deadline = call.deadline  # on the event loop's clock, as the shell fed the protocol
        finite = deadline != math.inf
        # Only a call that may be refused pays for the checks (the hot path).
        if (finite or call.cancelled or self._proto.hard_stop) and self._refused(call, deadline):
            return
        size = nbytes(call.buffers) if call.buffers else 0
        args = await self._decode_off_loop(call) if _inflates(call) else self._decode(call)
        if args is None:
            return
        if call.request is not None:  # the handler's one argument: its request items
            items = RequestItems(self._proto, call, self._codec, self._flush, self._item_resolver)
            args.append(items)
        self._proto.started(call, self._now())
        if call.observed is not None:  # observe: the handler starts (in this task)
            call.observed.started()
        token = _context.enter(call, self._engine_id)  # call_context() sees it
        if call.spec.streaming:
            await self._run_stream(call, args, deadline, token)
            later_if_large(args, size)
            return
        call.scope = scope
        batched = call.spec.batch is not None
        if finite and not batched:
            scope.deadline = deadline
        try:
            if call.spec.is_async and not self._interceptors and not batched:  # the hot path
                call.result = await call.fn(*args)  # type: ignore[misc]
            else:  # sync, batched, or interceptors around the handler
                call.result = await self._proceed(call, args, deadline)
        except Exception as exc:
            call.failure = exc
        finally:
            _context.leave(token)
            call.scope = None
            if finite:
                scope.deadline = math.inf
        later_if_large(args, size)  # a large CALL's frames are freed off the loop
        del args  # argument tensors on the client's regions die here, before the reply
        if not scope.cancel_called:
            await self._reply(call)

    async def _batched(self, call: Call, args: list[Any], deadline: float) -> Any:
        """Hand a batched item to its runner and wait for its result, parked (rule 5)."""
        self._proto.batch_wait(call)
        self._parked += 1
        short = self._workers - self._parked < self._capacity
        if short and self._proto.queue and not self._idle and not self._closed:
            self._spawn()
        try:
            return await call.fn(deadline, *args)  # type: ignore[misc]
        finally:
            self._parked -= 1
            self._proto.batch_back(call)

    def _proceed(self, call: Call, args: list[Any], deadline: float) -> Awaitable[Any]:
        """The handler through the interceptors (none: the handler itself, without the
        call context and partial that only interceptors need)."""
        if not self._interceptors:
            return self._handler(call, args, deadline)
        handler = functools.partial(self._handler, call, args, deadline)
        return intercept(self._interceptors, _context.call_context(), handler)

    async def _handler(self, call: Call, args: list[Any], deadline: float) -> Any:
        """Run a unary handler (the innermost ``proceed`` of the interceptors)."""
        if call.spec.batch is not None:
            return await self._batched(call, args, deadline)
        if call.spec.is_async:
            return await call.fn(*args)  # type: ignore[misc]
        return await anyio.to_thread.run_sync(
            call.fn, *args, limiter=self._limiter, abandon_on_cancel=True
        )

    def _decode(self, call: Call) -> list[Any] | None:
        """Decode and validate the arguments; on failure reply with an ERROR and return None."""
        payload, buffers = call.take_args()
        if buffers:
            self._policy.received_frames(buffers)
        lazy = self._resolver(call, payload)
        try:
            try:
                wire = _codec.decode(payload, buffers, self._codec, resolver=lazy)
            finally:
                if lazy is not None and lazy.inner is not None:
                    # Tensors may sit on the client's regions under these leases.
                    self._proto.args_resolved(call, lazy.inner.leases)
            return call.spec.decode_args(wire)
        except (ValidationError, DecodeError, TensorTransportError) as exc:
            self._undecodable(call, exc)
        return None

    async def _decode_off_loop(self, call: Call) -> list[Any] | None:
        """`_decode` of arguments with large compressed frames: the decompression runs on
        a worker thread (zstd releases the GIL), the rest on the loop. A client that may
        send torch_shm handles never compresses (docs/protocol.md §6): its CALLs are
        decoded on the loop, with the resolver; elsewhere a handle is refused."""
        shm = call.session.shm
        if shm is not None and shm.we_receive:
            return self._decode(call)
        payload, buffers = call.take_args()
        if buffers:
            self._policy.received_frames(buffers)
        decode = functools.partial(_codec.decode, payload, buffers, self._codec)
        try:
            return call.spec.decode_args(await anyio.to_thread.run_sync(decode))
        except (ValidationError, DecodeError, TensorTransportError) as exc:
            self._undecodable(call, exc)
        return None

    def _undecodable(
        self, call: Call, exc: ValidationError | DecodeError | TensorTransportError
    ) -> None:
        if isinstance(exc, ValidationError):
            self._error(call, ErrorCode.INVALID_ARGUMENT, str(exc), path=tuple(exc.field_path))
        elif isinstance(exc, DecodeError):
            self._error(call, ErrorCode.DECODE, str(exc))
        else:
            self._error(call, ErrorCode.TENSOR_TRANSPORT, str(exc))

    async def _encode_off_loop(
        self, call: Call, job: _OffLoop
    ) -> tuple[_codec.Encoded, PolicyPlacer | None] | None:
        """`_encode` of a result with large frames to compress, on a worker thread (zstd
        releases the GIL: the loop keeps serving meanwhile)."""
        encode = functools.partial(
            _codec.encode, job.wire, self._codec, compression=job.compression
        )
        del job
        try:
            encoded = await anyio.to_thread.run_sync(encode)
        except EncodeError as exc:
            self._bad_result(call, exc)
            return None
        return self._encoded(call, encoded, None)

    def _encode(
        self, call: Call, value: object, off_loop: int = 0
    ) -> tuple[_codec.Encoded, PolicyPlacer | None] | _OffLoop | None:
        """Check and encode a result or stream item (and its placer, to abort if it does
        not go); on failure reply ERROR, return None; `_OffLoop` when ``off_loop`` bytes
        or more are to be compressed (then `_encode_off_loop` encodes them)."""
        placer = self._placer(call)
        try:
            wire = call.spec.check_result(value)
            compression = None
            results = call.results
            # Compressed results when asked, never with torch_shm.
            if results & _COMPRESS and not results & _SHM_BITS and ZSTD in call.session.compression:
                compression = self._compression
            try:
                encoded = _codec.encode(
                    wire, self._codec, placer=placer, compression=compression, off_loop=off_loop
                )
            except _codec.OffLoop:  # only without a placer: nothing to abort
                return _OffLoop(wire, compression)
        except (ValidationError, EncodeError) as exc:
            if placer is not None:
                placer.abort()
            self._bad_result(call, exc)
            return None
        except TensorTransportError as exc:
            self._error(call, ErrorCode.TENSOR_TRANSPORT, str(exc))
            return None
        return self._encoded(call, encoded, placer)

    def _bad_result(self, call: Call, exc: ValidationError | EncodeError) -> None:
        self._error(
            call,
            ErrorCode.BAD_RESULT,
            bad_result_message(call.spec.qualname, exc),
            type_name(exc),
            path=tuple(exc.field_path) if isinstance(exc, ValidationError) else (),
        )

    def _encoded(
        self, call: Call, encoded: _codec.Encoded, placer: PolicyPlacer | None
    ) -> tuple[_codec.Encoded, PolicyPlacer | None] | None:
        """An encoded result, checked against the client's message size limit."""
        try:
            # A frame over the client's MAXMSGSIZE makes its ZMQ drop the connection
            # (and every call on it) without a word: refuse it here instead.
            _codec.check_message_size(
                encoded,
                self._maxmsgsize,
                call.session.max_message_bytes,
                lambda: ("the results", f"client {call.session.name!r}"),
            )
            if encoded.buffers:
                self._policy.sent_frames(encoded.buffers)
            return encoded, placer
        except (ValidationError, EncodeError) as exc:
            if placer is not None:
                placer.abort()
            self._bad_result(call, exc)
        except TensorTransportError as exc:
            self._error(call, ErrorCode.TENSOR_TRANSPORT, str(exc))
        return None

    def _placer(self, call: Call) -> PolicyPlacer | None:
        # The CALL's flags say how the client wants result tensors; it only asks for
        # torch_shm when it can attach to ours, and shm.peer_receives says it told us so.
        results = call.results
        shm = call.session.shm
        if not results & _SHM_BITS or shm is None:
            return None
        mode = "torch_shm" if results & _SHM_RESULTS_ALL else "auto"
        return self._policy.placer(mode, call.session, peer_receives=shm.peer_receives)

    def _resolver(self, call: Call, payload: object) -> LazyResolver | None:
        # Handles are resolved against the process the kernel attested for the session,
        # and only from a message on that connection (``payload``'s); a failure to attach
        # is answered with TENSOR_TRANSPORT before the handler runs, and the client
        # resends as frames.
        shm = call.session.shm
        if shm is None:
            return None
        # Built on the client's regions (one copy in all) until our first reply, which
        # ends the client's lease: _detach() runs before it. Made on the first handle.
        return self._policy.peers.lazy_resolver(
            call.session, frame=payload, keep=(call.session, call.call_id)
        )

    def _item_resolver(self, call: Call, payload: object) -> LazyResolver | None:
        # A request item's handles, resolved like the arguments' (`_resolver`) but kept
        # under a key of their own until the call's final reply (`_streams` rule 6).
        shm = call.session.shm
        if shm is None:
            return None
        return self._policy.peers.lazy_resolver(
            call.session, frame=payload, keep=(call.session, call.call_id, "items")
        )

    def _detach(self, call: Call, *, final: bool = False) -> None:
        """The client takes its argument regions back with our first reply, and its
        request items' regions with the ``final`` one (the protocol ends their leases
        when it builds that reply): tensors still alive on them get pages of their own
        first."""
        keep = call.keep
        if keep is not None:
            self._policy.memory.detach(keep)
        if final and call.request is not None and call.request.keep is not None:
            self._policy.memory.detach(call.request.keep)

    def _copied_inline(
        self, call: Call, placer: PolicyPlacer | None, *, final: bool = False
    ) -> bool:
        """`_detach` here when neither it nor the reply's pool copies move a large buffer
        (the common case: no coroutine); False: `_copy_off_loop` has it to do."""
        keep = call.keep
        memory = self._policy.memory
        if (placer is not None and placer.pending_bytes) or (
            keep is not None and memory.detach_bytes(keep) >= release_threshold()
        ):
            return False
        items = call.request.keep if final and call.request is not None else None
        if items is not None and memory.detach_bytes(items) >= release_threshold():
            return False
        self._detach(call, final=final)
        return True

    async def _copy_off_loop(
        self, call: Call, placer: PolicyPlacer | None, *, final: bool = False
    ) -> bool:
        """`_detach`, and copy the reply's large tensors into the pool (`PolicyPlacer.fill`),
        on a worker thread (the copies release the GIL), so the loop keeps serving small
        calls meanwhile. False: it failed, ERROR sent."""
        keep = call.keep
        items = call.request.keep if final and call.request is not None else None
        memory = self._policy.memory

        def copy() -> None:
            if keep is not None:
                memory.detach(keep)
            if items is not None:
                memory.detach(items)
            if placer is not None:
                placer.fill()

        try:
            # Not abandoned on cancellation: the region must not be released mid-copy.
            await anyio.to_thread.run_sync(copy)
        except OSError as exc:
            if placer is not None:
                placer.abort()
            self._error(
                call,
                ErrorCode.TENSOR_TRANSPORT,
                f"cannot copy {call.spec.qualname}'s result into shared memory: {exc.strerror}",
            )
            return False
        except BaseException:
            if placer is not None:
                placer.abort()
            raise
        return True

    def _end_args(self, call: Call) -> None:
        """A call that ends without a reply (cancelled, client gone): argument tensors
        still alive get pages of their own, then the protocol RELEASEs the argument
        leases the call owes the client (`ServerProtocol.args_done`)."""
        if call.session.shm is None:  # the session ended: its regions are forgotten
            self._proto.args_done(call)
            return
        self._detach(call, final=True)
        unread: tuple[int, ...] = ()
        if call.cancelled and call.payload is not None:  # never decoded: read its lease ids
            unread = self._lease_ids(call.payload, call.buffers)
        unread_items: list[int] = []
        stream = call.request
        if call.cancelled and stream is not None:  # items never taken: their lease ids
            unread_items = [
                lease
                for payload, buffers in stream.items
                for lease in self._lease_ids(payload, buffers)
            ]
            _drop_request_items(stream)  # a large one is freed off the loop
        self._proto.args_done(call, unread, unread_items)

    def _lease_ids(self, payload: Buffer, buffers: Sequence[Buffer]) -> tuple[int, ...]:
        """The lease ids the handles of a message never decoded name (nothing attached)."""
        collector = LeaseCollector()
        try:
            _codec.decode(payload, buffers, self._codec, resolver=collector)
        except TensorRPCError:  # undecodable: it named no lease we could release
            logger.debug("lease ids of a cancelled call unreadable", exc_info=True)
        return tuple(collector.leases)

    def _reply_stopped(self, call: Call) -> None:
        """The call's scope was cancelled: say why, unless the client gave up on it."""
        if call.shutdown:
            self._error(
                call,
                ErrorCode.DRAINING,
                f"engine {self._engine_id!r} shut down before {call.spec.qualname} finished "
                f"(grace period {self._grace_period} s)",
            )
        else:
            self._error(
                call,
                ErrorCode.DEADLINE_EXCEEDED,
                f"{call.spec.qualname} ran past its deadline and was cancelled",
            )

    async def _reply(self, call: Call) -> None:
        """Answer a unary call from its outcome (nothing if the client gave up on it)."""
        if _gone(call) or self._refused_item(call):
            return
        if call.failure is not None:
            self._reply_exception(call, call.failure)
            return
        if call.result is MISSING:
            self._reply_stopped(call)
            return
        result, call.result = call.result, None  # the send keeps what it needs
        done = self._encode(call, result, OFF_LOOP_BYTES)
        del result  # a large result dies with the send
        if isinstance(done, _OffLoop):
            done = await self._encode_off_loop(call, done)
        if done is None:
            return
        encoded, placer = done
        if not self._copied_inline(call, placer, final=True) and not await self._copy_off_loop(
            call, placer, final=True
        ):
            return
        if not self._proto.result(call, encoded.payload, encoded.buffers):
            if placer is not None:  # cancelled meanwhile: no reply
                placer.abort()
            return
        await self._send_encoded(call, encoded)

    def _refused_item(self, call: Call) -> bool:
        """A request item was refused: the call's answer is that ERROR, whatever the
        handler made of it."""
        request = call.request
        if request is None or request.refused is None:
            return False
        code, message, path = request.refused
        self._error(call, code, message, path=path)
        return True

    def _reply_exception(self, call: Call, exc: BaseException) -> None:
        if isinstance(exc, ItemRefused):  # batching: the batcher ended the item
            self._error(call, exc.code, str(exc))
            return
        if isinstance(exc, PermissionDeniedError):  # an interceptor or the handler refused
            self._error(call, ErrorCode.PERMISSION_DENIED, str(exc), type_name(exc))
            return
        self._error(
            call,
            ErrorCode.REMOTE,
            str(exc),
            type_name(exc),
            "".join(traceback.format_exception(exc)),
        )

    async def _send_encoded(self, call: Call, encoded: _codec.Encoded) -> None:
        """Send the reply the protocol just queued for ``encoded``."""
        if encoded.buffers:
            await self._send_reply(call, encoded.keepalive)
        else:
            await self._send_reply(call, None)
            if encoded.keepalive:  # torch_shm: tensors already copied into the pool
                later_if_large(encoded.keepalive, held_nbytes(encoded.keepalive))

    # -- streams ----------------------------------------------------------------------------

    async def _run_stream(
        self,
        call: Call,
        args: list[Any],
        deadline: float,
        token: Token[tuple[Call, str, float]],
    ) -> None:
        """Run a stream and end it (``token``: undo the call's context when done)."""
        try:
            await self._stream(call, args, deadline)
        finally:
            _context.leave(token)

    async def _stream(self, call: Call, args: list[Any], deadline: float) -> None:
        gen: AsyncGenerator[Any, None] | None = None
        failure: BaseException | None = None
        finished = False

        async def run() -> None:  # the innermost ``proceed`` of the interceptors
            nonlocal gen, finished
            gen = call.fn(*args)  # type: ignore[assignment]
            assert gen is not None
            finished = await self._pump(call, gen)

        with anyio.CancelScope(deadline=deadline) as scope:
            call.scope = scope
            try:
                if self._interceptors:
                    await intercept(self._interceptors, _context.call_context(), run)
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
        if call.cancelled or call.answered or self._refused_item(call):
            return
        if failure is not None:
            self._reply_exception(call, failure)
        elif finished:
            self._detach(call, final=True)
            if self._proto.stream_end(call):
                self._flush()
        else:
            self._reply_stopped(call)

    async def _pump(self, call: Call, gen: AsyncGenerator[Any, None]) -> bool:
        """Send the generator's items as credit allows; True when it finished."""
        proto = self._proto
        while True:
            if not proto.may_send_item(call):
                if call.cancelled or call.answered or not await self._wait_credit(call):
                    return False
                continue
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                return True
            done = self._encode(call, item, OFF_LOOP_BYTES)
            del item
            if isinstance(done, _OffLoop):
                done = await self._encode_off_loop(call, done)
            if done is None:
                return False  # the ERROR is sent: nothing more
            encoded, placer = done
            if not self._copied_inline(call, placer) and not await self._copy_off_loop(
                call, placer
            ):
                return False  # the ERROR is sent: nothing more
            if not proto.stream_item(call, encoded.payload, encoded.buffers):
                if placer is not None:  # cancelled while the generator ran: nothing more
                    placer.abort()
                return False
            await self._send_encoded(call, encoded)
            # Not held until the next item: the sent item's last references are the
            # pending send's (released off the loop once ZMQ is done with it).
            del done, encoded, placer
            if call.observed is not None:  # observe: a stream item went out
                call.observed.item()

    async def _wait_credit(self, call: Call) -> bool:
        """Park until credit arrives; False (ERROR sent) when the client has too many parked."""
        reason = self._proto.park(call)
        if reason is not None:
            self._error(call, ErrorCode.OVERLOADED, reason)
            return False
        self._parked += 1
        if self._workers - self._parked < self._capacity and not self._closed:
            self._spawn()  # the pool keeps its size while this stream waits
        try:
            event = call.credit_event = anyio.Event()
            await event.wait()
        finally:
            call.credit_event = None
            self._parked -= 1
            self._proto.unpark(call)
        return True
