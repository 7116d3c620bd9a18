"""The engine side: ``serve()`` / ``Server`` run a service instance behind ZMQ.

This module is the I/O shell: every decision is ``_server_protocol.ServerProtocol``'s,
the worker pool is ``_dispatch``'s and the sockets (their receive loops, every send) are
``_server_sockets.ServerSockets``'. What is left here:

* The configuration, the lifecycle (start, drain, close) and the statistics.
* For each message a receive loop fed to the protocol: wake a worker when it accepted a
  call, and flush what the protocol handed out: frames to send, then its events (calls
  to stop or wake, session news: torch_shm negotiation, freed leases).
* One housekeeping task runs the protocol's timers and releases the memory of tensors
  ZMQ has finished sending.

Rules this module keeps:

1. Every socket operation happens on the event-loop thread; a receive loop never waits
   on a send (it sends with ``send_nowait`` and drops the message when ZMQ is full).
2. The memory of every zero-copy send is held until ZMQ's tracker says it is done.
3. Shutdown drains: new CALLs get DRAINING, running calls get ``grace_period`` to finish,
   then are cancelled (and get an ERROR), BYE goes to every client, sockets close.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket as _socket
import time
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Final, TypedDict

import anyio

from tensorrpc import _codec, _observe
from tensorrpc._batch_runner import BatchRunners
from tensorrpc._dispatch import Call, Dispatcher
from tensorrpc._exceptions import ClosedError, ErrorCode, HandshakeRejectedError
from tensorrpc._hostinfo import host_id as _host_id
from tensorrpc._liveness import check_heartbeat, to_ms
from tensorrpc._logonce import Said
from tensorrpc._protocol import (
    MAX_SIGNATURE_CHARS,
    PROTOCOL_VERSION,
    ErrorInfo,
    Hello,
    Welcome,
)
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
)
from tensorrpc._server_sockets import ServerSockets
from tensorrpc._service import describe
from tensorrpc._text import CONTROL, peer_text
from tensorrpc._zmq import DEFAULT_OPTIONS, SocketOptions, message_peer_address, peer_credentials
from tensorrpc.transports._peer import ALIAS_SETTINGS, AliasSetting
from tensorrpc.transports._policy import (
    DEFAULT_SHM_THRESHOLD,
    TransportPolicy,
    TransportStatistics,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import TracebackType
    from typing import Self, Unpack

    from anyio.abc import TaskStatus

    from tensorrpc._observe import Observer
    from tensorrpc._security import CurveConfig
    from tensorrpc._service import MethodSpec, ServiceSpec

__all__ = ["PeerStatistics", "Server", "ServerConfig", "ServerStatistics", "serve"]

logger = logging.getLogger("tensorrpc.server")

_NO_TRANSPORT_STATISTICS: Final = TransportStatistics()
#: Longest peer-written reason shown in a log line or an exception.
_WHY_CHARS: Final = 512


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything an engine is configured with; shared by [`Server`][tensorrpc.Server]
    and [`serve`][tensorrpc.serve]. Exactly one of ``connect`` and ``bind`` is given.

    Example:
        ``Server(Calculator(), ServerConfig(bind="tcp://127.0.0.1:0"), max_queued=16)``:
        keyword options override the config's fields.
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
    #: An ``Observer`` (or several) told about every call this engine runs (see
    #: docs/observability.md).
    observer: Observer | Sequence[Observer] | None = None
    #: Export Prometheus metrics of this engine (the default registry) over HTTP on this
    #: port (needs the ``metrics`` extra; 0 picks a free port).
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if (self.bind is None) == (not self.connect):
            raise ValueError("give exactly one of connect= (dial in) and bind= (listen)")
        if self.max_concurrency < 1 or self.max_queued < 0 or self.sync_workers < 1:
            raise ValueError("max_concurrency and sync_workers must be >= 1, max_queued >= 0")
        check_heartbeat(self.heartbeat_interval, self.dead_after)
        if self.grace_period < 0:
            raise ValueError("grace_period must not be negative")
        if self.max_strangers < 1 or self.max_parked_streams < 1:
            raise ValueError("max_strangers and max_parked_streams must be >= 1")
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
    observer: Observer | Sequence[Observer] | None
    metrics_port: int | None


_CONFIG_FIELDS: Final = frozenset(f.name for f in fields(ServerConfig))


def _config(config: ServerConfig | None, options: dict[str, object]) -> ServerConfig:
    unknown = set(options) - _CONFIG_FIELDS
    if unknown:
        raise TypeError(f"unknown server option(s): {', '.join(sorted(unknown))}")
    if config is None:
        return ServerConfig(**options)  # type: ignore[arg-type]
    return replace(config, **options)  # type: ignore[arg-type]


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
        config: The engine's configuration (see [`ServerConfig`][tensorrpc.ServerConfig]
            for every option); None: the defaults.
        **options: Fields of ``ServerConfig`` to set or override (``bind=``,
            ``connect=``, ``max_concurrency=`` ...).

    Raises:
        ValueError: Bad options (both or neither of connect/bind, bad numbers).
        TypeError: An unknown option.
        ServiceDefinitionError: ``instance`` is not an instance of a ``@service`` class.
    """

    def __init__(
        self,
        instance: object,
        config: ServerConfig | None = None,
        /,
        **options: Unpack[ServerOptions],
    ) -> None:
        self._config = cfg = _config(config, dict(options))
        self._spec: ServiceSpec = describe(instance)
        engine_id = cfg.engine_id or f"{_socket.gethostname()}-{os.getpid()}"
        if "/" in engine_id or len(engine_id.encode()) > 200 or CONTROL.search(engine_id):
            raise ValueError(
                "engine_id must be 1..200 bytes of UTF-8 without '/' or control characters"
            )
        self._engine_id = engine_id
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
        self._proto = ServerProtocol(self._settings(instance))
        self._io = ServerSockets(
            self._proto,
            engine_id=engine_id,
            routing_id=f"{engine_id}/{secrets.token_hex(6)}".encode(),
            binds=self._binds,
            addresses=self._addresses,
            options=self._socket_options,
            curve=cfg.curve,
            reply_patience=cfg.dead_after,
        )
        self._dispatch = Dispatcher(
            self._proto,
            engine_id=engine_id,
            max_concurrency=cfg.max_concurrency,
            sync_workers=cfg.sync_workers,
            codec=self._codec,
            policy=self._policy,
            maxmsgsize=self._socket_options.maxmsgsize,
            grace_period=cfg.grace_period,
            flush=self._flush,
            send_reply=self._io.send_reply,
        )
        self._started = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._stopped: anyio.Event | None = None
        self._poke: anyio.Event | None = None
        self._outer_tg: anyio.abc.TaskGroup | None = None
        self._inner_scope: anyio.CancelScope | None = None
        self._observer = _observe.resolve(cfg.observer, cfg.metrics_port)
        self._said = Said()  # refusals already logged at WARNING
        # Per-method counters for the built-in statistics method, from its first use on.
        self._recorder: _observe.StatisticsRecorder | None = None
        self._started_at = time.time()

    def _settings(self, instance: object) -> ProtocolSettings:
        cfg = self._config
        spec = self._spec
        hello = Hello(
            engine_id=self._engine_id,
            service=spec.name,
            fingerprint=spec.fingerprint,
            protocol_version=PROTOCOL_VERSION,
            host_id=_host_id(),
            pid=os.getpid(),
            transports=self._policy.offered(),
            concurrency=cfg.max_concurrency,
            heartbeat_ms=to_ms(cfg.heartbeat_interval),
            methods=tuple(spec.methods),
            streaming=tuple(m.name for m in spec.methods.values() if m.streaming),
            signatures=tuple(_hello_signature(m) for m in spec.methods.values()),
            max_message_bytes=max(0, self._socket_options.maxmsgsize),
        )
        return ProtocolSettings(
            hello=hello,
            methods={
                name: (m, self._batches.entry(name, getattr(instance, name)))
                for name, m in spec.methods.items()
            },
            listen=self._listen,
            max_concurrency=cfg.max_concurrency,
            max_queued=cfg.max_queued,
            heartbeat_interval=cfg.heartbeat_interval,
            dead_after=cfg.dead_after,
            max_strangers=cfg.max_strangers,
            max_parked_streams=cfg.max_parked_streams,
            max_buffers=self._codec.max_tensors,
            builtins=frozenset({_observe.STATISTICS_METHOD}),
        )

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
        endpoints = self._io.endpoints
        return endpoints[0] if endpoints else None

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Listen mode: every bound endpoint, in the order of ``bind``."""
        return tuple(self._io.endpoints)

    @property
    def addresses(self) -> tuple[str, ...]:
        """Dial-in mode: the client addresses this engine connects to."""
        return self._addresses

    def statistics(self) -> ServerStatistics:
        """Return a snapshot of the engine's counters, with one entry per known client."""
        proto = self._proto
        return ServerStatistics(
            engine_id=self._engine_id,
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
            transports=self._policy.statistics(),
            strangers_evicted=proto.strangers_evicted,
            batching=self._batches.statistics(),
        )

    def batch_statistics(self) -> Mapping[str, dict[str, Any]]:
        """Per batched method (``@rpc(batch=...)``): ``batches``, ``items``, ``queued``,
        ``running`` and the histograms of `ServerStatistics.batching`."""
        return self._batches.statistics()

    async def __aenter__(self) -> Self:
        if self._started:
            raise RuntimeError("a Server can be entered only once")
        self._started = True
        self._stopped = anyio.Event()
        self._poke = anyio.Event()
        if self._observer is not None:  # observe: the engine opened
            # Before binding: a metrics_port in use fails before any socket is bound.
            try:
                self._observer.opened(self)
            except BaseException:
                self._observer.closed(self)
                raise
        try:
            self._io.open()
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
            self._io.close()
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
                self._io.close()
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
                self._dispatch.start(tg)
                self._batches.start(tg)
                self._io.start(tg, self._accepted, self._flush)
                tg.start_soon(self._housekeeping)
                task_status.started()

    async def _drain(self) -> None:
        cfg = self._config
        proto = self._proto
        proto.start_drain()
        self._dispatch.close()  # workers finish what is queued, then exit
        done = self._dispatch.done
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

    # -- receiving --------------------------------------------------------------------------

    def _accepted(self, call: Call, size: int) -> None:
        self._dispatch.wake_one()
        proto = self._proto
        if call.deadline < proto.wake_at:  # the timer that refuses it if it waits too long
            proto.wake_at = call.deadline
            self._wake_housekeeping()
        if self._observer is not None:  # observe: a CALL was accepted
            call.observed = self._observer.engine_call(
                call.spec.name, self._engine_id, call.session.name, call.spec.streaming,
                call.trace, size,
            )  # fmt: skip

    def _answer_statistics(self, event: BuiltinCall) -> None:
        """Answer the built-in statistics method (``tensorrpc top``): a RESULT map."""
        if not _observe.statistics_allowed(self._config.curve):
            self._proto.builtin_refused(event, _STATISTICS_REFUSED)
            return
        if self._recorder is None:
            self._recorder = _observe.StatisticsRecorder()
            self._observer = _observe.combine(self._observer, self._recorder)
        body = _observe.statistics_body(
            self.statistics(),
            service=self._spec.name,
            pid=os.getpid(),
            started=self._started_at,
            recorder=self._recorder,
        )
        self._proto.builtin_reply(event, _codec.encode(body, self._codec).payload)

    def _flush(self) -> None:
        """Do what the protocol handed out: send its frames, then act on its events (wake
        or stop calls, session news); until it has nothing more."""
        proto = self._proto
        send_now = self._io.send_now
        while proto.pending:
            for key, frames in proto.frames_to_send():
                if not send_now(key, frames):
                    # Counted as dropped; a dial-in HELLO is retried soon.
                    proto.send_failed(key, frames, time.monotonic())
                    self._wake_housekeeping()
            for event in proto.next_events():
                if isinstance(event, ServerCall):
                    event.wake()
                else:
                    self._on_event(event)

    def _on_event(self, event: object) -> None:
        if isinstance(event, BuiltinCall):
            self._answer_statistics(event)
        elif isinstance(event, Released):
            self._policy.release(event.leases, event.session)
        elif isinstance(event, SessionStarted):
            self._negotiate_shm(event.session, event.welcome, event.frame)
            logger.info(
                "engine %r joined client %s", self._engine_id, peer_text(event.session.name)
            )
            self._wake_housekeeping()  # its PING interval may be shorter than ours
        elif isinstance(event, SessionEnded):
            shm = event.shm
            self._policy.peer_gone(event.session, shm.pid if shm is not None else 0)
            log = logger.warning if event.warn else logger.info
            if event.why.startswith("refused") and not self._said.first(
                (event.session.name, event.why)
            ):
                log = logger.debug  # the same refusal again (a HELLO retried every second)
            log("client %s %s", peer_text(event.session.name), peer_text(event.why, _WHY_CHARS))
        elif isinstance(event, CallExpired):
            observed = event.call.observed
            if observed is not None:  # observe: answered DEADLINE_EXCEEDED from the queue
                observed.error(ErrorCode.DEADLINE_EXCEEDED.name)
                observed.finished("ok", 0)
        elif isinstance(event, AllRejected):
            self._fail(
                HandshakeRejectedError(
                    f"every client refused engine {self._engine_id!r}: "
                    + peer_text(event.message, _WHY_CHARS),
                    reason=event.reason,
                    engine_id=self._engine_id,
                )
            )

    def _negotiate_shm(self, session: Session, welcome: Welcome, frame: object) -> None:
        # torch_shm only with the process the kernel says is at the other end of the
        # connection the WELCOME came on (docs/security.md); its claims are hints.
        pid, send, receive = self._policy.attest(
            session,
            peer_credentials(frame),
            offers=welcome.transports,
            claimed_pid=welcome.pid,
            same_host=welcome.host_id == _host_id(),
        )
        self._proto.shm_decided(session, ShmPeer(pid=pid, peer_receives=send, we_receive=receive))

    def _fail(self, error: BaseException) -> None:
        """Stop serving because of ``error`` (raised by serve_forever)."""
        if self._fatal is None:
            self._fatal = error
        if self._stopped is not None:
            self._stopped.set()

    # -- housekeeping -----------------------------------------------------------------------

    def _wake_housekeeping(self) -> None:
        if self._poke is not None:
            self._poke.set()

    async def _housekeeping(self) -> None:
        interval = self._config.heartbeat_interval
        next_sweep = time.monotonic() + interval
        while True:
            now = time.monotonic()
            self._proto.tick(now)
            self._flush()
            sweep = now >= next_sweep
            if sweep:
                next_sweep = now + interval
                self._policy.sweep()
            self._io.housekeeping(sweep)  # logs failed CURVE handshakes at WARNING
            wait = max(0.005, min(self._proto.wake_at, next_sweep) - time.monotonic())
            self._poke = poke = anyio.Event()
            with anyio.move_on_after(wait):
                await poke.wait()


async def serve(
    instance: object,
    config: ServerConfig | None = None,
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
    async with Server(instance, config, **options) as server:
        task_status.started(server)
        await server.serve_forever()
