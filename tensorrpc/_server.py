"""The engine side: ``serve()`` / ``Server`` run a service instance behind ZMQ.

`Server` is the engine's one I/O shell: the configuration, the lifecycle (start, drain,
close), the sockets and the worker pool's state (the workers' code is `tensorrpc._dispatch`).
Every decision is `ServerProtocol`'s: a receive loop per socket feeds it each message and
``now``, then sends the frames it queued and acts on its events (calls to run or wake,
session news); a housekeeping task runs its timers. **Dial-in** (``connect=``): one DEALER
per client address, routing id ``engine_id + "/" + nonce``, with ``ZMQ_IMMEDIATE`` (a HELLO
is only queued on a live connection). **Listen** (``bind=``): one ROUTER on every address.

Rules:

1. Every socket operation happens on the event-loop thread; a receive loop never waits
   on a send (``send_nowait``; dropped when ZMQ is full); a worker's reply may wait up
   to ``dead_after``.
2. The memory of every zero-copy send is held until ZMQ's tracker says it is done.
3. Shutdown drains: new CALLs get DRAINING, running calls get ``grace_period`` to finish,
   then are cancelled (and get an ERROR), BYE goes to every client, sockets close.
4. One clock: the event loop's (`tensorrpc._zmq.loop_clock`), for the protocol's ``now``,
   deadlines and the workers' cancel scopes alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket as _socket
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypedDict, cast

import anyio
import zmq

from tensorrpc import _codec, _compression, _dispatch, _observe
from tensorrpc._batch_runner import BatchRunners
from tensorrpc._bulk_io import BulkLinks
from tensorrpc._compression import Compression
from tensorrpc._exceptions import (
    ClosedError,
    ErrorCode,
    HandshakeRejectedError,
    PeerUnreachableError,
    TransportError,
)
from tensorrpc._health import HealthStatus
from tensorrpc._hostinfo import host_id as _host_id
from tensorrpc._interceptors import check_interceptors
from tensorrpc._liveness import check_heartbeat, to_ms
from tensorrpc._logonce import Said
from tensorrpc._protocol import (
    MAX_SIGNATURE_CHARS,
    PROTOCOL_VERSION,
    ErrorInfo,
    Hello,
    MessageKind,
    Welcome,
)
from tensorrpc._release import later_if_large, nbytes
from tensorrpc._server_protocol import (
    AllRejected,
    BuiltinCall,
    CallExpired,
    ProtocolSettings,
    Released,
    ServerCall,
    ServerProtocol,
    Session,
    SessionEnded,
    SessionStarted,
    ShmPeer,
    Wake,
)
from tensorrpc._service import describe
from tensorrpc._text import CONTROL, peer_text
from tensorrpc._zmq import (
    DEFAULT_OPTIONS,
    AsyncSocket,
    PendingSends,
    SocketOptions,
    Waiters,
    create_socket,
    loop_clock,
    message_peer_address,
    peer_credentials,
)
from tensorrpc.transports._peer import ALIAS_SETTINGS, AliasSetting
from tensorrpc.transports._policy import (
    DEFAULT_SHM_THRESHOLD,
    TransportPolicy,
    TransportStatistics,
)

if TYPE_CHECKING:
    from collections.abc import Hashable, Mapping, Sequence
    from types import TracebackType
    from typing import Self, Unpack

    from anyio.abc import TaskStatus
    from typing_extensions import Buffer

    from tensorrpc._interceptors import ServerInterceptor
    from tensorrpc._observe import Observer
    from tensorrpc._security import CurveConfig
    from tensorrpc._service import MethodSpec, ServiceSpec

__all__ = ["PeerStatistics", "Server", "ServerConfig", "ServerStatistics", "serve"]

logger = logging.getLogger("tensorrpc.server")

_NO_TRANSPORT_STATISTICS: Final = TransportStatistics()
#: How results are compressed by default for a client that asks (`ServerConfig.compression`).
_RESULT_COMPRESSION: Final = Compression()
#: Longest peer-written reason shown in a log line or an exception.
_WHY_CHARS: Final = 512
_RESULT_KIND: Final = int(MessageKind.RESULT)
# How long the sockets may keep flushing the last replies and BYEs after close.
_CLOSE_LINGER_MS: Final = 1000


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """An engine's options, checked: each field is a keyword of
    [`Server`][tensorrpc.Server] and [`serve`][tensorrpc.serve] (as the client's options
    are keywords of [`Client`][tensorrpc.Client]), read back as ``Server.config``.
    Exactly one of ``connect`` and ``bind`` is given.

    Example:
        ``Server(Calculator(), bind="tcp://127.0.0.1:0", max_queued=16)``
    """

    #: Dial-in mode: the address (or addresses) of the clients' bound ROUTERs.
    connect: str | Sequence[str] | None = None
    #: Listen mode: the address (or addresses) to bind one ROUTER to
    #: (``tcp://127.0.0.1:0`` picks a free port, see ``Server.endpoint``).
    bind: str | Sequence[str] | None = None
    #: This engine's id, unique among a client's engines (default ``hostname-pid``).
    engine_id: str | None = None
    #: Calls handled at once (worker tasks); also sent in HELLO.
    max_concurrency: int = 64
    #: Calls accepted beyond those running; more are refused with OVERLOADED. Calls
    #: flagged NO_WAIT are refused as soon as they would queue.
    max_queued: int = 256
    #: Threads running sync handlers at once.
    sync_workers: int = 8
    #: Seconds running calls may take to finish at shutdown.
    grace_period: float = 5.0
    #: Seconds between PINGs to each client (shorter when a client's bound needs it).
    heartbeat_interval: float = 1.0
    #: A client silent for this long loses its session and its calls are cancelled.
    dead_after: float = 5.0
    #: Codec limits (must match the clients'); None: the defaults.
    codec: _codec.CodecConfig | None = None
    #: ZMQ socket options (HWMs, MAXMSGSIZE, ...); None: the defaults. ``maxmsgsize`` is
    #: the largest frame this engine accepts (a peer sending more is disconnected by
    #: ZMQ) and sends (a bigger result is answered with a BAD_RESULT error); it is
    #: lowered to the largest frame ``codec`` accepts (the larger of ``max_tensor_bytes``
    #: and ``max_payload_bytes``), and announced in HELLO.
    socket_options: SocketOptions | None = None
    #: CURVE encryption and authentication (see [Security](security.md)); None: plaintext.
    curve: CurveConfig | None = None
    #: Offer and use the ``torch_shm`` tensor transport with clients on this host.
    torch_shm: bool = True
    #: For calls whose transport is ``auto``, CPU result tensors of at least this many
    #: bytes go by ``torch_shm``.
    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    #: ``"same-user"``: tensors in torch's own shared memory (``share_memory_()``,
    #: torch.multiprocessing) go by alias to and from a client the kernel says is our user
    #: with no privilege we lack (docs/security.md); ``"never"``: they are copied through
    #: the sealed pool. One setting on both ends: either side's ``"never"`` wins.
    shm_alias_unsealed: AliasSetting = "same-user"
    #: Use ``torch_shm`` with clients the kernel cannot attest (tcp://, loopback too),
    #: taking the pid they claim on trust; the client must set it too. Read
    #: docs/security.md first: any peer that can connect may then make this engine open
    #: any descriptor of any process it may open.
    shm_trust_unattested: bool = False
    #: Listen mode: most peers without a session remembered at once (oldest evicted).
    max_strangers: int = 1024
    #: Most streams of one client waiting for credit at once; more end with OVERLOADED.
    max_parked_streams: int = 256
    #: Request items a client may send per client-streaming or bidirectional call ahead
    #: of the handler (HELLO's ``stream_window``); credit comes back as it takes them.
    stream_window: int = 16
    #: An ``Observer`` (or several) told about every call this engine runs (see
    #: docs/observability.md); ``tensorrpc.metrics.exporter(port)`` exports Prometheus
    #: metrics over HTTP.
    observer: Observer | Sequence[Observer] | None = None
    #: How results are compressed for a call that asks for it (a client's
    #: ``compression=`` option), when ``zstandard`` is installed here (the
    #: ``compression`` extra); None: never compress results. What travels by
    #: ``torch_shm`` is never compressed.
    compression: Compression | None = _RESULT_COMPRESSION
    #: Async interceptors around every call's handler, the first outermost (see
    #: docs/interceptors.md): ``async def icpt(context, proceed)``.
    interceptors: Sequence[ServerInterceptor] = ()

    def __post_init__(self) -> None:
        if (self.bind is None) == (not self.connect):
            raise ValueError("give exactly one of connect= (dial in) and bind= (listen)")
        if self.max_concurrency < 1 or self.max_queued < 0 or self.sync_workers < 1:
            raise ValueError("max_concurrency and sync_workers must be >= 1, max_queued >= 0")
        check_heartbeat(self.heartbeat_interval, self.dead_after)
        if self.grace_period < 0:
            raise ValueError("grace_period must not be negative")
        if self.max_strangers < 1 or self.max_parked_streams < 1 or self.stream_window < 1:
            raise ValueError("max_strangers, max_parked_streams and stream_window must be >= 1")
        if self.shm_alias_unsealed not in ALIAS_SETTINGS:
            raise ValueError(f"shm_alias_unsealed must be one of {sorted(ALIAS_SETTINGS)}")


class ServerOptions(TypedDict, total=False):
    """Keyword options of [`Server`][tensorrpc.Server] and [`serve`][tensorrpc.serve]:
    the fields of [`ServerConfig`][tensorrpc.ServerConfig]."""

    connect: str | Sequence[str] | None
    bind: str | Sequence[str] | None
    engine_id: str | None
    max_concurrency: int
    max_queued: int
    sync_workers: int
    grace_period: float
    heartbeat_interval: float
    dead_after: float
    codec: _codec.CodecConfig | None
    socket_options: SocketOptions | None
    curve: CurveConfig | None
    torch_shm: bool
    shm_threshold: int
    shm_alias_unsealed: AliasSetting
    shm_trust_unattested: bool
    max_strangers: int
    max_parked_streams: int
    stream_window: int
    observer: Observer | Sequence[Observer] | None
    compression: Compression | None
    interceptors: Sequence[ServerInterceptor]


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    """What one client did on this engine."""

    #: The client's id (from its WELCOME), or its address / routing id before that.
    client_id: str
    #: ``"hello"``, ``"live"``, ``"parted"`` or ``"rejected"``.
    state: str
    #: Calls accepted from this client.
    calls: int
    #: Calls that ended with an ERROR reply.
    errors: int
    #: Calls queued or running now.
    in_flight: int
    #: Bytes received from this client (all frames).
    bytes_in: int
    #: Bytes sent to this client (all frames).
    bytes_out: int


@dataclass(frozen=True, slots=True)
class ServerStatistics:
    """A snapshot of an engine's counters (see ``Server.statistics``)."""

    #: This engine's id.
    engine_id: str
    #: Calls accepted since start.
    calls: int
    #: Calls that ended with an ERROR reply (refusals included).
    errors: int
    #: Calls queued or running now.
    in_flight: int
    #: Calls waiting in the queue for a worker.
    queued: int
    #: Calls refused with OVERLOADED.
    overloaded: int
    #: Messages dropped: malformed, unexpected, or undeliverable replies.
    dropped: int
    #: Per known client.
    clients: tuple[PeerStatistics, ...]
    #: Per tensor transport: tensors and bytes moved, and fallbacks to frames.
    transports: TransportStatistics = _NO_TRANSPORT_STATISTICS
    #: Listen mode: peers without a session forgotten because the table was full.
    strangers_evicted: int = 0
    #: Per batched method (``@rpc(batch=...)``): ``batches``, ``items``, ``queued``,
    #: ``running``, and the histograms ``sizes`` (``[items, batches]`` pairs),
    #: ``queue_wait`` and ``run_time`` (``[bucket, count]`` pairs in the statistics
    #: method's latency buckets, sums in ``queue_wait_sum_s`` / ``run_time_sum_s``).
    batching: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Per method of the service (see `MethodStatistics.snapshot`): ``calls``,
    #: ``errors``, ``items``, ``outcomes`` and the latency histograms ``queue_wait``,
    #: ``run_time`` and ``latency``; counted since the engine started.
    methods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def _hello_signature(spec: MethodSpec) -> str:
    # HELLO caps each signature; a huge dataclass description is cut, never refused.
    text = spec.signature
    if len(text) <= MAX_SIGNATURE_CHARS:
        return text
    return text[: MAX_SIGNATURE_CHARS - 5] + " ..."


_STATISTICS_REFUSED: Final = ErrorInfo(
    int(ErrorCode.METHOD_NOT_FOUND),
    "",
    "statistics are only given to authenticated peers: this engine's CURVE socket accepts "
    "any client key (set allowed_clients)",
)


def _protocol_settings(
    cfg: ServerConfig,
    spec: ServiceSpec,
    engine_id: str,
    instance: object,
    policy: TransportPolicy,
    batches: BatchRunners,
    codec: _codec.CodecConfig,
    maxmsgsize: int,
) -> ProtocolSettings:
    """What the engine's protocol machine is configured with (its HELLO included)."""
    hello = Hello(
        engine_id=engine_id,
        service=spec.name,
        fingerprint=spec.fingerprint,
        protocol_version=PROTOCOL_VERSION,
        host_id=_host_id(),
        pid=os.getpid(),
        transports=policy.offered(),
        concurrency=cfg.max_concurrency,
        heartbeat_ms=to_ms(cfg.heartbeat_interval),
        methods=tuple(spec.methods),
        streaming=tuple(m.name for m in spec.methods.values() if m.streaming),
        signatures=tuple(_hello_signature(m) for m in spec.methods.values()),
        max_message_bytes=max(0, maxmsgsize),
        compression=_compression.available(),
        request_streaming=tuple(m.name for m in spec.methods.values() if m.request_streaming),
        stream_window=cfg.stream_window,
    )
    return ProtocolSettings(
        hello=hello,
        methods={
            name: (m, batches.entry(name, getattr(instance, name)))
            for name, m in spec.methods.items()
        },
        listen=cfg.bind is not None,
        max_concurrency=cfg.max_concurrency,
        max_queued=cfg.max_queued,
        heartbeat_interval=cfg.heartbeat_interval,
        dead_after=cfg.dead_after,
        max_strangers=cfg.max_strangers,
        max_parked_streams=cfg.max_parked_streams,
        max_buffers=codec.max_tensors,
        builtins=frozenset({_observe.STATISTICS_METHOD}),
    )


def _statistics(
    engine_id: str, proto: ServerProtocol, policy: TransportPolicy, batches: BatchRunners
) -> ServerStatistics:
    return ServerStatistics(
        engine_id=engine_id,
        calls=proto.calls_total,
        errors=proto.errors_total,
        in_flight=proto.in_flight(),
        queued=len(proto.queue),
        overloaded=proto.overloaded,
        dropped=proto.dropped,
        clients=tuple(
            PeerStatistics(
                client_id=s.name,
                state=s.state.value,
                calls=s.calls_total,
                errors=s.errors,
                in_flight=len(s.calls),
                bytes_in=s.bytes_in,
                bytes_out=s.bytes_out,
            )
            for s in proto.sessions.values()
        ),
        transports=policy.statistics(),
        strangers_evicted=proto.strangers_evicted,
        batching=batches.statistics(),
        methods={name: m.snapshot() for name, m in proto.calls.methods.items()},
    )


def _engine_id(given: str | None) -> str:
    engine_id = given or f"{_socket.gethostname()}-{os.getpid()}"
    if "/" in engine_id or len(engine_id.encode()) > 200 or CONTROL.search(engine_id):
        raise ValueError(
            "engine_id must be 1..200 bytes of UTF-8 without '/' or control characters"
        )
    return engine_id


def _addresses_of(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


class Server:
    """An engine: serves one ``@service`` instance to one or more clients.

    Use it as an async context manager: entering binds/connects the sockets and starts
    serving; leaving drains (see [`aclose`][tensorrpc.Server.aclose]):

        async with Server(Calculator(), bind="tcp://127.0.0.1:0") as server:
            print(server.endpoint)
            await server.serve_forever()

    Args:
        instance: An instance of a ``@service`` class.
        **options: The engine's options (``bind=``, ``connect=``, ``max_concurrency=``
            ...), each a field of [`ServerConfig`][tensorrpc.ServerConfig], where every
            option is described.

    Raises:
        ValueError: Bad options (both or neither of connect/bind, bad numbers).
        TypeError: An unknown option.
        ServiceDefinitionError: ``instance`` is not an instance of a ``@service`` class.
    """

    def __init__(self, instance: object, /, **options: Unpack[ServerOptions]) -> None:
        self._config = cfg = ServerConfig(**options)  # an unknown option: TypeError
        self._spec: ServiceSpec = describe(instance)
        self._engine_id = engine_id = _engine_id(cfg.engine_id)
        self._addresses = _addresses_of(cfg.connect)
        self._binds = _addresses_of(cfg.bind)
        self._listen = bool(self._binds)
        self._codec = cfg.codec if cfg.codec is not None else _codec.DEFAULT
        # A frame over the codec's limits would be buffered only to be refused: ZMQ drops
        # it at its header instead, and HELLO announces the limit (clients check it).
        sock_options = cfg.socket_options or DEFAULT_OPTIONS
        self._socket_options = sock_options.capped(_codec.frame_limit(self._codec))
        self._policy = TransportPolicy(
            torch_shm=cfg.torch_shm,
            shm_threshold=cfg.shm_threshold,
            alias_unsealed=cfg.shm_alias_unsealed,
            trust_unattested=cfg.shm_trust_unattested,
            message_address=message_peer_address,
        )
        self._batches = BatchRunners(self._spec, instance, engine_id, lambda: self._observer)
        self._proto = ServerProtocol(
            _protocol_settings(cfg, self._spec, engine_id, instance, self._policy, self._batches,
                               self._codec, self._socket_options.maxmsgsize)
        )  # fmt: skip
        self._routing_id = f"{engine_id}/{secrets.token_hex(6)}".encode()
        self._router: AsyncSocket | None = None
        self._dealers: dict[str, AsyncSocket] = {}
        self._sockets: list[AsyncSocket] = []
        self._endpoints: list[str] = []  # listen mode, in the order of ``bind``
        self._pending = PendingSends()
        self._bulk = BulkLinks(self._socket_options, cfg.curve, partial(_bulk_feed, self))
        self._now = time.monotonic  # the event loop's clock once entered
        # The worker pool (`tensorrpc._dispatch`).
        self._capacity = cfg.max_concurrency
        self._limiter = anyio.CapacityLimiter(cfg.sync_workers)
        self._compression = cfg.compression if _compression.available() else None
        self._interceptors = check_interceptors(cfg.interceptors, "engine")
        self._scalar_results = _dispatch.scalar_results(self._spec)
        self._tg: anyio.abc.TaskGroup | None = None
        self._waiters: Waiters | None = None
        self._idle: list[Any] = []  # the parked workers' wake-ups
        self._workers = 0
        self._parked = 0  # calls waiting for credit or for their batch, holding no worker
        self._pool_closed = False
        self._pool_done = anyio.Event()
        self._started = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._stopped: anyio.Event | None = None
        self._poke: anyio.Event | None = None
        self._outer_tg: anyio.abc.TaskGroup | None = None
        self._inner_scope: anyio.CancelScope | None = None
        self._observer = _observe.resolve(cfg.observer)
        self._said = Said()  # refusals already logged at WARNING
        self._started_at = time.time()

    # -- public surface ---------------------------------------------------------------------

    @property
    def config(self) -> ServerConfig:
        """The engine's configuration."""
        return self._config

    @property
    def engine_id(self) -> str:
        """This engine's id, as sent in HELLO."""
        return self._engine_id

    @property
    def service(self) -> ServiceSpec:
        """The spec of the service being served."""
        return self._spec

    @property
    def endpoint(self) -> str | None:
        """Listen mode: the (first) bound endpoint; a ``tcp://...:0`` bind reads back its port."""
        endpoints = self._endpoints
        return endpoints[0] if endpoints else None

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Listen mode: every bound endpoint, in the order of ``bind``."""
        return tuple(self._endpoints)

    @property
    def addresses(self) -> tuple[str, ...]:
        """Dial-in mode: the client addresses this engine connects to."""
        return self._addresses

    @property
    def health(self) -> HealthStatus:
        """What the built-in health method answers now (``NOT_SERVING`` while draining)."""
        return self._proto.health()

    def set_health(self, status: HealthStatus) -> None:
        """Say whether this engine can serve, for health probes (a dependency is down).

        Probes (``tensorrpc health``, [`Client.health`][tensorrpc.Client.health], the
        Ray launcher) read it through the built-in health method, which the engine answers
        without a worker. Calls are still accepted: routing traffic away is the prober's
        job. Draining answers ``NOT_SERVING`` whatever was set.

        Args:
            status: ``HealthStatus.SERVING`` or ``HealthStatus.NOT_SERVING``.

        Raises:
            ValueError: Another status.
        """
        self._proto.set_health(HealthStatus(status))

    def statistics(self) -> ServerStatistics:
        """Return a snapshot of the engine's counters, with one entry per known client."""
        return _statistics(self._engine_id, self._proto, self._policy, self._batches)

    async def __aenter__(self) -> Self:
        if self._started:
            raise RuntimeError("a Server can be entered only once")
        self._started = True
        self._stopped = anyio.Event()
        self._poke = anyio.Event()
        self._now = loop_clock()
        try:
            if self._observer is not None:  # observe: the engine opened
                # Before binding: an exporter's port in use fails before any socket is bound.
                self._observer.opened(self)
            self._open()
        except BaseException:
            if self._observer is not None:
                self._observer.closed(self)
            raise
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await tg.start(self._host)
        except BaseException as exc:
            tg.cancel_scope.cancel()
            self._close_sockets()
            await tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._outer_tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        tg, self._outer_tg = self._outer_tg, None
        if tg is None:
            return None
        try:
            return await tg.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The task group wraps what the body raised; the internal tasks are done, so
            # that is all the group holds: give the caller its own exception back.
            if exc is not None and len(group.exceptions) == 1 and group.exceptions[0] is exc:
                raise exc from None
            raise

    async def serve_forever(self) -> None:
        """Serve until the server is closed (or cancelled: then leaving the context drains).

        Raises:
            HandshakeRejectedError: Dial-in mode: every client refused this engine.
            ClosedError: The server was never started.
        """
        if self._stopped is None:
            raise ClosedError("enter the Server (async with) before serve_forever()")
        await self._stopped.wait()
        if self._fatal is not None:
            raise self._fatal

    async def aclose(self) -> None:
        """Drain and close: refuse new calls, let running calls finish, say BYE, close.

        New CALLs get a DRAINING error at once; running (and queued) calls get
        ``grace_period`` seconds to finish, then are cancelled and answered with a
        DRAINING error. Sync handlers cannot be interrupted: their thread runs to
        completion in the background and its result is dropped. Then every client gets
        BYE, the sockets close and ipc:// files we bound are removed. Idempotent; runs
        shielded from cancellation (it is bounded by ``grace_period`` plus ``dead_after``).
        """
        if self._closed or not self._started:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self._drain()
            finally:
                if self._inner_scope is not None:
                    self._inner_scope.cancel()
                self._close_sockets()
                self._policy.close()
                if self._observer is not None:  # observe: the engine closed
                    self._observer.closed(self)
                if self._stopped is not None:
                    self._stopped.set()

    # -- start and stop ---------------------------------------------------------------------

    async def _host(self, *, task_status: TaskStatus[None]) -> None:
        # The tasks live in a shielded scope: cancelling the code that entered the Server
        # must not cancel running handlers before the drain has given them their grace.
        with anyio.CancelScope(shield=True) as scope:
            self._inner_scope = scope
            async with anyio.create_task_group() as tg:
                _dispatch.start(self, tg)
                self._batches.start(tg)
                self._bulk.start(tg)
                if self._router is not None:
                    tg.start_soon(self._receive_loop, self._router, None)
                for address, sock in self._dealers.items():
                    tg.start_soon(self._receive_loop, sock, address)
                tg.start_soon(self._housekeeping)
                task_status.started()

    async def _drain(self) -> None:
        cfg = self._config
        proto = self._proto
        proto.start_drain()
        _dispatch.close(self)  # workers finish what is queued, then exit
        done = self._pool_done
        if self._fatal is None:
            with anyio.move_on_after(cfg.grace_period):
                await done.wait()
        if not done.is_set():
            proto.stop_all()
            self._flush()
            with anyio.move_on_after(cfg.dead_after + 1.0):
                await done.wait()
        proto.goodbye()  # also to clients whose WELCOME may still be on its way
        self._flush()
        logger.info("engine %r stopped", self._engine_id)

    # -- sockets ----------------------------------------------------------------------------

    def _open(self) -> None:
        """Bind the ROUTER, or connect one DEALER per client (each added to the protocol)."""
        options, curve = self._socket_options, self._config.curve
        try:
            if self._listen:
                sock = self._router = create_socket(zmq.ROUTER, options=options, curve=curve)
                self._sockets.append(sock)
                self._endpoints.extend(sock.bind(address) for address in self._binds)
                self._proto.announce_bulk(self._bulk.listen(*self._endpoints))
                logger.info("engine %r listening on %s", self._engine_id, self._endpoints)
                return
            now = self._now()
            for address in self._addresses:
                sock = create_socket(
                    zmq.DEALER, options=options, routing_id=self._routing_id, curve=curve
                )
                self._dealers[address] = sock
                self._sockets.append(sock)
                # Only queue on a live connection: no HELLOs piling up while the client
                # is down, and sends to a vanished client fail fast.
                sock.socket.setsockopt(zmq.IMMEDIATE, 1)
                sock.connect(address)
                self._proto.add_client(address, now)
            logger.info("engine %r dialling %s", self._engine_id, ", ".join(self._addresses))
        except BaseException:
            self._close_sockets()
            raise

    def _close_sockets(self) -> None:
        """Close every socket (letting ZMQ flush the last replies and BYEs a while)."""
        for sock in self._sockets:
            if not sock.closed:
                with contextlib.suppress(zmq.ZMQError):
                    sock.socket.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
                sock.close()
        self._bulk.close(_CLOSE_LINGER_MS, bye="shutdown")  # BYE on each bulk connection too
        self._pending.clear()

    async def _receive_loop(self, sock: AsyncSocket, address: str | None) -> None:
        """Feed every message of ``sock`` to the protocol (`_take`)."""
        recv = sock.recv
        take = self._take
        while True:
            try:
                frames = await recv()
            except ClosedError:
                return
            take(frames, address)
            del frames  # not held until the next message arrives

    def _take(self, frames: list[zmq.Frame], address: str | None) -> None:
        """Feed one message to the protocol and act on what it queued: a ROUTER's
        (``address`` None) keyed by its routing id frame, a DEALER's by the client
        ``address``. Never awaits: a message taken off a socket is handled at once, so
        that the housekeeping's `_take_received` never overtakes it."""
        proto = self._proto
        size = sum(map(len, frames))  # no loop variable left holding a frame
        try:
            if address is None:
                route = frames[0].bytes
                body: list[Buffer] = frames[1:]  # type: ignore[assignment]
                proto.receive(route, body, self._now(), size - len(route))
                del body
            else:
                proto.receive(address, frames, self._now(), size)  # type: ignore[arg-type]
            if proto.pending:
                self._flush(size)
        except Exception:  # one bad message must never stop the loop
            proto.unhandled(address)
            logger.exception("error handling a message from %s", address or "a peer")
        # Not held until the next message arrives: a large one is freed off the loop.
        later_if_large(frames, size)

    def _take_received(self, limit: int = 4096) -> None:
        """Take what the sockets already hold (at most ``limit`` messages each), without
        waiting: their receive loops may not have run yet (a stalled or starved loop wakes
        them and the timer together), and a client whose PINGs wait there is alive."""
        sockets: list[tuple[AsyncSocket, str | None]] = [
            (sock, address) for address, sock in self._dealers.items()
        ]
        if self._router is not None:
            sockets.append((self._router, None))
        for sock, address in sockets:
            for _ in range(limit):
                try:
                    frames = sock.recv_nowait()
                except (anyio.WouldBlock, ClosedError, TransportError):
                    break  # (an error is the receive loop's to meet)
                self._take(frames, address)
                del frames

    def _send_now(self, key: object, frames: list[bytes]) -> bool:
        """Send a small message without waiting; False when it could not go (ZMQ full,
        no connection): the caller tells the protocol (``send_failed``)."""
        if self._router is not None:
            sock: AsyncSocket | None = self._router
            parts: list[Any] = [key, *frames]
        else:
            sock, parts = self._dealers.get(cast("str", key)), frames
        if sock is None:
            return False
        try:
            sock.send_nowait(parts)
        except (anyio.WouldBlock, PeerUnreachableError, ClosedError) as exc:
            logger.debug("dropped a message to %r: %r", key, exc)
            return False
        except TransportError as exc:
            logger.warning("cannot send to %r: %s", key, exc)
            return False
        return True

    async def _send_reply(self, call: ServerCall, keepalive: list[object] | None) -> None:
        """Send the reply the protocol just queued for ``call`` (the last message of
        `frames_to_send`; any before it go first, without waiting) from a worker:
        possibly large, zero-copy, waiting a bounded time.

        The wait (ZMQ full, or a DEALER whose client is not connected) ends after
        ``dead_after``, or when the call is cancelled (CANCEL, its session ended); a
        reply that could not go is counted by the protocol (``send_failed``).
        """
        sends = self._proto.frames_to_send()
        frames = sends.pop()[1]
        if sends:
            _send_all(self, sends)
        key: Any = call.key  # a routing id (ROUTER) or a client address (DEALERs)
        sock = self._router
        if keepalive is not None and await _send_bulk(self, call, frames, keepalive):
            return
        if sock is not None:
            parts: list[Buffer] = [key, *frames]
        else:
            sock = self._dealers.get(key)
            if sock is None:
                self._proto.send_failed(key, frames, self._now())
                return
            parts = frames
        track = keepalive is not None
        try:
            try:
                tracker = sock.send_nowait(parts, track=track)
            except anyio.WouldBlock:
                tracker = await self._send_waiting(call, sock, parts, track)
        except (anyio.WouldBlock, PeerUnreachableError, ClosedError) as exc:
            self._proto.send_failed(key, frames, self._now())
            logger.debug("dropped a reply to %s: %r", peer_text(call.session.name), exc)
            return
        except TransportError as exc:
            self._proto.send_failed(key, frames, self._now())
            logger.warning("cannot send a reply to %s: %s", peer_text(call.session.name), exc)
            return
        if keepalive is not None:
            self._pending.add(tracker, keepalive, nbytes(frames))

    async def _send_waiting(
        self, call: ServerCall, sock: AsyncSocket, parts: list[Buffer], track: bool
    ) -> zmq.MessageTracker | None:
        if call.cancelled:
            raise anyio.WouldBlock
        with anyio.move_on_after(self._config.dead_after) as scope:
            borrowed = call.scope is None  # unary: no scope of its own any more
            if borrowed:
                call.scope = scope
            try:
                return await sock.send(parts, track=track)
            finally:
                if borrowed:
                    call.scope = None
        raise anyio.WouldBlock

    # -- receiving --------------------------------------------------------------------------

    def _flush(self, size: int = 0) -> None:
        """Send the protocol's frames, act on its events (accepted calls, wakes, session
        news) until it is done; ``size``: the received message's (an accepted CALL's)."""
        proto = self._proto
        while True:  # (callers on the hot path check `pending` first)
            sends = proto.frames_to_send()
            if sends:
                _send_all(self, sends)
            for event in proto.next_events():
                if type(event) is ServerCall:  # accepted: wake a worker (the hot path)
                    if self._idle:
                        assert self._waiters is not None
                        self._waiters.wake(self._idle.pop())
                    else:
                        _dispatch.wake_one(self)
                    if event.deadline <= proto.wake_at:  # the timer moved to its deadline
                        self._wake_housekeeping()
                    if self._observer is not None:  # observe: a CALL was accepted
                        _observe_call(self, event, size)
                elif type(event) is Wake:
                    event.call.wake()
                else:
                    _on_event(self, event)
            if not proto.pending:
                return

    # -- housekeeping -----------------------------------------------------------------------

    def _wake_housekeeping(self) -> None:
        if self._poke is not None:
            self._poke.set()

    async def _housekeeping(self) -> None:
        interval = self._config.heartbeat_interval
        clock = self._now
        next_sweep = clock() + interval
        while True:
            now = clock()
            if now >= self._proto.silent_at:  # a silence verdict may be due
                self._take_received()
                now = clock()
            self._proto.tick(now)
            self._flush()
            if now >= next_sweep:
                next_sweep = now + interval
                self._policy.memory.sweep()
                for sock in self._sockets:
                    sock.handshake_failures()  # logs failed CURVE handshakes at WARNING
            self._pending.prune()
            wait = max(0.005, min(self._proto.wake_at, next_sweep) - clock())
            self._poke = poke = anyio.Event()
            with anyio.move_on_after(wait):
                await poke.wait()


# -- session news and the built-in statistics method ------------------------------------


def _on_event(server: Server, event: object) -> None:
    if isinstance(event, BuiltinCall):
        _answer_statistics(server, event)
    elif isinstance(event, Released):
        server._policy.memory.release(event.leases, event.session)
    elif isinstance(event, SessionStarted):
        _negotiate_shm(server, event.session, event.welcome, event.frame)
        server._bulk.session_started(event.session, event.welcome, event.frame)
        logger.info("engine %r joined client %s", server._engine_id, peer_text(event.session.name))
        server._wake_housekeeping()  # its PING interval may be shorter than ours
    elif isinstance(event, SessionEnded):
        server._bulk.forget(event.session.key)
        policy = server._policy
        policy.memory.peer_gone(event.session, policy.peers.drop(event.session))
        log = logger.warning if event.warn else logger.info
        if event.why.startswith("refused") and not server._said.first(
            (event.session.name, event.why)
        ):
            log = logger.debug  # the same refusal again (a HELLO retried every second)
        log("client %s %s", peer_text(event.session.name), peer_text(event.why, _WHY_CHARS))
    elif isinstance(event, CallExpired):
        observed = event.call.observed
        if observed is not None:  # observe: answered DEADLINE_EXCEEDED from the queue
            observed.error(ErrorCode.DEADLINE_EXCEEDED.name)
            observed.finished("ok", 0)
    elif isinstance(event, AllRejected):  # stop serving: serve_forever raises it
        server._fatal = server._fatal or HandshakeRejectedError(
            f"every client refused engine {server._engine_id!r}: "
            + peer_text(event.message, _WHY_CHARS),
            reason=event.reason,
            engine_id=server._engine_id,
        )
        if server._stopped is not None:
            server._stopped.set()


def _negotiate_shm(server: Server, session: Session, welcome: Welcome, frame: object) -> None:
    # torch_shm only with the process the kernel says is at the other end of the
    # connection the WELCOME came on (docs/security.md); its claims are hints.
    pid, send, receive = server._policy.peers.attest(
        session,
        peer_credentials(frame),
        offers=welcome.transports,
        claimed_pid=welcome.pid,
        same_host=welcome.host_id == _host_id(),
    )
    server._proto.shm_decided(session, ShmPeer(pid=pid, peer_receives=send, we_receive=receive))


def _answer_statistics(server: Server, event: BuiltinCall) -> None:
    """Answer the built-in statistics method (``tensorrpc top``): a RESULT map."""
    if not _observe.statistics_allowed(server._config.curve):
        server._proto.builtin_refused(event, _STATISTICS_REFUSED)
        return
    body = _observe.statistics_body(
        server.statistics(), service=server._spec.name, pid=os.getpid(), started=server._started_at
    )
    server._proto.builtin_reply(event, _codec.encode(body, server._codec).payload)


def _observe_call(server: Server, call: ServerCall, size: int) -> None:
    assert server._observer is not None
    spec = call.spec
    call.observed = server._observer.engine_call(
        spec.service, spec.name, server._engine_id, call.session.name, spec.streaming,
        call.trace, size,
    )  # fmt: skip


def _send_all(server: Server, sends: list[tuple[Hashable, list[Any]]]) -> None:
    """Send the protocol's messages without waiting; one that cannot go is counted
    dropped (a dial-in HELLO is retried soon)."""
    send_now = server._send_now
    for key, frames in sends:
        if not send_now(key, frames):
            server._proto.send_failed(key, frames, server._now())
            server._wake_housekeeping()


def _bulk_feed(server: Server, key: Hashable, frames: list[zmq.Frame], size: int) -> None:
    """A message on a bound bulk connection, as if it came on the session's control
    connection (its large CALLs)."""
    proto = server._proto
    proto.receive(key, cast("list[Buffer]", frames), server._now(), size)
    if proto.pending:
        server._flush(size)


async def _send_bulk(
    server: Server, call: ServerCall, frames: list[Buffer], keepalive: list[object]
) -> bool:
    """Send a large RESULT on the session's bulk connection, if bound, so that the small
    replies behind it do not wait for its bytes (docs/design.md); False: it goes on the
    control connection (not a RESULT, too small, no bulk connection, or it is gone)."""
    if memoryview(frames[0])[3] != _RESULT_KIND:
        return False
    route = server._bulk.route(call.key, frames, frames[2:])
    if route is None:
        return False
    sock, parts = route
    try:
        try:
            tracker = sock.send_nowait(parts, track=True)
        except anyio.WouldBlock:
            tracker = await server._send_waiting(call, sock, parts, True)
    except (PeerUnreachableError, ClosedError):
        server._bulk.lost(call.key)
        return False
    except (anyio.WouldBlock, TransportError) as exc:
        server._proto.send_failed(call.key, frames, server._now())
        logger.debug("dropped a reply to %s: %r", peer_text(call.session.name), exc)
        return True
    server._pending.add(tracker, keepalive, nbytes(frames))
    return True


async def serve(
    instance: object,
    /,
    *,
    task_status: TaskStatus[Server] = anyio.TASK_STATUS_IGNORED,
    **options: Unpack[ServerOptions],
) -> None:
    """Serve ``instance`` until cancelled; cancelling drains (see ``Server.aclose``).

    Run it with ``await tg.start(serve, ...)`` to learn when it is ready: ``start``
    returns the [`Server`][tensorrpc.Server] (its ``endpoint`` is the bound address).
    The arguments are those of ``Server``.

    Raises:
        HandshakeRejectedError: Dial-in mode: every client refused this engine.
        ConnectError: ``bind`` or ``connect`` is malformed or the address is in use.
        ValueError: Bad options.
    """
    async with Server(instance, **options) as server:
        task_status.started(server)
        await server.serve_forever()
