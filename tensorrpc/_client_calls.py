"""The client shell's calls: admission, sending, replies, retries, streams and broadcast.

Functions of the one shell (`tensorrpc._client_io.ClientIO`), each run in its caller's
task: wait for an in-flight slot (`ClientProtocol.select`, woken one per freed slot),
encode the arguments once an engine is chosen (where their tensors go, whether they fit
the engine's frame limit), send the CALL zero-copy, wait for the reply and decode it;
retry an engine's OVERLOADED refusal and fall back from torch_shm to frames.
`tensorrpc.Client` binds them to its shell once.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from tensorrpc import _codec, _observe, _release
from tensorrpc._client_events import Dropped
from tensorrpc._client_protocol import reply_error
from tensorrpc._compression import OFF_LOOP_BYTES, ZSTD
from tensorrpc._exceptions import (
    BroadcastError,
    CallTimeoutError,
    ClosedError,
    EngineDeadError,
    EngineNotFoundError,
    MethodNotFoundError,
    OverloadedError,
    PeerUnreachableError,
    TensorRPCError,
    TensorTransportError,
)
from tensorrpc._protocol import Flags, MessageKind
from tensorrpc._service import schemaless_method
from tensorrpc._stream_io import RequestSource, fill_off_loop, request_source, send_request
from tensorrpc._views import CallOptions

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from typing_extensions import Buffer

    from tensorrpc._calls import Call
    from tensorrpc._client_io import ClientIO
    from tensorrpc._compression import Compression
    from tensorrpc._engines import Engine, EngineInfo
    from tensorrpc._interceptors import ClientCall
    from tensorrpc._observe import Observer
    from tensorrpc._service import MethodSpec
    from tensorrpc.transports._policy import PolicyPlacer

__all__ = ["broadcast", "by_name", "call", "ended", "method", "next_item", "start_stream"]

logger = logging.getLogger("tensorrpc.client")

_RESULT = MessageKind.RESULT
_ERROR = MessageKind.ERROR
_U32_MAX = 0xFFFF_FFFF
# Back-off between retries of a call an engine refused as OVERLOADED (wait=True only).
_RETRY_MIN_S = 0.001
_RETRY_MAX_S = 0.05
_STREAM_FLAG = int(Flags.STREAM)
_REQUEST_STREAM_FLAG = int(Flags.REQUEST_STREAM)
_NO_WAIT_FLAG = int(Flags.NO_WAIT)
_SHM_RESULTS_FLAG = int(Flags.SHM_RESULTS)
_SHM_RESULTS_ALL_FLAG = int(Flags.SHM_RESULTS_ALL)
_COMPRESS_FLAG = int(Flags.COMPRESS)


# -- what to call --------------------------------------------------------------------------


def method(io: ClientIO, method: Callable[..., Any], *, streaming: bool) -> MethodSpec:
    """The spec of one of the service's methods, given as the class's function."""
    name = getattr(method, "__name__", None)
    spec = io.spec.methods.get(name) if isinstance(name, str) else None
    if spec is None:
        raise TypeError(f"{method!r} is not an rpc method of service {io.spec.name!r}")
    return _streaming(spec, streaming, "client.stream()", "client.call()")


def by_name(
    io: ClientIO,
    name: str,
    arguments: Mapping[str, Any],
    options: CallOptions,
    *,
    streaming: bool,
) -> tuple[MethodSpec, _codec.Encoded | None]:
    """The spec for a by-name call, and (schemaless) its pre-encoded argument map."""
    io.check_open()
    if not io.schemaless:
        spec = io.spec.methods.get(name)
        if spec is None:
            raise MethodNotFoundError(
                f"service {io.spec.name!r} has no method {name!r}; it offers: "
                + ", ".join(io.spec.methods)
            )
        return _streaming(spec, streaming, "stream_by_name()", "call_by_name()"), None
    engines = io.protocol.engines.engines
    if options.engine is not None:
        target = engines.get(options.engine)
        infos = [] if target is None else [target.info]
    else:
        infos = [engine.info for engine in engines.values()]
    spec = _schemaless_by_name(infos, name, streaming=streaming)
    for key in arguments:
        if not isinstance(key, str):
            raise TypeError(f"argument names must be str, got {key!r}")
    return spec, _encode(io, spec, dict(arguments), None)


def _streaming(spec: MethodSpec, streaming: bool, use_stream: str, use_call: str) -> MethodSpec:
    if spec.streaming != streaming:
        raise TypeError(
            f"{spec.qualname} is {'a' if spec.streaming else 'not a'} streaming method: "
            f"use {use_stream if spec.streaming else use_call}"
        )
    return spec


def _schemaless_by_name(infos: list[EngineInfo], name: str, *, streaming: bool) -> MethodSpec:
    service = infos[0].service if infos else "engine"
    # With no live engine the call itself raises EngineNotFoundError.
    builtin = name == _observe.STATISTICS_METHOD
    if infos and not builtin and not any(name in info.methods for info in infos):
        offered = sorted({m for info in infos for m in info.methods})
        raise MethodNotFoundError(
            f"unknown method {name!r}; the engine offers: {', '.join(offered)}"
        )
    for info in infos:
        if info.signatures and name in info.methods:
            if (name in info.streaming) != streaming:
                use = "stream_by_name()" if not streaming else "call_by_name()"
                raise TypeError(
                    f"{info.service}.{name} is {'not ' if streaming else ''}a streaming "
                    f"method: use {use}"
                )
            service = info.service
            break
    return schemaless_method(service, name, streaming=streaming)


# -- unary calls ---------------------------------------------------------------------------


async def call(
    io: ClientIO,
    spec: MethodSpec,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: CallOptions,
    encoded: _codec.Encoded | None = None,
    details: ClientCall | None = None,
) -> Any:
    """Run a call to completion (``encoded``: arguments encoded already; ``details``: the
    call as the client's interceptors see it)."""
    if spec.request_streaming:
        return await _call_streamed(io, spec, request_source(spec, args, kwargs), options, details)
    # Open? `_start` checks (after encoding the arguments).
    wire = None if encoded is not None else spec.encode_args(args, kwargs)
    flags = 0 if options.wait else _NO_WAIT_FLAG
    timeout = options.timeout
    if timeout is None:
        return await _attempts(io, spec, wire, encoded, options, None, flags, details)
    deadline = io.now() + timeout
    with anyio.move_on_after(timeout):
        return await _attempts(io, spec, wire, encoded, options, deadline, flags, details)
    _raise_absent(io, spec, options, timeout)
    raise CallTimeoutError(
        f"{spec.qualname} did not complete within {timeout} s"
        + (f" on engine {options.engine!r}" if options.engine else "")
    )


async def _attempts(
    io: ClientIO,
    spec: MethodSpec,
    wire: list[Any] | None,
    encoded: _codec.Encoded | None,
    options: CallOptions,
    deadline: float | None,
    flags: int,
    details: ClientCall | None,
) -> Any:
    """Run a unary call; an engine's OVERLOADED refusal is retried when ``wait``."""
    backoff = _RETRY_MIN_S
    while True:
        call = await _start(io, spec, wire, encoded, options, deadline, flags, details)
        try:
            return await _result(io, call)
        except TensorTransportError:
            if call.reply_kind is not _ERROR or not call.placed[0] or wire is None:
                raise
            # The engine could not attach to the arguments' shared memory (it answers
            # so before running the handler): resend them as frames.
            io.protocol.retrying(call)
            _shm_failed(io, call.engine, sending=True)
            if options.transport == "auto":
                io.policy.record_fallback(*call.placed)
            continue
        except OverloadedError:
            if not options.wait or call.reply_kind is not _ERROR:
                raise
            # The engine's own queue is full (other clients may fill it too): wait,
            # bounded by the caller's deadline, then try again (maybe elsewhere).
            io.protocol.retrying(call)
            io.retries += 1
        await anyio.sleep(backoff)
        backoff = min(backoff * 2, _RETRY_MAX_S)


def _raise_absent(io: ClientIO, spec: MethodSpec, options: CallOptions, timeout: float) -> None:
    """A call that waited for an engine until its deadline: say why none came."""
    if options.wait_for_ready is False:
        return
    target = options.engine
    why = io.protocol.absence(target, io.now())
    if why is not None:
        what = f"engine {target!r}" if target is not None else "live engine"
        raise EngineNotFoundError(
            f"{spec.qualname}: no {what} within {timeout} s: {why}",
            live=io.protocol.engines.live_ids(),
        )


async def _acquire(io: ClientIO, options: CallOptions, ready: bool) -> Engine:
    """Pick an engine with a free in-flight slot, waiting for one if allowed.

    A waiter is woken once per slot freed for it; one woken that finds the slot taken
    (by a caller that never queued) queues again. With ``ready`` (wait-for-ready), a
    caller also waits while no engine for it is live.
    """
    protocol = io.protocol
    waiters = io.waiters
    assert waiters is not None
    target = options.engine
    woken = False
    while True:
        engine = protocol.select(target, io.now(), woken=woken, wait_for_ready=ready)
        if protocol.pending:
            io.flush()
        if engine is not None:
            return engine
        io.check_open()
        if not options.wait and not (ready and protocol.absence(target, io.now())):
            live = protocol.engines.engines
            if (target is None and not live) or (target is not None and target not in live):
                protocol.engines.select(target)  # not live (yet): EngineNotFoundError
            what = f"engine {target!r}" if target else "every engine"
            raise OverloadedError(
                f"{what} has {protocol.engines.max_in_flight} calls in flight "
                "(max_in_flight) and wait=False"
            )
        token = waiters.new()
        protocol.capacity.add(target, token)
        try:
            await waiters.wait(token)
        except BaseException:
            protocol.capacity.discard(target, token)
            if waiters.woken(token):  # given a slot we leave unused: pass it on
                io.wake_all(protocol.capacity.released(target))
            raise
        io.check_open()
        woken = True


async def _start(
    io: ClientIO,
    spec: MethodSpec,
    wire: list[Any] | None,
    encoded: _codec.Encoded | None,
    options: CallOptions,
    deadline: float | None,
    flags: int,
    details: ClientCall | None = None,
) -> Call:
    """Pick an engine, enter the call in the table and send the CALL."""
    if io.orphans:
        io.reap_orphans()
    io.check_open()
    protocol = io.protocol
    # Wait-for-ready: by default a call with a deadline waits for a live engine.
    ready = deadline is not None if options.wait_for_ready is None else options.wait_for_ready
    engine = protocol.select(options.engine, io.now(), wait_for_ready=ready)
    if protocol.pending:
        io.flush()
    if engine is None:
        engine = await _acquire(io, options, ready)
    placer = None
    if encoded is not None:  # encoded before an engine was chosen (by name, broadcast)
        _check_sizes(io, spec, encoded, engine)
    else:
        placer, encoded = _place(io, spec, wire, engine, options)
        if encoded is None or (placer is not None and placer.pending_bytes):
            # Copies into the pool, or large frames to compress: on a worker thread.
            encoded = await _off_loop(io, spec, wire, engine, placer, encoded, options)
    now = io.now()
    policy, holds = io.policy, io.holds
    # Results freed since: the engine may reuse their memory (the CALL says so).
    returns = policy.memory.releasable(engine.peer) if holds is not None and holds.ready else ()
    lease, placed = (None, (0, 0)) if placer is None else placer.outcome()
    flags |= _result_flags(options, engine)
    buffers = encoded.buffers
    if buffers:
        policy.sent_frames(buffers)
    observed, trace = None, b""
    if io.observer is not None:  # observe: a CALL goes out (may carry trace context)
        observed, trace = _observe_call(io.observer, spec, engine, flags, encoded, placed[0])
    assert io.waiters is not None
    call = protocol.start_call(
        engine, spec, io.waiters.new(), stream=bool(flags & _STREAM_FLAG), now=now,
        payload=encoded.payload, buffers=buffers, flags=flags,
        timeout_ms=0 if deadline is None else min(_U32_MAX, max(1, int((deadline - now) * 1e3))),
        trace=trace, lease=lease, placed=placed, returns=returns,
        metadata=options._block if details is None else details.block(),
    )  # fmt: skip
    call.observed = observed
    if details is not None:
        details.sent(call)
    frames = io.take_sent()  # the CALL (a RELEASE it could not carry went first)
    if buffers and await _send_bulk(io, call, frames, encoded, flags & _STREAM_FLAG):
        return call
    if not _send_call(io, call, frames, encoded):
        await _send_call_waiting(io, call, frames, encoded)
    return call


def _observe_call(
    observer: Observer,
    spec: MethodSpec,
    engine: Engine,
    flags: int,
    encoded: _codec.Encoded,
    shm: int,
) -> tuple[_observe.CallObservation | None, bytes]:
    nbytes = len(encoded.payload) + _release.nbytes(encoded.buffers)
    return _observe.client_call(
        observer, spec.service, spec.name, engine.engine_id, bool(flags & _STREAM_FLAG),
        nbytes, shm, len(encoded.buffers),
    )  # fmt: skip


def _place(
    io: ClientIO, spec: MethodSpec, wire: object, engine: Engine, options: CallOptions
) -> tuple[PolicyPlacer | None, _codec.Encoded | None]:
    """The placer of a CALL to ``engine`` and its arguments encoded on the loop (None:
    they have frames to compress too large for it)."""
    shm = engine.shm
    placer = io.policy.placer(
        options.transport, engine.peer, peer_receives=bool(shm and shm.to_engine)
    )
    try:
        return placer, _encode(io, spec, wire, engine, placer, options.compression, OFF_LOOP_BYTES)
    except _codec.OffLoop:
        return placer, None


def _result_flags(options: CallOptions, engine: Engine) -> int:
    """The CALL flag bits that tell the engine how to send results: by torch_shm
    (then never compressed), compressed (we decode what we ask for)."""
    mode = options.transport
    shm = engine.shm
    if mode == "frames" or shm is None or not shm.from_engine:
        return _COMPRESS_FLAG if options.compression is not None and shm is None else 0
    return _SHM_RESULTS_ALL_FLAG if mode == "torch_shm" else _SHM_RESULTS_FLAG


async def _off_loop(
    io: ClientIO,
    spec: MethodSpec,
    wire: object,
    engine: Engine,
    placer: PolicyPlacer | None,
    encoded: _codec.Encoded | None,
    options: CallOptions,
) -> _codec.Encoded:
    """The work of a CALL that runs on a worker thread: the copies into the pool
    (`fill_off_loop`), or the encoding of arguments with large frames to compress
    (``encoded`` None; compression never goes with a placer). zstd and the copies
    release the GIL: the loop keeps serving meanwhile. Not abandoned on cancellation
    (nothing was sent yet: the call just ends once the thread is done).

    Raises:
        EngineDeadError: ``engine`` died meanwhile (nothing was sent to it).
    """
    if encoded is not None:
        assert placer is not None
        await fill_off_loop(placer, "the arguments")
        if not engine.alive:
            placer.abort()
    else:
        encode = functools.partial(_codec.encode, wire, io.codec, compression=options.compression)
        encoded = await anyio.to_thread.run_sync(encode)
        # Cancelled meanwhile: the thread ran to its end, but the CALL is not sent.
        await anyio.lowlevel.checkpoint_if_cancelled()
        _check_sizes(io, spec, encoded, engine)
    if not engine.alive:  # it died meanwhile: nothing to send it
        raise EngineDeadError(
            f"engine {engine.engine_id!r} died before the call was sent",
            engine_id=engine.engine_id,
        )
    return encoded


def _send_call(io: ClientIO, call: Call, frames: list[Any], encoded: _codec.Encoded) -> bool:
    """Send a CALL zero-copy if ZMQ takes it now; False: the pipe is full (then
    `_send_call_waiting`). A plain function: no coroutine on the hot path."""
    sock = io.sock
    track = bool(encoded.buffers)
    try:
        if sock is None:
            raise ClosedError("the client is closed")
        tracker = sock.send_nowait(frames, track=track)
    except anyio.WouldBlock:
        return False
    except BaseException as exc:
        raise _send_failed(io, call, exc)  # noqa: B904 - it chains what it must
    if track:
        io.tracked.add(tracker, encoded.keepalive, _release.nbytes(encoded.buffers))
    return True


async def _send_call_waiting(
    io: ClientIO, call: Call, frames: list[Any], encoded: _codec.Encoded
) -> None:
    """Send a CALL zero-copy, waiting (bounded by the caller's scope) for the pipe."""
    sock = io.sock
    track = bool(encoded.buffers)
    try:
        if sock is None:
            raise ClosedError("the client is closed")
        tracker = await sock.send(frames, track=track)
    except BaseException as exc:
        raise _send_failed(io, call, exc)  # noqa: B904 - it chains what it must
    if track:
        io.tracked.add(tracker, encoded.keepalive, _release.nbytes(encoded.buffers))


async def _send_bulk(
    io: ClientIO, call: Call, frames: list[Any], encoded: _codec.Encoded, stream: int
) -> bool:
    """Send a large CALL on the engine's bulk connection, if bound: the small calls
    behind it do not wait for its bytes (docs/design.md). False: the CALL goes on the
    control connection."""
    route = io.bulk.route(call.engine.peer, frames, encoded.buffers, stream, routed=True)
    if route is None:
        return False
    sock, parts = route
    try:
        try:
            tracker = sock.send_nowait(parts, track=True)
        except anyio.WouldBlock:
            tracker = await sock.send(parts, track=True)
    except (PeerUnreachableError, ClosedError):
        io.bulk.lost(call.engine.peer)
        return False
    except BaseException as exc:
        raise _send_failed(io, call, exc)  # noqa: B904 - it chains what it must
    io.tracked.add(tracker, encoded.keepalive, _release.nbytes(encoded.buffers))
    return True


def _send_failed(io: ClientIO, call: Call, exc: BaseException) -> BaseException:
    """The CALL could not be sent: end the call, return the leases its header carried
    by RELEASE; the exception to raise."""
    engine = call.engine
    if isinstance(exc, PeerUnreachableError):
        io.protocol.send_failed(engine.peer, io.now())
        io.flush()
        error = call.error or EngineDeadError(
            f"engine {engine.engine_id!r} is unreachable", engine_id=engine.engine_id
        )
        error.__cause__ = exc
        ended(io, call, error)
        return error  # the engine is lost: it drops our leases itself
    io.protocol.call_unsent(call, io.now())
    if not call.ended:
        io.abandon(call, error=True)
    else:
        io.flush()
    ended(io, call, exc)
    return exc


def ended(io: ClientIO, call: Call, exc: BaseException | None) -> None:
    """The caller is done with ``call`` (``exc``: how it failed): count its outcome and
    tell its observer, once."""
    outcome = "ok" if exc is None else _observe.outcome_of(exc)
    observed = call.observed
    if io.protocol.call_ended(call, outcome, io.now()) and observed is not None:
        observed.finished(outcome, 0 if call.stream else _observe.reply_bytes(call))


async def _result(io: ClientIO, call: Call) -> Any:
    """Wait for a unary call's reply and decode it (in the caller's task); count its
    end."""
    waiters = io.waiters
    assert waiters is not None
    try:
        await waiters.wait(call.waiter)
    except BaseException as exc:
        if not call.ended:
            io.abandon(call, error=True)
        elif call.reply_kind is _RESULT:  # it came, but nobody will decode it
            io.event(Dropped(call.engine, call.reply_payload, call.reply_buffers))
            io.flush()
        ended(io, call, exc)
        raise
    try:
        if call.error is not None:
            raise call.error
        if call.reply_kind is not _RESULT:
            raise reply_error(call.reply_payload)
        payload, buffers = call.reply_payload, call.reply_buffers
        if _codec.compressed_bytes(payload, buffers) >= OFF_LOOP_BYTES:
            value = await _decode_off_loop(io, call, payload, buffers)
        else:
            value = _decode(io, call, payload, buffers)
    except BaseException as exc:
        ended(io, call, exc)
        raise
    ended(io, call, None)
    return value


async def _decode_off_loop(
    io: ClientIO, call: Call, payload: Buffer, buffers: Sequence[Buffer]
) -> Any:
    """`_decode` of a reply with large compressed frames: the decompression runs on a
    worker thread (zstd releases the GIL), the rest on the loop. An engine that may send
    torch_shm handles never compresses (docs/protocol.md §6): its replies are decoded on
    the loop, with the resolver; elsewhere a handle is refused."""
    shm = call.engine.shm
    if shm is not None and shm.from_engine:
        return _decode(io, call, payload, buffers)
    if buffers:
        io.policy.received_frames(buffers)
    decode = functools.partial(_codec.decode, payload, buffers, io.codec)
    try:
        value = await anyio.to_thread.run_sync(decode)
        return call.spec.decode_result(value)
    except TensorRPCError:
        io.protocol.undecodable(call)
        raise


def _decode(io: ClientIO, call: Call, payload: Buffer, buffers: Sequence[Buffer]) -> Any:
    """Decode a RESULT or stream item and release the torch_shm leases it carried.

    The resolver is kept after torch_shm *from* the engine was switched off: replies
    already in flight may still carry handles, and must fail (or succeed) as transport
    errors, not as undecodable messages. Handles from an engine not attested (or lost),
    or on another connection than ``payload`` came on, are refused with a
    TensorTransportError. Result tensors are built on the engine's regions, leased to us
    until they are freed.
    """
    engine = call.engine
    resolver = io.policy.peers.lazy_resolver(engine.peer, frame=payload, hold=engine.peer)
    if buffers:
        io.policy.received_frames(buffers)
    try:
        value = _codec.decode(payload, buffers, io.codec, resolver=resolver)
        return call.spec.decode_result(value)
    except TensorRPCError as exc:
        io.protocol.undecodable(call)
        if isinstance(exc, TensorTransportError):
            _shm_failed(io, engine, sending=False)
        raise
    finally:
        if resolver is not None and resolver.inner is not None:
            io.release_later(engine, resolver.inner)


def _encode(
    io: ClientIO,
    spec: MethodSpec,
    wire: object,
    engine: Engine | None,
    placer: PolicyPlacer | None = None,
    compression: Compression | None = None,
    off_loop: int = 0,
) -> _codec.Encoded:
    """Encode arguments and refuse a frame over our ``maxmsgsize`` or the engine's
    (``placer``: released if the arguments are refused). ``compression`` only for an
    engine that decodes zstd and shares no memory with us (another host, or not
    attested): never where torch_shm is in use.

    Raises:
        OffLoop: ``off_loop`` bytes or more to compress (see `_codec.encode`).
    """
    if engine is None or engine.shm is not None or ZSTD not in engine.info.compression:
        compression = None
    try:
        encoded = _codec.encode(
            wire, io.codec, placer=placer, compression=compression, off_loop=off_loop
        )
        _check_sizes(io, spec, encoded, engine)
    except BaseException:
        if placer is not None:
            placer.abort()
        raise
    return encoded


def _check_sizes(
    io: ClientIO, spec: MethodSpec, encoded: _codec.Encoded, engine: Engine | None
) -> None:
    """A frame over the receiver's MAXMSGSIZE makes its ZMQ drop the whole connection
    without a word, so it is refused here, before sending."""
    if engine is not None and not encoded.buffers:  # the small call's path
        limit = engine.frame_limit
        if limit == 0 or 0 < len(encoded.payload) <= limit:
            return
    _codec.check_message_size(
        encoded,
        io.maxmsgsize,
        0 if engine is None else engine.info.max_message_bytes,
        lambda: (
            f"{spec.qualname}: the arguments",
            "engine" if engine is None else f"engine {engine.engine_id!r}",
        ),
    )


def _shm_failed(io: ClientIO, engine: Engine, *, sending: bool) -> None:
    """The engine could not attach to our handles (or we to its): frames from now on."""
    if io.protocol.shm_failed(engine, sending=sending):
        logger.warning(
            "torch_shm %s engine %r failed; using frames from now on",
            "to" if sending else "from",
            engine.engine_id,
        )


# -- streams -------------------------------------------------------------------------------


async def _call_streamed(
    io: ClientIO,
    spec: MethodSpec,
    source: RequestSource,
    options: CallOptions,
    details: ClientCall | None,
) -> Any:
    """A call whose request is a stream and whose response one value (no retries: the
    caller's items cannot be taken twice)."""
    timeout = options.timeout
    deadline = None if timeout is None else io.now() + timeout
    with anyio.move_on_after(math.inf if timeout is None else timeout):
        call = await start_stream(io, spec, source, options, deadline, None, details)
        return await _result(io, call)
    _raise_absent(io, spec, options, timeout or 0.0)
    raise CallTimeoutError(f"{spec.qualname} did not complete within {timeout} s")


async def start_stream(
    io: ClientIO,
    spec: MethodSpec,
    wire: list[Any] | RequestSource | None,
    options: CallOptions,
    deadline: float | None,
    encoded: _codec.Encoded | None = None,
    details: ClientCall | None = None,
) -> Call:
    """Start a call whose request or response is a stream (``wire``: the arguments, or
    the request items of a request stream)."""
    io.check_open()
    flags = _STREAM_FLAG if spec.streaming else 0
    if not options.wait:
        flags |= _NO_WAIT_FLAG
    source = None
    if isinstance(wire, RequestSource):
        source, wire = wire, []
        flags |= _REQUEST_STREAM_FLAG
    with anyio.move_on_after(math.inf if deadline is None else deadline - io.now()):
        call = await _start(io, spec, wire, encoded, options, deadline, flags, details)
        if source is not None:  # the sender of a request stream's items (its own task)
            io.spawn(
                send_request, io, call, source, options.compression, io.maxmsgsize,
                options.transport,
            )  # fmt: skip
        return call
    _raise_absent(io, spec, options, options.timeout or 0.0)
    raise CallTimeoutError(f"{spec.qualname} stream did not start within {options.timeout} s")


async def next_item(io: ClientIO, call: Call, deadline: float | None) -> Any:
    """The next item of a stream (StopAsyncIteration at its end)."""
    items = call.items
    waiters = io.waiters
    assert items is not None
    assert waiters is not None
    while not items:
        if call.ended:
            if call.error is not None:
                raise call.error
            if call.reply_kind is _ERROR:
                raise reply_error(call.reply_payload)
            raise StopAsyncIteration
        call.waiter = waiters.new()
        if deadline is None:
            await waiters.wait(call.waiter)
        else:
            with anyio.move_on_after(deadline - io.now()):
                await waiters.wait(call.waiter)
                continue
            io.abandon(call, error=True)
            raise CallTimeoutError(f"{call.spec.qualname} stream passed its deadline")
    payload, buffers = io.protocol.take_item(call, io.now())
    if call.observed is not None:  # observe: a stream item is taken
        call.observed.item()
    io.flush()
    if _codec.compressed_bytes(payload, buffers) >= OFF_LOOP_BYTES:
        return await _decode_off_loop(io, call, payload, buffers)
    return _decode(io, call, payload, buffers)


# -- broadcast -----------------------------------------------------------------------------


async def broadcast(
    io: ClientIO,
    name: str,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: CallOptions,
) -> dict[str, Any]:
    """Call a unary method on every live engine: engine id -> result."""
    io.check_open()
    spec = io.spec.methods.get(name)
    if spec is None or spec.streaming:
        raise TypeError(f"{io.spec.name!r} has no unary rpc method {name!r}")
    wire = spec.encode_args(args, kwargs)
    engines = io.protocol.engines.live_ids()
    if not engines:
        io.protocol.engines.select(None)  # raises EngineNotFoundError
    encoded = _encode(io, spec, wire, None)
    results: dict[str, Any] = {}

    async def one(engine_id: str) -> None:
        opts = CallOptions(
            engine=engine_id,
            timeout=options.timeout,
            wait=options.wait,
            transport=options.transport,
            compression=options.compression,
            metadata=options.metadata,
        )
        try:
            results[engine_id] = await call(io, spec, (), {}, opts, encoded)
        except TensorRPCError as exc:
            results[engine_id] = exc

    async with anyio.create_task_group() as tg:
        for engine_id in engines:
            tg.start_soon(one, engine_id)
    ordered = {k: results[k] for k in engines}
    failed = [k for k, v in ordered.items() if isinstance(v, BaseException)]
    if failed:
        raise BroadcastError(
            f"broadcast of {spec.qualname} failed on {len(failed)} of {len(engines)} "
            f"engines: " + "; ".join(f"{k}: {ordered[k]!r}" for k in failed),
            results=ordered,
        )
    return ordered
