"""The client's I/O shell: one ROUTER socket multiplexing typed calls over many engines.

Every decision (handshake, sessions, the call table, reply legality, credit, liveness,
capacity) is made by `tensorrpc._client_protocol.ClientProtocol`; this module
does the I/O around it:

* One ROUTER socket carries both topologies: engines dial in (``bind=``; each engine's
  DEALER has the routing id ``engine_id/nonce``) and the client dials engines
  (``connect=``; each address gets a ``CONNECT_ROUTING_ID`` alias and hello requests).
* One reader task feeds every message to the protocol and wakes the caller whose call it
  resolved. The caller decodes its own reply, so the reader stays lean.
* One housekeeping task runs the protocol's timers (heartbeats, dead engines, hello
  requests), cancels calls of garbage-collected streams and releases the memory of
  tensors ZMQ has finished sending.
* Control frames the protocol queues go out in one flush, without waiting; a CALL is sent
  zero-copy with its tensor memory held until ZMQ is done with it.
* Callers waiting for an in-flight slot are woken one per freed slot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import time
import warnings
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import anyio
import anyio.lowlevel
import zmq

from tensorrpc import _codec, _observe
from tensorrpc._calls import Call, CallState
from tensorrpc._client_protocol import (
    HEARTBEAT_NONCE,
    ClientConfig,
    ClientProtocol,
    Dropped,
    EngineJoined,
    EngineLost,
    EngineRefused,
    Heartbeat,
    Ignored,
    Pong,
    reply_error,
)
from tensorrpc._engines import (
    MAX_REJECTED_KEY,
    Engine,
    EngineInfo,
    unavailable_message,
)
from tensorrpc._exceptions import (
    BroadcastError,
    CallTimeoutError,
    ClosedError,
    EngineDeadError,
    EnginesUnavailableError,
    MethodNotFoundError,
    OverloadedError,
    PeerUnreachableError,
    TensorRPCError,
    TensorTransportError,
)
from tensorrpc._hostinfo import host_id as _host_id
from tensorrpc._protocol import (
    Flags,
    Hello,
    MessageKind,
    Proof,
    encode_control,
    pack_call_header,
)
from tensorrpc._service import ServiceSpec, describe, schemaless_method
from tensorrpc._views import (
    _DEFAULT_OPTIONS,
    CallOptions,
    CallStream,
    CallView,
    ClientStatistics,
    EngineStatistics,
    Transport,
)
from tensorrpc._zmq import AsyncSocket, PendingSends, SocketOptions, create_socket
from tensorrpc.transports._policy import (
    DEFAULT_SHM_THRESHOLD,
    LeaseCollector,
    PolicyPlacer,
    TransportPolicy,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence
    from typing import Self

    from typing_extensions import Buffer

    from tensorrpc._engines import Balancing
    from tensorrpc._observe import Observer
    from tensorrpc._security import CurveConfig
    from tensorrpc._service import MethodSpec
    from tensorrpc.transports._base import TensorPlacer
    from tensorrpc.transports.torch_shm import ShmResolver

__all__ = [
    "CallOptions",
    "CallStream",
    "CallView",
    "Client",
    "ClientStatistics",
    "EngineInfo",
    "EngineStatistics",
    "Transport",
]

logger = logging.getLogger("tensorrpc.client")

S = TypeVar("S")

#: Transports this client can receive when torch_shm is not usable with an engine.
_SHM_RESULTS_FLAG = int(Flags.SHM_RESULTS)
_SHM_RESULTS_ALL_FLAG = int(Flags.SHM_RESULTS_ALL)
_RESULT = MessageKind.RESULT
_ERROR = MessageKind.ERROR
_REPLIED = CallState.REPLIED
_U32_MAX = 0xFFFF_FFFF
# wait_for_engines: how long to wait for another engine once every one that tried was refused.
_REFUSAL_GRACE_S = 0.5
# Back-off between retries of a call an engine refused as OVERLOADED (wait=True only).
_RETRY_MIN_S = 0.001
_RETRY_MAX_S = 0.05
_STREAM_FLAG = int(Flags.STREAM)
_NO_WAIT_FLAG = int(Flags.NO_WAIT)
_monotonic = time.monotonic


class _Waiters:
    """Backend-specific one-shot wake-ups: an asyncio Future or a trio Event per wait.

    A bare future costs far less than ``anyio.Event`` on the hot path; both are awaited
    inside anyio cancel scopes, which cancel them like any other await.
    """

    __slots__ = ("new", "wait", "wake", "woken")

    def __init__(self, backend: str) -> None:
        self.new: Callable[[], Any]
        self.wake: Callable[[Any], None]
        self.wait: Callable[[Any], Awaitable[Any]]
        self.woken: Callable[[Any], bool]
        if backend == "asyncio":
            loop = asyncio.get_running_loop()
            self.new = loop.create_future
            self.wake = _wake_future
            self.wait = _identity
            self.woken = _future_woken
        else:
            import trio

            self.new = trio.Event
            self.wake = _set_event
            self.wait = _event_wait
            self.woken = _event_woken


def _current_backend() -> str:
    # anyio runs either on an asyncio loop or on trio; trio runs no asyncio loop.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "trio"
    return "asyncio"


def _wake_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _future_woken(fut: asyncio.Future[None]) -> bool:
    return fut.done() and not fut.cancelled()


def _identity(fut: Awaitable[Any]) -> Awaitable[Any]:
    return fut


def _set_event(event: Any) -> None:
    event.set()


def _event_woken(event: Any) -> bool:
    return bool(event.is_set())


def _event_wait(event: Any) -> Awaitable[Any]:
    return cast("Awaitable[Any]", event.wait())


class _RefusalLog:
    """Logs handshake refusals at WARNING, bounded: strangers cannot flood the log.

    At most `BURST` refusals are logged one by one per `WINDOW_S` seconds, each with
    the engine id and text cut short; the rest are counted and summed up in one line.
    """

    BURST: Final = 16
    WINDOW_S: Final = 10.0
    TEXT: Final = 512
    __slots__ = ("logged", "skipped", "window_end")

    def __init__(self) -> None:
        self.window_end = 0.0
        self.logged = 0
        self.skipped = 0

    def log(self, event: EngineRefused, now: float) -> None:
        """Log one refusal (or count it when this window's burst is spent)."""
        if now >= self.window_end:
            if self.skipped:
                logger.warning(
                    "%d more handshake refusals in %g s were not logged one by one "
                    "(see Client.rejected)",
                    self.skipped,
                    self.WINDOW_S,
                )
            self.window_end = now + self.WINDOW_S
            self.logged = self.skipped = 0
        if self.logged >= self.BURST:
            self.skipped += 1
            return
        self.logged += 1
        engine_id = _cut(event.engine_id, MAX_REJECTED_KEY)
        message = _cut(event.message, self.TEXT)
        if event.by_client:
            logger.warning("refused engine %r: %s", engine_id, message)
        else:
            logger.warning("engine %s refused this client: %s %s", engine_id, event.reason, message)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Schemaless:
    """Stands for "no service class" when `Client.dynamic` builds a client."""


#: The (empty) spec of a schemaless client.
_SCHEMALESS_SPEC = ServiceSpec(name="(schemaless)", methods=MappingProxyType({}), fingerprint="")


class _Transfers:
    """Tensor transports and size limits with each engine (torch_shm, frames)."""

    __slots__ = ("codec_config", "host_id", "maxmsgsize", "policy", "sock")

    def __init__(
        self, policy: TransportPolicy, codec_config: _codec.CodecConfig, maxmsgsize: int
    ) -> None:
        self.policy = policy
        self.codec_config = codec_config
        self.maxmsgsize = maxmsgsize
        self.host_id = _host_id()
        self.sock: AsyncSocket | None = None

    # -- the protocol's hooks ------------------------------------------------------------

    def shm_offer(self, hello: Hello) -> tuple[tuple[str, ...], bytes, bytes, bytes] | None:
        """torch_shm only with an engine that proves its pid in PROOF (protocol §8.1)."""
        shm = self.policy.welcome_fields((hello.pid, hello.engine_id), hello, our_host=self.host_id)
        if not shm.challenge:
            return None
        return (shm.transports, shm.probe, shm.challenge, shm.proof)

    def shm_proof(self, engine: Engine, proof: Proof) -> tuple[int, bool, bool]:
        """Check the engine's PROOF (its pid, by possession of its probe's secret)."""
        key = (engine.info.pid, engine.engine_id)
        return self.policy.on_proof(key, proof, our_host=self.host_id)

    def reachable(self, peer: bytes) -> bool:
        """Whether a connection to ``peer`` exists: a PING to it can be queued."""
        sock = self.sock
        if sock is None:
            return False
        try:
            sock.send_nowait([peer, *encode_control(MessageKind.PING, None, HEARTBEAT_NONCE)])
        except PeerUnreachableError:
            return False
        except (anyio.WouldBlock, TensorRPCError):
            return True
        return True

    # -- per call ------------------------------------------------------------------------

    def placer(self, options: CallOptions, engine: Engine) -> PolicyPlacer | None:
        """Where large argument tensors go (None: frames only)."""
        shm = engine.shm
        return self.policy.placer(
            options.transport, engine.peer, peer_receives=shm is not None and shm.to_engine
        )

    def resolver(self, engine: Engine) -> ShmResolver | None:
        """Resolves tensors that come back by torch_shm handle (None: the engine sends none).

        Kept after torch_shm *from* the engine was switched off: replies that were already
        in flight may still carry handles, and must fail (or succeed) as transport
        errors, not as undecodable messages.
        """
        shm = engine.shm
        # Not proven (or lost): handles are refused with a TensorTransportError.
        return self.policy.resolver(shm.pid if shm is not None else 0)

    def result_flags(self, options: CallOptions, engine: Engine) -> int:
        """The CALL flag bits that tell the engine how to send result tensors."""
        mode = options.transport
        shm = engine.shm
        if mode == "frames" or shm is None or not shm.from_engine:
            return 0
        return _SHM_RESULTS_ALL_FLAG if mode == "torch_shm" else _SHM_RESULTS_FLAG

    def leases(self, engine: Engine, payload: Buffer, buffers: Sequence[Buffer]) -> list[int]:
        """The torch_shm leases a reply nobody will decode carries (to release)."""
        if engine.shm is None:
            return []  # the engine sends us no handles
        collector = LeaseCollector()
        with contextlib.suppress(TensorRPCError):
            _codec.decode(payload, buffers, self.codec_config, resolver=collector)
        return list(dict.fromkeys(collector.leases))

    def shm_failed(self, engine: Engine, *, sending: bool) -> None:
        """The engine could not attach to our handles (or we to its): stop using torch_shm."""
        shm = engine.shm
        if shm is not None:
            if sending:
                shm.to_engine = False
            else:
                shm.from_engine = False
            logger.warning(
                "torch_shm %s engine %r failed; using frames from now on",
                "to" if sending else "from",
                engine.engine_id,
            )

    def encode(
        self,
        spec: MethodSpec,
        wire: object,
        engine: Engine | None,
        placer: TensorPlacer | None = None,
    ) -> _codec.Encoded:
        """Encode arguments and refuse a frame over our ``maxmsgsize`` or the engine's."""
        encoded = _codec.encode(wire, self.codec_config, placer=placer)
        self.check_sizes(spec, encoded, engine)
        return encoded

    def check_sizes(self, spec: MethodSpec, encoded: _codec.Encoded, engine: Engine | None) -> None:
        """A frame over the receiver's MAXMSGSIZE makes its ZMQ drop the whole connection
        without a word, so it is refused here, before sending."""
        _codec.check_message_size(
            encoded,
            self.maxmsgsize,
            0 if engine is None else engine.info.max_message_bytes,
            what=f"{spec.qualname}: the arguments",
            peer="engine" if engine is None else f"engine {engine.engine_id!r}",
        )


class Client(CallView[S]):
    """A client of one service over any number of engines, through one ROUTER socket.

    Use it as an async context manager::

        async with Client(Calculator, bind="ipc:///tmp/calc.sock") as client:
            await client.wait_for_engines(2, timeout=30)
            print(await client.stub().add(1, 2))

    Engines join and leave at any time. A balanced call fails at once with
    `tensorrpc.EngineNotFoundError` when no engine is live (use
    `wait_for_engines` first). When an engine dies (silent for ``dead_after``, or its
    connection closes) or says BYE, every call in flight to it, streams included, fails
    with `tensorrpc.EngineDeadError`; replies it sent before its BYE are delivered
    first. A restarted engine re-joins under the same id.

    Args:
        service: The ``@service`` class (its schema fingerprint must match the engines').
        bind: Address(es) to bind; engines dial in (``connect=`` on their side). Use
            ``tcp://127.0.0.1:0`` for an ephemeral port and read `addresses`.
        connect: Address(es) of engines that listen (``bind=`` on their side).
        balancing: ``"least_outstanding"`` (default) or ``"round_robin"``.
        max_in_flight: Bound on calls (streams included) in flight per engine; callers
            beyond it wait or get OverloadedError.
        heartbeat_interval: Seconds between PINGs to each engine.
        dead_after: An engine silent for this many seconds is declared dead.
        stream_window: Stream items an engine may send ahead of the consumer.
        codec: Codec limits (must agree with the engines'; the same keyword as
            [`Server`][tensorrpc.Server]).
        codec_config: Deprecated spelling of ``codec`` (kept for one release).
        client_id: Identifies the client to engines (default: random).
        high_water_mark: ZMQ send/receive high-water mark, in messages.
        torch_shm: Offer and use the ``torch_shm`` tensor transport with engines on this
            host (Linux; checked at handshake). ``False``: frames only.
        shm_threshold: With ``transport="auto"``, CPU tensors of at least this many
            bytes go by ``torch_shm`` (CUDA tensors always do when it is usable).
        curve: CURVE encryption and authentication for the client's ROUTER (see
            docs/security.md): usually a ``CurveClientConfig`` holding the engines'
            public key when the client dials listening engines, or a
            ``CurveServerConfig`` with an allow-list of engine keys when engines dial in.
            None: plaintext.
        socket_options: ZMQ socket options (``maxmsgsize`` is the largest frame this
            client sends or accepts: a bigger argument tensor is an ``EncodeError``
            before anything is sent). Default: the safe defaults with
            ``high_water_mark`` as both HWMs; when given, ``high_water_mark`` is ignored.
        observer: An [`Observer`][tensorrpc.Observer] (or several) told about every call,
            engine and heartbeat (see docs/observability.md): e.g.
            ``tensorrpc.metrics.PrometheusObserver`` or ``tensorrpc.tracing.TracingObserver``.
        metrics_port: Export Prometheus metrics of this client (the default registry) over
            HTTP on this port (needs the ``metrics`` extra; 0 picks a free port).

    Raises:
        ConnectError: From ``async with``: an address is malformed or already in use.
        ValueError: Inconsistent arguments.
    """

    __slots__ = (
        "_addresses",
        "_bind",
        "_connect",
        "_curve",
        "_engines_changed",
        "_observer",
        "_opened",
        "_orphans",
        "_protocol",
        "_refusals",
        "_retries",
        "_scopes",
        "_sock",
        "_socket_options",
        "_spec",
        "_tg",
        "_tick",
        "_tracked",
        "_transfers",
        "_waiters",
    )

    def __init__(
        self,
        service: type[S],
        *,
        bind: str | Sequence[str] | None = None,
        connect: str | Sequence[str] | None = None,
        balancing: Balancing = "least_outstanding",
        max_in_flight: int = 1024,
        heartbeat_interval: float = 1.0,
        dead_after: float = 5.0,
        stream_window: int = 16,
        codec: _codec.CodecConfig | None = None,
        codec_config: _codec.CodecConfig | None = None,
        client_id: str | None = None,
        high_water_mark: int = 100_000,
        curve: CurveConfig | None = None,
        socket_options: SocketOptions | None = None,
        torch_shm: bool = True,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        observer: Observer | Sequence[Observer] | None = None,
        metrics_port: int | None = None,
    ) -> None:
        super().__init__(self, _DEFAULT_OPTIONS)
        self._spec: ServiceSpec = _SCHEMALESS_SPEC if service is _Schemaless else describe(service)
        self._bind = [bind] if isinstance(bind, str) else list(bind or ())
        self._connect = [connect] if isinstance(connect, str) else list(connect or ())
        if not self._bind and not self._connect:
            raise ValueError("give bind= (engines dial in) and/or connect= (engine addresses)")
        self._socket_options = socket_options or SocketOptions(
            sndhwm=high_water_mark, rcvhwm=high_water_mark
        )
        policy = TransportPolicy(torch_shm=torch_shm, shm_threshold=shm_threshold)
        maxmsgsize = self._socket_options.maxmsgsize
        if codec_config is not None:
            warnings.warn(
                "Client(codec_config=...) is deprecated: use codec=..., as Server and serve() do",
                DeprecationWarning,
                stacklevel=2,
            )
            if codec is not None and codec is not codec_config:
                raise ValueError("give codec= only (codec_config= is its deprecated alias)")
            codec = codec_config
        self._transfers = _Transfers(policy, codec or _codec.DEFAULT, maxmsgsize)
        config = ClientConfig(
            service=self._spec.name,
            fingerprint=self._spec.fingerprint,
            client_id=client_id or f"client-{secrets.token_hex(6)}",
            host_id=self._transfers.host_id,
            pid=os.getpid(),
            heartbeat=Heartbeat(heartbeat_interval, dead_after),
            stream_window=stream_window,
            max_message_bytes=max(0, maxmsgsize),
            balancing=balancing,
            max_in_flight=max_in_flight,
            schemaless=self._spec is _SCHEMALESS_SPEC,
            signatures={n: m.signature for n, m in self._spec.methods.items()},
        )
        self._protocol = ClientProtocol(config, self._transfers)
        self._curve = curve
        self._orphans: collections.deque[Call] = collections.deque()
        self._tracked = PendingSends()
        self._addresses: list[str] = []
        self._retries = 0
        self._refusals = _RefusalLog()
        self._scopes: list[anyio.CancelScope] = []
        self._opened = False
        self._sock: AsyncSocket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._engines_changed: anyio.Event | None = None
        self._tick: anyio.Event | None = None
        self._waiters: _Waiters | None = None
        self._observer = _observe.resolve(observer, metrics_port)

    @classmethod
    def dynamic(
        cls,
        *,
        bind: str | Sequence[str] | None = None,
        connect: str | Sequence[str] | None = None,
        **options: Any,
    ) -> Client[Any]:
        """A schemaless client: calls any engine's methods by name, without its class.

        It admits every engine that speaks this protocol version, whatever its service
        and fingerprint, and learns the method names (and, from engines that announce
        them, the signatures and which methods stream) from each HELLO; see
        `engines`. Call with `call_by_name` and `stream_by_name`:
        arguments travel as a map of name -> value that the engine validates with its
        own types, and results come back as decoded (lists, dicts, tensors), without
        conversion. `call`, `stream`, `stub` and `broadcast`
        need a service class and raise ``TypeError``. Meant for tools (``tensorrpc
        call``), tests and debugging; typed clients are checked on both ends.

        Args:
            bind: Address(es) to bind; engines dial in.
            connect: Address(es) of engines that listen.
            **options: Any other keyword argument of `Client`.

        Returns:
            The client (open it with ``async with``).

        Raises:
            ValueError: Inconsistent arguments.
        """
        return cls(cast("type[Any]", _Schemaless), bind=bind, connect=connect, **options)

    @property
    def schemaless(self) -> bool:
        """True for a client made by `dynamic`."""
        return self._spec is _SCHEMALESS_SPEC

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._opened:
            raise RuntimeError("a Client can be opened only once")
        self._opened = True
        self._waiters = _Waiters(_current_backend())
        self._engines_changed = anyio.Event()
        self._tick = anyio.Event()
        self._open_socket()
        if self._observer is not None:  # observe: the client opened
            self._observer.opened(self)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._background, self._reader, name="tensorrpc client reader")
        tg.start_soon(self._background, self._housekeeping, name="tensorrpc client housekeeping")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        suppress: bool | None = None
        try:
            await self.aclose()
        finally:
            tg, self._tg = self._tg, None
            if tg is not None:
                suppress = await tg.__aexit__(exc_type, exc, tb)
        return suppress

    async def _background(self, fn: Callable[[], Awaitable[None]]) -> None:
        # Each background task runs in its own scope so that aclose() can stop them from
        # any task without cancelling the body of the user's `async with`.
        if self._protocol.closed:
            return  # closed before this task first ran
        with anyio.CancelScope() as scope:
            self._scopes.append(scope)
            try:
                await fn()
            except ClosedError:
                if not self._protocol.closed:
                    raise

    async def aclose(self) -> None:
        """Close the client: say BYE to every engine, fail calls still in flight, reap tasks.

        Calls still in flight raise [`ClosedError`][tensorrpc.ClosedError]. Idempotent.
        """
        protocol = self._protocol
        if protocol.closed:
            return
        for call in protocol.close(_monotonic()):
            self._ended(call)
        self._flush()
        if self._waiters is not None:
            for token in protocol.capacity.everyone():
                self._waiters.wake(token)
        self._notify_engines()
        for scope in self._scopes:
            scope.cancel()
        self._close_socket()
        self._transfers.policy.close()
        if self._observer is not None:  # observe: the client closed
            self._observer.closed(self)
        await anyio.lowlevel.checkpoint()

    # -- public state ---------------------------------------------------------------------

    @property
    def service(self) -> ServiceSpec:
        """The service spec this client calls."""
        return self._spec

    @property
    def client_id(self) -> str:
        """This client's id, as sent to engines in WELCOME."""
        return self._protocol.config.client_id

    @property
    def addresses(self) -> tuple[str, ...]:
        """The addresses actually bound (ephemeral ports resolved)."""
        return tuple(self._addresses)

    @property
    def engines(self) -> Mapping[str, EngineInfo]:
        """The live engines: engine id → what the engine said in HELLO (a snapshot)."""
        return MappingProxyType({k: e.info for k, e in self._protocol.engines.engines.items()})

    @property
    def rejected(self) -> Mapping[str, str]:
        """Engine id → why it was refused at handshake (the latest 64 refusals)."""
        return MappingProxyType(dict(self._protocol.engines.rejected))

    def statistics(self) -> ClientStatistics:
        """Counters per engine and for the whole client (a frozen snapshot)."""
        table = self._protocol.engines
        engines: dict[str, EngineStatistics] = {}
        for engine_id, past in table.past.items():
            engines[engine_id] = EngineStatistics(
                engine_id,
                False,
                past.calls,
                past.errors,
                0,
                past.bytes_sent,
                past.bytes_received,
            )
        for engine_id, e in table.engines.items():
            before = engines.get(engine_id) or EngineStatistics(engine_id, False, 0, 0, 0, 0, 0)
            engines[engine_id] = EngineStatistics(
                engine_id,
                True,
                e.calls_total + before.calls,
                e.errors + before.errors,
                e.in_flight,
                e.bytes_sent + before.bytes_sent,
                e.bytes_received + before.bytes_received,
            )
        return ClientStatistics(
            engines=MappingProxyType(dict(sorted(engines.items()))),
            calls_in_flight=len(self._protocol.calls),
            waiting_for_capacity=len(self._protocol.capacity),
            rejected=MappingProxyType(dict(table.rejected)),
            overload_retries=self._retries,
            transports=self._transfers.policy.statistics(),
            rejected_total=table.rejected_total,
        )

    async def wait_for_engines(
        self,
        count: int = 1,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> Mapping[str, EngineInfo]:
        """Wait until at least ``count`` engines are live.

        Args:
            count: How many live engines to wait for.
            timeout: Seconds to wait at most. With a timeout, a wait in which every
                engine that tried to join was refused (wrong schema, service or
                version, duplicate id, or the engine refused this client) and none is
                live fails after a short grace (0.5 s) instead of waiting out the
                timeout. ``None`` waits forever, however many engines are refused;
                each refusal is logged at WARNING on the ``tensorrpc.client`` logger.

        Returns:
            The live engines (as `engines`).

        Raises:
            EnginesUnavailableError: The timeout passed first, or every engine that tried
                to join was refused; it names the refused engines and why (the latest
                64; for a schema mismatch, the methods that differ) and the handshakes
                that failed on the client's socket, with libzmq's reason (a CURVE key
                not on the allow-list, a wrong server key, CURVE against plaintext)
                (also a ``TimeoutError``).
            ClosedError: The client is closed.
        """
        self._check_open()
        table = self._protocol.engines
        with anyio.move_on_after(timeout):
            while len(table.engines) < count:
                changed = self._engines_changed
                assert changed is not None
                if timeout is not None and table.rejected and not table.engines:
                    # Every engine that tried to join was refused and none is live: give
                    # one still on its way a short grace, then say why.
                    with anyio.move_on_after(_REFUSAL_GRACE_S):
                        await changed.wait()
                    if not changed.is_set():
                        break
                else:
                    await changed.wait()
                self._check_open()
            else:
                return self.engines
        rejected = dict(table.rejected)
        failures = self._sock.handshake_failures() if self._sock is not None else ()
        earlier = table.rejected_total - len(rejected)
        text = unavailable_message(len(table.engines), count, timeout, rejected, failures, earlier)
        raise EnginesUnavailableError(text, rejected=rejected)

    # -- membership hooks (used by launchers such as tensorrpc.ray) ------------------------

    @property
    def curve(self) -> CurveConfig | None:
        """The CURVE configuration of the client's socket (``None``: plaintext)."""
        return self._curve

    def connect(self, address: str) -> None:
        """Dial one more listening engine, as if its address had been given to ``connect=``.

        The client pings the address until the engine answers with its HELLO, and keeps
        pinging it while its engine is down, like the constructor's addresses.

        Args:
            address: The engine's address (``tcp://HOST:PORT``, ``ipc://PATH``).

        Raises:
            ClosedError: The client is not open or is closed.
            ConnectError: The address is malformed.
        """
        self._check_open()
        assert self._sock is not None
        alias = f"@{secrets.token_hex(4)}/{self._protocol.dial_count}".encode()
        self._sock.connect(address, peer_id=alias)
        self._protocol.dial(alias, address, _monotonic())
        self._flush()

    def disconnect(self, address: str) -> None:
        """Stop dialling an address given to `connect` or to ``connect=``.

        The engine behind it stays live until it says BYE or goes silent for
        ``dead_after``. Unknown addresses are ignored.

        Raises:
            ClosedError: The client is not open or is closed.
        """
        self._check_open()
        assert self._sock is not None
        if self._protocol.undial(address):
            with contextlib.suppress(TensorRPCError):
                self._sock.disconnect(address)

    def declare_dead(self, engine_id: str, *, pid: int, reason: str) -> bool:
        """Take a live engine out now, when something outside the protocol saw it die.

        For supervisors (a process manager, Ray) that learn of an engine's death before
        its heartbeats stop: its calls in flight fail at once with
        [`EngineDeadError`][tensorrpc.EngineDeadError] instead of after ``dead_after``.
        Nothing happens unless the live engine of that id runs as process ``pid``, so a
        restarted incarnation that already rejoined under the same id is left alone.

        Args:
            engine_id: The engine's id.
            pid: The process id of the incarnation that died.
            reason: Why, for the errors and the log (``"died (Ray: actor killed)"``).

        Returns:
            True when an engine was taken out.
        """
        lost = self._protocol.declare_dead(engine_id, pid=pid, reason=reason)
        self._event(lost)
        return lost is not None

    # -- socket and events -----------------------------------------------------------------

    def _open_socket(self) -> None:
        sock = create_socket(zmq.ROUTER, options=self._socket_options, curve=self._curve)
        self._sock = self._transfers.sock = sock
        aliases: list[tuple[bytes, str]] = []
        try:
            for address in self._bind:
                self._addresses.append(sock.bind(address))
            token = secrets.token_hex(4)
            for i, address in enumerate(self._connect):
                alias = f"@{token}/{i}".encode()
                sock.connect(address, peer_id=alias)
                aliases.append((alias, address))
        except BaseException:
            self._close_socket()
            raise
        now = _monotonic()
        for alias, address in aliases:
            self._protocol.dial(alias, address, now)
        self._flush()

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        self._transfers.sock = None
        if sock is not None:
            sock.close()
        self._tracked.clear()

    def _flush(self) -> None:
        """Send the control frames the protocol queued, without waiting."""
        protocol = self._protocol
        while protocol.has_output:
            for frames in protocol.frames_to_send():
                sock = self._sock
                if sock is None:
                    return
                try:
                    sock.send_nowait(frames)
                except PeerUnreachableError:
                    self._event(protocol.unreachable(frames[0], _monotonic()))
                    if self._tick is not None:
                        self._tick.set()  # a hello request to retry soon
                except anyio.WouldBlock:
                    logger.debug("dropped a message to %r: peer pipe full", frames[0])
                except TensorRPCError as exc:
                    logger.debug("could not send to %r: %s", frames[0], exc)

    def _event(self, event: object) -> None:
        """Act on what the protocol reported (other than a resolved call)."""
        if isinstance(event, EngineLost):
            self._on_lost(event)
        elif isinstance(event, Pong):
            if self._observer is not None:  # observe: heartbeat round trip
                rtt = (time.monotonic_ns() - event.nonce) / 1e9
                self._observer.heartbeat(self.client_id, event.engine.engine_id, rtt)
        elif isinstance(event, EngineJoined):
            self._on_joined(event)
        elif isinstance(event, Dropped):
            leases = self._transfers.leases(event.engine, event.payload, event.buffers)
            self._protocol.release(event.engine, leases, _monotonic())
            if event.call is not None:
                self._ended(event.call)
        elif isinstance(event, EngineRefused):
            self._refusals.log(event, _monotonic())
            self._notify_engines()
        elif isinstance(event, Ignored):
            logger.warning("dropped a message from %r: %s", event.peer, event.why)

    def _on_lost(self, event: EngineLost) -> None:
        engine = event.engine
        logger.info("engine %r %s", engine.engine_id, event.why)
        self._transfers.policy.peer_gone(engine.peer, engine.shm.pid if engine.shm else 0)
        for call in event.calls:
            self._ended(call)
        self._observe_engine(engine.engine_id, "lost")
        self._wake_all(self._protocol.stranded(engine.engine_id, _monotonic()))
        self._notify_engines()
        if self._tick is not None:
            self._tick.set()  # a hello request to its address may be due at once

    def _on_joined(self, event: EngineJoined) -> None:
        engine_id = event.engine.engine_id
        table = self._protocol.engines
        self._observe_engine(engine_id, "rejoined" if engine_id in table.past else "joined")
        self._wake_all(self._protocol.capacity.joined(engine_id, table.max_in_flight))
        self._notify_engines()
        if self._tick is not None:
            self._tick.set()  # its heartbeat may be due sooner than our next tick

    def _observe_engine(self, engine_id: str, event: str) -> None:
        if self._observer is not None:  # observe: an engine joined, rejoined or was lost
            self._observer.engine_event(self.client_id, engine_id, event)

    def _notify_engines(self) -> None:
        if self._engines_changed is not None:
            self._engines_changed.set()
            self._engines_changed = anyio.Event()

    def _wake_all(self, tokens: Sequence[Any]) -> None:
        waiters = self._waiters
        if waiters is not None:
            for token in tokens:
                waiters.wake(token)

    def _ended(self, call: Call) -> None:
        """A call ended: free its argument lease and slot, wake its caller (and one waiter)."""
        if call.lease is not None:
            # The engine replied (so it attached to the arguments), or never will.
            self._transfers.policy.release_one(call.lease)
            call.lease = None
        waiters = self._waiters
        if waiters is None:
            return
        for token in self._protocol.capacity.released(call.engine.engine_id):
            waiters.wake(token)
        waiters.wake(call.waiter)

    # -- calls -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._protocol.closed:
            raise ClosedError("the client is closed")
        if self._sock is None:
            raise ClosedError("the client is not open: use `async with Client(...)`")

    def _method(self, method: Callable[..., Any], *, streaming: bool) -> MethodSpec:
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

    def _by_name(
        self,
        name: str,
        arguments: Mapping[str, Any],
        options: CallOptions,
        *,
        streaming: bool,
    ) -> tuple[MethodSpec, _codec.Encoded | None]:
        """The spec for a by-name call, and (schemaless) its pre-encoded argument map."""
        self._check_open()
        if not self.schemaless:
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
        return spec, self._transfers.encode(spec, dict(arguments), None)

    async def _acquire(self, options: CallOptions) -> Engine:
        """Pick an engine with a free in-flight slot, waiting for one if allowed.

        A waiter is woken once per slot freed for it; one woken that finds the slot
        taken (by a caller that never queued) queues again.
        """
        protocol = self._protocol
        waiters = self._waiters
        assert waiters is not None
        target = options.engine
        engine = self._select(target, woken=False)
        while engine is None:
            self._check_open()
            if not options.wait:
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
                    self._wake_all(protocol.capacity.released(target))
                raise
            self._check_open()
            engine = self._select(target, woken=True)
        return engine

    def _select(self, target: str | None, *, woken: bool) -> Engine | None:
        """`ClientProtocol.select` now, acting on the sessions it found forgotten."""
        protocol = self._protocol
        engine = protocol.select(target, _monotonic(), woken=woken)
        pending = protocol.pending
        while pending:
            self._event(pending.popleft())
        if protocol.outbox:
            self._flush()
        return engine

    async def _start(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        encoded: _codec.Encoded | None,
        options: CallOptions,
        deadline: float | None,
        flags: int,
    ) -> Call:
        """Pick an engine, enter the call in the table and send the CALL."""
        if self._orphans:
            self._reap_orphans()
        self._check_open()
        engine = self._select(options.engine, woken=False)
        if engine is None:
            engine = await self._acquire(options)
        transfers = self._transfers
        placer = None
        if encoded is not None:
            # Encoded before an engine was chosen (by name, broadcast): check its limit.
            transfers.check_sizes(spec, encoded, engine)
        else:
            placer = transfers.placer(options, engine)
            try:
                encoded = transfers.encode(spec, wire, engine, placer)
            except BaseException:
                if placer is not None:
                    placer.abort()
                raise
        assert self._waiters is not None
        now = _monotonic()
        call = self._protocol.start_call(
            engine, spec, self._waiters.new(), stream=bool(flags & _STREAM_FLAG), now=now
        )
        if placer is not None:
            call.lease = placer.lease
            call.placed = (placer.placed, placer.placed_bytes)
        flags |= transfers.result_flags(options, engine)
        transfers.policy.sent_frames(encoded.buffers)
        timeout_ms = 0
        if deadline is not None:
            timeout_ms = min(_U32_MAX, max(1, int((deadline - anyio.current_time()) * 1000)))
        header = pack_call_header(call.call_id, spec.name, flags, timeout_ms)
        if self._observer is not None:  # observe: a CALL goes out (may add trace context)
            nbytes = len(encoded.payload) + sum(b.nbytes for b in encoded.buffers)
            call.observed, header = _observe.client_call(
                self._observer, header, spec.name, engine.engine_id, engine.info.features,
                bool(flags & _STREAM_FLAG), nbytes, call.placed[0], len(encoded.buffers),
            )  # fmt: skip
        frames = [engine.peer, header, encoded.payload, *encoded.buffers]
        await self._send_call(call, frames, encoded)
        return call

    async def _send_call(self, call: Call, frames: list[Any], encoded: _codec.Encoded) -> None:
        """Send a CALL zero-copy; waits (bounded by the caller's scope) only on a full pipe."""
        engine = call.engine
        nbytes = len(frames[1]) + len(frames[2])
        for buffer in encoded.buffers:
            nbytes += buffer.nbytes
        engine.bytes_sent += nbytes
        sock = self._sock
        track = bool(encoded.buffers)
        try:
            if sock is None:
                raise ClosedError("the client is closed")
            try:
                tracker = sock.send_nowait(frames, track=track)
            except anyio.WouldBlock:
                tracker = await sock.send(frames, track=track)
        except PeerUnreachableError as exc:
            self._event(self._protocol.unreachable(engine.peer, _monotonic()))
            raise (
                call.error
                or EngineDeadError(
                    f"engine {engine.engine_id!r} is unreachable", engine_id=engine.engine_id
                )
            ) from exc
        except BaseException as exc:
            if not call.ended:
                self._abandon(call)
                engine.errors += 1
            if call.observed is not None:  # observe: the CALL could not be sent
                call.observed.finished(_observe.outcome_of(exc), 0)
            raise
        if track:
            self._tracked.add(tracker, encoded.keepalive)

    def _abandon(self, call: Call) -> None:
        """The caller gave up (cancelled, timed out, closed a stream): tell the engine."""
        items = call.items
        now = _monotonic()
        while items:  # stream items nobody will read
            payload, buffers = items.popleft()
            leases = self._transfers.leases(call.engine, payload, buffers)
            self._protocol.release(call.engine, leases, now)
        if self._protocol.cancel(call, now):
            self._ended(call)
        self._flush()

    async def _result(self, call: Call) -> Any:
        """Wait for a unary call's reply and decode it (in the caller's task)."""
        waiters = self._waiters
        assert waiters is not None
        try:
            await waiters.wait(call.waiter)
        except BaseException:
            if not call.ended:
                self._abandon(call)
                call.engine.errors += 1
            elif call.reply_kind is _RESULT:  # it came, but nobody will decode it
                self._event(Dropped(call.engine, call.reply_payload, call.reply_buffers))
                self._flush()
            raise
        if call.error is not None:
            raise call.error
        if call.reply_kind is not _RESULT:
            raise reply_error(call.reply_payload)
        return self._decode(call, call.reply_payload, call.reply_buffers)

    def _decode(self, call: Call, payload: Buffer, buffers: Sequence[Buffer]) -> Any:
        """Decode a RESULT or stream item and release the torch_shm leases it carried."""
        transfers = self._transfers
        engine = call.engine
        resolver = transfers.resolver(engine)
        transfers.policy.received_frames(buffers)
        try:
            value = _codec.decode(payload, buffers, transfers.codec_config, resolver=resolver)
            return call.spec.decode_result(value)
        except TensorRPCError as exc:
            if call.items is None:
                engine.errors += 1
            if isinstance(exc, TensorTransportError):
                transfers.shm_failed(engine, sending=False)
            raise
        finally:
            if resolver is not None and resolver.leases:
                self._protocol.release(engine, resolver.leases, _monotonic())
                self._flush()

    async def _call(
        self,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: CallOptions,
        encoded: _codec.Encoded | None = None,
    ) -> Any:
        self._check_open()
        wire = None if encoded is not None else spec.encode_args(args, kwargs)
        flags = 0 if options.wait else _NO_WAIT_FLAG
        timeout = options.timeout
        if timeout is None:
            return await self._attempts(spec, wire, encoded, options, None, flags)
        deadline = anyio.current_time() + timeout
        with anyio.move_on_after(timeout):
            return await self._attempts(spec, wire, encoded, options, deadline, flags)
        raise CallTimeoutError(
            f"{spec.qualname} did not complete within {timeout} s"
            + (f" on engine {options.engine!r}" if options.engine else "")
        )

    async def _attempts(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        encoded: _codec.Encoded | None,
        options: CallOptions,
        deadline: float | None,
        flags: int,
    ) -> Any:
        """Run a unary call; an engine's OVERLOADED refusal is retried when ``wait``."""
        backoff = _RETRY_MIN_S
        while True:
            call = await self._start(spec, wire, encoded, options, deadline, flags)
            try:
                if call.observed is not None:  # observe: the unary call ends
                    return await _observe.observe_result(call.observed, self._result(call), call)
                return await self._result(call)
            except TensorTransportError:
                if call.reply_kind is not _ERROR or not call.placed[0] or wire is None:
                    raise
                # The engine could not attach to the arguments' shared memory (it answers
                # so before running the handler): resend them as frames.
                call.engine.errors -= 1
                self._transfers.shm_failed(call.engine, sending=True)
                if options.transport == "auto":
                    self._transfers.policy.record_fallback(*call.placed)
                continue
            except OverloadedError:
                if not options.wait or call.reply_kind is not _ERROR:
                    raise
                # The engine's own queue is full (other clients may fill it too): wait,
                # bounded by the caller's deadline, then try again (maybe elsewhere).
                call.engine.errors -= 1
                self._retries += 1
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, _RETRY_MAX_S)

    async def _start_stream(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        options: CallOptions,
        deadline: float | None,
        encoded: _codec.Encoded | None = None,
    ) -> Call:
        self._check_open()
        flags = _STREAM_FLAG if options.wait else _STREAM_FLAG | _NO_WAIT_FLAG
        if deadline is None:
            return await self._start(spec, wire, encoded, options, None, flags)
        with anyio.move_on_after(deadline - anyio.current_time()):
            return await self._start(spec, wire, encoded, options, deadline, flags)
        raise CallTimeoutError(f"{spec.qualname} stream did not start within {options.timeout} s")

    async def _next_item(self, call: Call, deadline: float | None) -> Any:
        items = call.items
        waiters = self._waiters
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
                with anyio.move_on_after(deadline - anyio.current_time()):
                    await waiters.wait(call.waiter)
                    continue
                self._abandon(call)
                call.engine.errors += 1
                raise CallTimeoutError(f"{call.spec.qualname} stream passed its deadline")
        payload, buffers = self._protocol.take_item(call, _monotonic())
        if call.observed is not None:  # observe: a stream item is taken
            call.observed.item()
        self._flush()
        return self._decode(call, payload, buffers)

    def _reap_orphans(self) -> None:
        orphans = self._orphans
        while orphans:
            self._abandon(orphans.popleft())

    async def _broadcast(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: CallOptions,
    ) -> dict[str, Any]:
        self._check_open()
        spec = self._spec.methods.get(name)
        if spec is None or spec.streaming:
            raise TypeError(f"{self._spec.name!r} has no unary rpc method {name!r}")
        wire = spec.encode_args(args, kwargs)
        engines = self._protocol.engines.live_ids()
        if not engines:
            self._protocol.engines.select(None)  # raises EngineNotFoundError
        encoded = self._transfers.encode(spec, wire, None)
        results: dict[str, Any] = {}

        async def one(engine_id: str) -> None:
            opts = CallOptions(
                engine=engine_id,
                timeout=options.timeout,
                wait=options.wait,
                transport=options.transport,
            )
            try:
                results[engine_id] = await self._call(spec, (), {}, opts, encoded)
            except TensorRPCError as exc:
                results[engine_id] = exc

        async with anyio.create_task_group() as tg:
            for engine_id in engines:
                tg.start_soon(one, engine_id)
        return _broadcast_outcome(spec, engines, results)

    # -- background tasks ----------------------------------------------------------------------

    async def _reader(self) -> None:
        sock = self._sock
        assert sock is not None
        recv = sock.recv
        recv_nowait = sock.recv_nowait
        checkpoint = anyio.lowlevel.checkpoint
        on_message = self._on_message
        yield_due = sock.yield_due  # a busy (or flooded) socket must not starve the callers
        while True:
            try:
                frames = recv_nowait()
                if yield_due():  # after 32 messages or 2 ms of handling them
                    await checkpoint()
            except anyio.WouldBlock:
                # Nothing queued: let the callers we just woke run (and decode) before we
                # re-arm the wait on the socket, which costs a little.
                await checkpoint()
                frames = await recv()
            try:
                on_message(frames)
            except Exception:  # one bad message must never stop the reader
                logger.exception("tensorrpc client: error handling a message")

    def _drain(self, limit: int = 4096) -> None:
        """Handle the messages already received (the reader may not have run yet)."""
        sock = self._sock
        for _ in range(limit):
            if sock is None:
                return
            try:
                frames = sock.recv_nowait()
            except anyio.WouldBlock:
                return
            try:
                self._on_message(frames)
            except Exception:  # one bad message must never stop the client
                logger.exception("tensorrpc client: error handling a message")

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            logger.warning("dropped a message of %d frames", len(frames))
            return
        protocol = self._protocol
        event = protocol.receive(frames[0].bytes, cast("list[Buffer]", frames[1:]), _monotonic())
        if type(event) is Call:
            call = event
            if call.state >= _REPLIED:
                self._ended(call)
            else:  # a stream item: the engine has attached to the arguments
                if call.lease is not None:
                    self._transfers.policy.release_one(call.lease)
                    call.lease = None
                assert self._waiters is not None
                self._waiters.wake(call.waiter)
        elif event is not None:
            self._event(event)
        pending = protocol.pending
        while pending:
            self._event(pending.popleft())
        if protocol.outbox:
            self._flush()
        if self._orphans:
            self._reap_orphans()

    async def _housekeeping(self) -> None:
        protocol = self._protocol
        interval = protocol.config.heartbeat.interval
        next_sweep = _monotonic() + interval
        while True:
            with anyio.move_on_after(protocol.next_tick(_monotonic())):
                assert self._tick is not None
                await self._tick.wait()
            self._tick = anyio.Event()
            if self._sock is not None:
                self._sock.handshake_failures()  # logs failed CURVE handshakes at WARNING
            self._drain()  # messages already here prove life: read them before judging
            now = _monotonic()
            for lost in protocol.tick(now):
                self._event(lost)
            self._wake_all(protocol.expire_rejoins(now))
            self._flush()
            self._reap_orphans()
            if now >= next_sweep:
                next_sweep = now + interval
                self._tracked.prune()
                self._transfers.policy.sweep()


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
