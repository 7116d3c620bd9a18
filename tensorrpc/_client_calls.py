"""The client's calls: admission, sending, replies, retries, streams and broadcast.

`CallRunner` runs each call in its caller's task: it waits for an in-flight slot
(`ClientProtocol.select`, woken one per freed slot), encodes the arguments once an
engine is chosen (where their tensors go, whether they fit the engine's frame limit),
sends the CALL zero-copy, waits for the reply and decodes it; it retries an engine's
OVERLOADED refusal and falls back from torch_shm to frames. The socket, the reader, the
wake-ups and the clock belong to `tensorrpc._client_io.ClientIO`.
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
from tensorrpc._client_protocol import Dropped, reply_error
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
    from tensorrpc._client_protocol import ClientProtocol
    from tensorrpc._compression import Compression
    from tensorrpc._engines import Engine, EngineInfo
    from tensorrpc._interceptors import ClientCall
    from tensorrpc._service import MethodSpec, ServiceSpec
    from tensorrpc._zmq import AsyncSocket
    from tensorrpc.transports._links import LazyResolver
    from tensorrpc.transports._policy import PolicyPlacer

__all__ = ["CallRunner"]

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


class CallRunner:
    """Runs the calls of one client (each in its caller's task).

    Args:
        io: The client's I/O loop (socket, waiters, wake-ups).
        spec: The service the client calls.
        schemaless: The client was made by `Client.dynamic`.
    """

    __slots__ = (
        "_holds",
        "_io",
        "_maxmsgsize",
        "_policy",
        "_protocol",
        "_schemaless",
        "_spec",
        "retries",
    )

    def __init__(
        self, io: ClientIO, spec: ServiceSpec, *, schemaless: bool, maxmsgsize: int
    ) -> None:
        self._io = io
        self._protocol: ClientProtocol = io.protocol
        self._policy = io.policy
        self._holds = io.policy.memory.holds
        self._maxmsgsize = maxmsgsize
        self._spec = spec
        self._schemaless = schemaless
        #: Calls retried after an engine's OVERLOADED refusal.
        self.retries = 0

    def method(self, method: Callable[..., Any], *, streaming: bool) -> MethodSpec:
        name = getattr(method, "__name__", None)
        spec = self._spec.methods.get(name) if isinstance(name, str) else None
        if spec is None:
            raise TypeError(f"{method!r} is not an rpc method of service {self._spec.name!r}")
        if spec.streaming != streaming:
            use = "client.stream()" if spec.streaming else "client.call()"
            raise TypeError(
                f"{spec.qualname} is {'a' if spec.streaming else 'not a'} "
                f"streaming method: use {use}"
            )
        return spec

    def by_name(
        self,
        name: str,
        arguments: Mapping[str, Any],
        options: CallOptions,
        *,
        streaming: bool,
    ) -> tuple[MethodSpec, _codec.Encoded | None]:
        """The spec for a by-name call, and (schemaless) its pre-encoded argument map."""
        self._io.check_open()
        if not self._schemaless:
            return _typed_by_name(self._spec, name, streaming=streaming), None
        engines = self._protocol.engines.engines
        if options.engine is not None:
            target = engines.get(options.engine)
            infos = [] if target is None else [target.info]
        else:
            infos = [engine.info for engine in engines.values()]
        spec = _schemaless_by_name(infos, name, streaming=streaming)
        for key in arguments:
            if not isinstance(key, str):
                raise TypeError(f"argument names must be str, got {key!r}")
        return spec, self._encode(spec, dict(arguments), None)

    async def _acquire(self, options: CallOptions, ready: bool) -> Engine:
        """Pick an engine with a free in-flight slot, waiting for one if allowed.

        A waiter is woken once per slot freed for it; one woken that finds the slot
        taken (by a caller that never queued) queues again. With ``ready``
        (wait-for-ready), a caller also waits while no engine for it is live.
        """
        protocol = self._protocol
        waiters = self._io.waiters
        assert waiters is not None
        target = options.engine
        now = self._io.now
        engine = self._select(target, now(), woken=False, ready=ready)
        while engine is None:
            self._io.check_open()
            if not options.wait and not (ready and protocol.absence(target, now())):
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
                    self._io.wake_all(protocol.capacity.released(target))
                raise
            self._io.check_open()
            engine = self._select(target, now(), woken=True, ready=ready)
        return engine

    def _select(self, target: str | None, now: float, *, woken: bool, ready: bool) -> Engine | None:
        """`ClientProtocol.select` at ``now``, acting on the sessions it found forgotten."""
        protocol = self._protocol
        engine = protocol.select(target, now, woken=woken, wait_for_ready=ready)
        if protocol.pending:
            self._io.flush()
        return engine

    async def _start(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        encoded: _codec.Encoded | None,
        options: CallOptions,
        deadline: float | None,
        flags: int,
        details: ClientCall | None = None,
    ) -> Call:
        """Pick an engine, enter the call in the table and send the CALL (``details``:
        the call as the client's interceptors see it)."""
        if self._io.orphans:
            self._io.reap_orphans()
        self._io.check_open()
        now = self._io.now()
        protocol = self._protocol
        # Wait-for-ready: by default a call with a deadline waits for a live engine.
        ready = deadline is not None if options.wait_for_ready is None else options.wait_for_ready
        # `_select`, inline (the hot path)
        engine = protocol.select(options.engine, now, wait_for_ready=ready)
        if protocol.pending:
            self._io.flush()
        if engine is None:
            engine = await self._acquire(options, ready)
            now = self._io.now()
        policy = self._policy
        placer = None
        if encoded is not None:
            # Encoded before an engine was chosen (by name, broadcast): check its limit.
            self._check_sizes(spec, encoded, engine)
        else:
            shm = engine.shm
            placer = policy.placer(
                options.transport, engine.peer, peer_receives=bool(shm and shm.to_engine)
            )
            encoded = self._encode_here(spec, wire, engine, placer, options.compression)
            if encoded is None or (placer is not None and placer.pending_bytes):
                # Copies into the pool, or large frames to compress: on a worker thread.
                encoded = await self._off_loop(spec, wire, engine, placer, encoded, options)
                now = self._io.now()
        holds = self._holds
        # Results freed since: the engine may reuse their memory (the CALL says so).
        returns = policy.memory.releasable(engine.peer) if holds is not None and holds.ready else ()
        lease, placed = (None, (0, 0)) if placer is None else placer.outcome()
        flags |= _result_flags(options, engine)
        if encoded.buffers:
            policy.sent_frames(encoded.buffers)
        timeout_ms = _timeout_ms(deadline, self._io.now)
        observed, trace = None, b""
        if self._io.observer is not None:  # observe: a CALL goes out (may carry trace context)
            observed, trace = self._observe_start(spec, engine, flags, encoded, placed[0])
        assert self._io.waiters is not None
        call = protocol.start_call(
            engine, spec, self._io.waiters.new(), stream=bool(flags & _STREAM_FLAG), now=now,
            payload=encoded.payload, buffers=encoded.buffers, flags=flags,
            timeout_ms=timeout_ms, trace=trace, lease=lease, placed=placed, returns=returns,
            metadata=_metadata_block(options, details),
        )  # fmt: skip
        call.observed = observed
        if details is not None:
            details.sent(call)
        frames = self._io.take_sent()  # the CALL (a RELEASE it could not carry went first)
        # A large CALL goes on the engine's bulk connection, if bound: the small calls
        # behind it do not wait for its bytes (docs/design.md).
        route = self._io.bulk.route(
            engine.peer, frames, encoded.buffers, flags & _STREAM_FLAG, routed=True
        )
        if route is not None and await self._send_bulk(call, route, encoded):
            return call
        if not self._send_call(call, frames, encoded):
            await self._send_call_waiting(call, frames, encoded)
        return call

    def _observe_start(
        self, spec: MethodSpec, engine: Engine, flags: int, encoded: _codec.Encoded, shm: int
    ) -> tuple[_observe.CallObservation | None, bytes]:
        assert self._io.observer is not None
        nbytes = len(encoded.payload) + sum(b.nbytes for b in encoded.buffers)
        return _observe.client_call(
            self._io.observer, spec.service, spec.name, engine.engine_id,
            bool(flags & _STREAM_FLAG), nbytes, shm, len(encoded.buffers),
        )  # fmt: skip

    def _encode_here(
        self,
        spec: MethodSpec,
        wire: object,
        engine: Engine,
        placer: PolicyPlacer | None,
        compression: Compression | None,
    ) -> _codec.Encoded | None:
        """`_encode` on the loop; None when it has frames to compress too large for it."""
        try:
            return self._encode(spec, wire, engine, placer, compression, OFF_LOOP_BYTES)
        except _codec.OffLoop:
            return None

    async def _off_loop(
        self,
        spec: MethodSpec,
        wire: object,
        engine: Engine,
        placer: PolicyPlacer | None,
        encoded: _codec.Encoded | None,
        options: CallOptions,
    ) -> _codec.Encoded:
        """The work of a CALL that runs on a worker thread: the copies into the pool
        (`_fill`), or the encoding of arguments with large frames to compress (``encoded``
        None; compression never goes with a placer). zstd and the copies release the
        GIL: the loop keeps serving meanwhile. Not abandoned on cancellation (nothing was
        sent yet: the call just ends once the thread is done).

        Raises:
            EngineDeadError: ``engine`` died meanwhile (nothing was sent to it).
        """
        if encoded is not None:
            assert placer is not None
            await self._fill(placer, engine)
            return encoded
        encode = functools.partial(
            _codec.encode, wire, self._io.codec, compression=options.compression
        )
        encoded = await anyio.to_thread.run_sync(encode)
        # Cancelled meanwhile: the thread ran to its end, but the CALL is not sent.
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._check_sizes(spec, encoded, engine)
        if not engine.alive:
            raise EngineDeadError(
                f"engine {engine.engine_id!r} died before the call was sent",
                engine_id=engine.engine_id,
            )
        return encoded

    async def _fill(self, placer: PolicyPlacer, engine: Engine) -> float:
        """Copy the large argument tensors into the pool off the loop (`fill_off_loop`).

        Returns:
            The clock once the copies are done.

        Raises:
            TensorTransportError: the kernel refused the copy's pages.
            EngineDeadError: ``engine`` died meanwhile (nothing was sent to it).
        """
        await fill_off_loop(placer, "the arguments")
        if not engine.alive:  # it died during the copy: nothing to send it
            placer.abort()
            raise EngineDeadError(
                f"engine {engine.engine_id!r} died before the call was sent",
                engine_id=engine.engine_id,
            )
        return self._io.now()

    def _send_call(self, call: Call, frames: list[Any], encoded: _codec.Encoded) -> bool:
        """Send a CALL zero-copy if ZMQ takes it now; False: the pipe is full (then
        `_send_call_waiting`). A plain function: no coroutine on the hot path."""
        sock = self._io.sock
        track = bool(encoded.buffers)
        try:
            if sock is None:
                raise ClosedError("the client is closed")
            tracker = sock.send_nowait(frames, track=track)
        except anyio.WouldBlock:
            return False
        except BaseException as exc:
            raise self._send_failed(call, exc)  # noqa: B904 - it chains what it must
        if track:
            self._io.tracked.add(tracker, encoded.keepalive, _release.nbytes(encoded.buffers))
        return True

    async def _send_call_waiting(
        self, call: Call, frames: list[Any], encoded: _codec.Encoded
    ) -> None:
        """Send a CALL zero-copy, waiting (bounded by the caller's scope) for the pipe."""
        sock = self._io.sock
        track = bool(encoded.buffers)
        try:
            if sock is None:
                raise ClosedError("the client is closed")
            tracker = await sock.send(frames, track=track)
        except BaseException as exc:
            raise self._send_failed(call, exc)  # noqa: B904 - it chains what it must
        if track:
            self._io.tracked.add(tracker, encoded.keepalive, _release.nbytes(encoded.buffers))

    async def _send_bulk(
        self, call: Call, route: tuple[AsyncSocket, list[Any]], encoded: _codec.Encoded
    ) -> bool:
        """Send a large CALL on the bulk connection; False: that connection is gone (the
        CALL goes on the control one)."""
        sock, parts = route
        try:
            try:
                tracker = sock.send_nowait(parts, track=True)
            except anyio.WouldBlock:
                tracker = await sock.send(parts, track=True)
        except (PeerUnreachableError, ClosedError):
            self._io.bulk.lost(call.engine.peer)
            return False
        except BaseException as exc:
            raise self._send_failed(call, exc)  # noqa: B904 - it chains what it must
        self._io.tracked.add(tracker, encoded.keepalive, _release.nbytes(encoded.buffers))
        return True

    def _send_failed(self, call: Call, exc: BaseException) -> BaseException:
        """The CALL could not be sent: end the call, return the leases its header carried
        by RELEASE; the exception to raise."""
        engine = call.engine
        if isinstance(exc, PeerUnreachableError):
            self._protocol.send_failed(engine.peer, self._io.now())
            self._io.flush()
            error = call.error or EngineDeadError(
                f"engine {engine.engine_id!r} is unreachable", engine_id=engine.engine_id
            )
            error.__cause__ = exc
            self.ended(call, error)
            return error  # the engine is lost: it drops our leases itself
        self._protocol.call_unsent(call, self._io.now())
        if not call.ended:
            self._io.abandon(call, error=True)
        else:
            self._io.flush()
        self.ended(call, exc)
        return exc

    def ended(self, call: Call, exc: BaseException | None) -> None:
        """The caller is done with ``call`` (``exc``: how it failed): count its outcome
        and tell its observer, once."""
        outcome = _observe.outcome_of(exc)
        observed = call.observed
        if self._protocol.call_ended(call, outcome, self._io.now()) and observed is not None:
            observed.finished(outcome, 0 if call.stream else _observe.reply_bytes(call))

    async def _result(self, call: Call) -> Any:
        """Wait for a unary call's reply and decode it (in the caller's task); count its
        end."""
        waiters = self._io.waiters
        assert waiters is not None
        try:
            await waiters.wait(call.waiter)
        except BaseException as exc:
            if not call.ended:
                self._io.abandon(call, error=True)
            elif call.reply_kind is _RESULT:  # it came, but nobody will decode it
                self._io.event(Dropped(call.engine, call.reply_payload, call.reply_buffers))
                self._io.flush()
            self.ended(call, exc)
            raise
        try:
            if call.error is not None:
                raise call.error
            if call.reply_kind is not _RESULT:
                raise reply_error(call.reply_payload)
            payload, buffers = call.reply_payload, call.reply_buffers
            if _codec.compressed_bytes(payload, buffers) >= OFF_LOOP_BYTES:
                value = await self._decode_off_loop(call, payload, buffers)
            else:
                value = self._decode(call, payload, buffers)
        except BaseException as exc:
            self.ended(call, exc)
            raise
        self.ended(call, None)
        return value

    async def _decode_off_loop(self, call: Call, payload: Buffer, buffers: Sequence[Buffer]) -> Any:
        """`_decode` of a reply with large compressed frames: the decompression runs on a
        worker thread (zstd releases the GIL), the rest on the loop. An engine that may
        send torch_shm handles never compresses (docs/protocol.md §6): its replies are
        decoded on the loop, with the resolver; elsewhere a handle is refused."""
        shm = call.engine.shm
        if shm is not None and shm.from_engine:
            return self._decode(call, payload, buffers)
        if buffers:
            self._policy.received_frames(buffers)
        decode = functools.partial(_codec.decode, payload, buffers, self._io.codec)
        try:
            value = await anyio.to_thread.run_sync(decode)
            return call.spec.decode_result(value)
        except TensorRPCError:
            self._protocol.undecodable(call)
            raise

    def _decode(self, call: Call, payload: Buffer, buffers: Sequence[Buffer]) -> Any:
        """Decode a RESULT or stream item and release the torch_shm leases it carried."""
        engine = call.engine
        resolver = self._resolver(engine, payload)
        if buffers:
            self._policy.received_frames(buffers)
        try:
            value = _codec.decode(payload, buffers, self._io.codec, resolver=resolver)
            return call.spec.decode_result(value)
        except TensorRPCError as exc:
            self._protocol.undecodable(call)
            if isinstance(exc, TensorTransportError):
                self._shm_failed(engine, sending=False)
            raise
        finally:
            if resolver is not None and resolver.inner is not None:
                self._io.release_later(engine, resolver.inner)

    async def call(
        self,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: CallOptions,
        encoded: _codec.Encoded | None = None,
        details: ClientCall | None = None,
    ) -> Any:
        if spec.request_streaming:
            return await self._call_streamed(
                spec, request_source(spec, args, kwargs), options, details
            )
        # Open? `_start` checks (after encoding the arguments).
        wire = None if encoded is not None else spec.encode_args(args, kwargs)
        flags = 0 if options.wait else _NO_WAIT_FLAG
        timeout = options.timeout
        if timeout is None:
            return await self._attempts(spec, wire, encoded, options, None, flags, details)
        deadline = self._io.now() + timeout
        with anyio.move_on_after(timeout):
            return await self._attempts(spec, wire, encoded, options, deadline, flags, details)
        self._raise_absent(spec, options, timeout)
        raise CallTimeoutError(
            f"{spec.qualname} did not complete within {timeout} s"
            + (f" on engine {options.engine!r}" if options.engine else "")
        )

    def _raise_absent(self, spec: MethodSpec, options: CallOptions, timeout: float) -> None:
        """A call that waited for an engine until its deadline: say why none came."""
        if options.wait_for_ready is False:
            return
        target = options.engine
        why = self._protocol.absence(target, self._io.now())
        if why is not None:
            what = f"engine {target!r}" if target is not None else "live engine"
            raise EngineNotFoundError(
                f"{spec.qualname}: no {what} within {timeout} s: {why}",
                live=self._protocol.engines.live_ids(),
            )

    async def _attempts(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        encoded: _codec.Encoded | None,
        options: CallOptions,
        deadline: float | None,
        flags: int,
        details: ClientCall | None = None,
    ) -> Any:
        """Run a unary call; an engine's OVERLOADED refusal is retried when ``wait``."""
        backoff = _RETRY_MIN_S
        while True:
            call = await self._start(spec, wire, encoded, options, deadline, flags, details)
            try:
                return await self._result(call)
            except TensorTransportError:
                if call.reply_kind is not _ERROR or not call.placed[0] or wire is None:
                    raise
                # The engine could not attach to the arguments' shared memory (it answers
                # so before running the handler): resend them as frames.
                self._protocol.retrying(call)
                self._shm_failed(call.engine, sending=True)
                if options.transport == "auto":
                    self._policy.record_fallback(*call.placed)
                continue
            except OverloadedError:
                if not options.wait or call.reply_kind is not _ERROR:
                    raise
                # The engine's own queue is full (other clients may fill it too): wait,
                # bounded by the caller's deadline, then try again (maybe elsewhere).
                self._protocol.retrying(call)
                self.retries += 1
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, _RETRY_MAX_S)

    async def _call_streamed(
        self,
        spec: MethodSpec,
        source: RequestSource,
        options: CallOptions,
        details: ClientCall | None,
    ) -> Any:
        """A call whose request is a stream and whose response one value (no retries:
        the caller's items cannot be taken twice)."""
        timeout = options.timeout
        deadline = None if timeout is None else self._io.now() + timeout
        with anyio.move_on_after(math.inf if timeout is None else timeout):
            call = await self.start_stream(spec, source, options, deadline, None, details)
            return await self._result(call)
        self._raise_absent(spec, options, timeout or 0.0)
        raise CallTimeoutError(f"{spec.qualname} did not complete within {timeout} s")

    async def start_stream(
        self,
        spec: MethodSpec,
        wire: list[Any] | RequestSource | None,
        options: CallOptions,
        deadline: float | None,
        encoded: _codec.Encoded | None = None,
        details: ClientCall | None = None,
    ) -> Call:
        """Start a call whose request or response is a stream (``wire``: the arguments,
        or the request items of a request stream)."""
        self._io.check_open()
        flags = _STREAM_FLAG if spec.streaming else 0
        if not options.wait:
            flags |= _NO_WAIT_FLAG
        source = None
        if isinstance(wire, RequestSource):
            source, wire = wire, []
            flags |= _REQUEST_STREAM_FLAG
        if deadline is None:
            call = await self._start(spec, wire, encoded, options, None, flags, details)
            return self._sending(call, source, options)
        with anyio.move_on_after(deadline - self._io.now()):
            call = await self._start(spec, wire, encoded, options, deadline, flags, details)
            return self._sending(call, source, options)
        self._raise_absent(spec, options, options.timeout or 0.0)
        raise CallTimeoutError(f"{spec.qualname} stream did not start within {options.timeout} s")

    def _sending(self, call: Call, source: RequestSource | None, options: CallOptions) -> Call:
        """Start the sender of a request stream's items (its own task)."""
        if source is not None:
            args = (
                self._io, call, source, options.compression, self._maxmsgsize, options.transport
            )  # fmt: skip
            self._io.spawn(send_request, *args)
        return call

    async def next_item(self, call: Call, deadline: float | None) -> Any:
        items = call.items
        waiters = self._io.waiters
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
                with anyio.move_on_after(deadline - self._io.now()):
                    await waiters.wait(call.waiter)
                    continue
                self._io.abandon(call, error=True)
                raise CallTimeoutError(f"{call.spec.qualname} stream passed its deadline")
        payload, buffers = self._protocol.take_item(call, self._io.now())
        if call.observed is not None:  # observe: a stream item is taken
            call.observed.item()
        self._io.flush()
        if _codec.compressed_bytes(payload, buffers) >= OFF_LOOP_BYTES:
            return await self._decode_off_loop(call, payload, buffers)
        return self._decode(call, payload, buffers)

    def _resolver(self, engine: Engine, frame: object) -> LazyResolver | None:
        """Resolves tensors that come back by torch_shm handle (None: torch_shm is off).

        Kept after torch_shm *from* the engine was switched off: replies that were
        already in flight may still carry handles, and must fail (or succeed) as
        transport errors, not as undecodable messages. Not attested (or lost), or
        ``frame`` (a frame of the reply) came on another connection: handles are refused
        with a TensorTransportError. Result tensors are built on the engine's regions,
        leased to us until they are freed; the torch_shm resolver is made on the reply's
        first handle only.
        """
        return self._policy.peers.lazy_resolver(engine.peer, frame=frame, hold=engine.peer)

    def _encode(
        self,
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
                wire, self._io.codec, placer=placer, compression=compression, off_loop=off_loop
            )
            self._check_sizes(spec, encoded, engine)
        except BaseException:
            if placer is not None:
                placer.abort()
            raise
        return encoded

    def _check_sizes(
        self, spec: MethodSpec, encoded: _codec.Encoded, engine: Engine | None
    ) -> None:
        """A frame over the receiver's MAXMSGSIZE makes its ZMQ drop the whole connection
        without a word, so it is refused here, before sending."""
        _codec.check_message_size(
            encoded,
            self._maxmsgsize,
            0 if engine is None else engine.info.max_message_bytes,
            lambda: (
                f"{spec.qualname}: the arguments",
                "engine" if engine is None else f"engine {engine.engine_id!r}",
            ),
        )

    def _shm_failed(self, engine: Engine, *, sending: bool) -> None:
        """The engine could not attach to our handles (or we to its): frames from now on."""
        if self._protocol.shm_failed(engine, sending=sending):
            logger.warning(
                "torch_shm %s engine %r failed; using frames from now on",
                "to" if sending else "from",
                engine.engine_id,
            )

    async def broadcast(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: CallOptions,
    ) -> dict[str, Any]:
        self._io.check_open()
        spec = self._spec.methods.get(name)
        if spec is None or spec.streaming:
            raise TypeError(f"{self._spec.name!r} has no unary rpc method {name!r}")
        wire = spec.encode_args(args, kwargs)
        engines = self._protocol.engines.live_ids()
        if not engines:
            self._protocol.engines.select(None)  # raises EngineNotFoundError
        encoded = self._encode(spec, wire, None)
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
                results[engine_id] = await self.call(spec, (), {}, opts, encoded)
            except TensorRPCError as exc:
                results[engine_id] = exc

        async with anyio.create_task_group() as tg:
            for engine_id in engines:
                tg.start_soon(one, engine_id)
        return _broadcast_outcome(spec, engines, results)


def _timeout_ms(deadline: float | None, now: Callable[[], float]) -> int:
    """A CALL's relative deadline in milliseconds at ``now()`` (0: none; at least 1 ms)."""
    if deadline is None:
        return 0
    return min(_U32_MAX, max(1, int((deadline - now()) * 1000)))


def _metadata_block(options: CallOptions, details: ClientCall | None) -> bytes:
    """The request metadata block of a CALL: the options' (encoded once), or what the
    client's interceptors made of it (checked now)."""
    return options._block if details is None else details.block()


def _result_flags(options: CallOptions, engine: Engine) -> int:
    """The CALL flag bits that tell the engine how to send results: by torch_shm
    (then never compressed), compressed (we decode what we ask for)."""
    mode = options.transport
    shm = engine.shm
    if mode == "frames" or shm is None or not shm.from_engine:
        return _COMPRESS_FLAG if options.compression is not None and shm is None else 0
    return _SHM_RESULTS_ALL_FLAG if mode == "torch_shm" else _SHM_RESULTS_FLAG


def _typed_by_name(service: ServiceSpec, name: str, *, streaming: bool) -> MethodSpec:
    spec = service.methods.get(name)
    if spec is None:
        raise MethodNotFoundError(
            f"service {service.name!r} has no method {name!r}; it offers: "
            + ", ".join(service.methods)
        )
    if spec.streaming != streaming:
        use = "stream_by_name()" if not streaming else "call_by_name()"
        raise TypeError(
            f"{spec.qualname} is {'a' if spec.streaming else 'not a'} streaming method: use {use}"
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
    use = "stream_by_name()" if not streaming else "call_by_name()"
    for info in infos:
        if info.signatures and name in info.methods:
            if (name in info.streaming) != streaming:
                raise TypeError(
                    f"{info.service}.{name} is {'not ' if streaming else ''}a streaming "
                    f"method: use {use}"
                )
            service = info.service
            break
    return schemaless_method(service, name, streaming=streaming)


def _broadcast_outcome(
    spec: MethodSpec, engines: Sequence[str], results: dict[str, Any]
) -> dict[str, Any]:
    ordered = {k: results[k] for k in engines}
    failed = [k for k, v in ordered.items() if isinstance(v, BaseException)]
    if failed:
        raise BroadcastError(
            f"broadcast of {spec.qualname} failed on {len(failed)} of {len(engines)} "
            f"engines: " + "; ".join(f"{k}: {ordered[k]!r}" for k in failed),
            results=ordered,
        )
    return ordered
