"""The engine side: ``serve()`` / :class:`Server` run a service instance behind ZMQ.

Shape of the I/O shell:

* **Dial-in** (``connect=``): one DEALER per client address, routing id
  ``engine_id + "/" + nonce`` (unique per incarnation). The engine speaks first: it sends
  HELLO, and re-sends it (backing off up to ``heartbeat_interval``) until the client
  answers WELCOME or REJECT. The DEALER has ``ZMQ_IMMEDIATE`` set, so a HELLO is only
  queued on a live connection and HELLOs do not pile up while the client is down.
* **Listen** (``bind=``): one ROUTER; a client sends PING first and an unknown peer (or a
  PING with nonce 0, the "hello request") is answered with HELLO. Per-client state is
  keyed by the client's routing id.
* One receive loop per socket parses headers (cheap) and hands CALLs to a bounded queue;
  control messages (CANCEL, CREDIT, PING, WELCOME, REJECT, BYE) are handled right there.
* ``max_concurrency`` worker tasks take calls from the queue, decode them (codec and
  ``decode_args``), run the handler in a per-call cancel scope (sync handlers in worker
  threads through a :class:`anyio.CapacityLimiter`) and send the reply. A fixed pool was
  measured faster than a task per call (see docs/internals.md, ``_server.py``).
* One housekeeping task re-sends HELLOs, sends PINGs, forgets silent clients and
  releases the memory of tensors ZMQ has finished sending. A client counts as silent when
  it sent nothing but PINGs for ``dead_after`` (it must answer our PINGs): a client that
  forgot us keeps pinging our address, and this is how we notice and say HELLO again.

Rules this module keeps:

1. Every socket operation happens on the event-loop thread; a receive loop never waits
   on a send (it sends with ``send_nowait`` and drops the message when ZMQ is full).
2. A call is in its client's call table from the moment it is queued until its worker is
   done with it; CANCEL, a deadline, the client's death and shutdown all act through the
   call's ``cancelled``/``shutdown`` flags and its cancel scope.
3. A call gets at most one final reply (RESULT, STREAM_END or ERROR), and none once the
   client cancelled it or is gone.
4. The memory of every zero-copy send is held (:class:`~tensorrpc._zmq.PendingSends`)
   until ZMQ's tracker says it is done.
5. Shutdown drains: new CALLs get DRAINING, running calls get ``grace_period`` to finish,
   then are cancelled (and get an ERROR), BYE goes to every client, sockets close.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket as _socket
import time
import traceback
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import anyio.lowlevel
import anyio.to_thread
import zmq

from tensorrpc import _codec, _observe
from tensorrpc._exceptions import (
    ClosedError,
    DecodeError,
    EncodeError,
    ErrorCode,
    HandshakeRejectedError,
    PeerUnreachableError,
    RemoteProtocolError,
    TensorTransportError,
    TransportError,
    ValidationError,
)
from tensorrpc._hostinfo import host_id as _host_id
from tensorrpc._protocol import (
    MAX_SIGNATURE_CHARS,
    PROTOCOL_VERSION,
    Bye,
    Credit,
    ErrorInfo,
    Flags,
    Hello,
    MessageKind,
    Reject,
    Release,
    Welcome,
    decode_control,
    encode_control,
    encode_error,
    pack_reply_header,
    split_frames,
    unpack_header,
)
from tensorrpc._service import describe
from tensorrpc._zmq import DEFAULT_OPTIONS, AsyncSocket, PendingSends, SocketOptions, create_socket
from tensorrpc.transports._policy import (
    DEFAULT_SHM_THRESHOLD,
    PolicyPlacer,
    TransportPolicy,
    TransportStatistics,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable, Sequence
    from types import TracebackType
    from typing import Self

    from anyio.abc import TaskGroup, TaskStatus
    from typing_extensions import Buffer

    from tensorrpc._observe import CallObservation, Observer
    from tensorrpc._security import CurveConfig
    from tensorrpc._service import MethodSpec, ServiceSpec
    from tensorrpc.transports.torch_shm import ShmResolver

__all__ = ["PeerStatistics", "Server", "ServerStatistics", "serve"]

logger = logging.getLogger("tensorrpc.server")

_CALL: Final = MessageKind.CALL
_CANCEL: Final = MessageKind.CANCEL
_CREDIT: Final = MessageKind.CREDIT
_PING: Final = MessageKind.PING
_PONG: Final = MessageKind.PONG
_WELCOME: Final = MessageKind.WELCOME
_REJECT: Final = MessageKind.REJECT
_BYE: Final = MessageKind.BYE
_RESULT: Final = MessageKind.RESULT
_STREAM_ITEM: Final = MessageKind.STREAM_ITEM
_STREAM: Final = int(Flags.STREAM)
_NO_WAIT: Final = int(Flags.NO_WAIT)
_SHM_RESULTS: Final = int(Flags.SHM_RESULTS)
_SHM_RESULTS_ALL: Final = int(Flags.SHM_RESULTS_ALL)
_RELEASE: Final = MessageKind.RELEASE
_NO_TRANSPORT_STATISTICS: Final = TransportStatistics()

# First HELLO re-send delay in dial-in mode; doubles up to heartbeat_interval.
_HELLO_RETRY_MIN_S: Final = 0.05
# How long the sockets may keep flushing the last replies and BYEs after close.
_CLOSE_LINGER_MS: Final = 1000
# How long a cancelled async generator may take to run its ``finally`` blocks.
_ACLOSE_TIMEOUT_S: Final = 1.0
_MISSING: Final = object()
# A worker yields to the event loop after this many calls in a row without waiting.
_FAIRNESS_STREAK: Final = 32


class _ConnState(Enum):
    HELLO = "hello"  # HELLO sent (dial-in) or owed (listen); no WELCOME yet
    LIVE = "live"  # WELCOME received
    REJECTED = "rejected"  # the client refused us; we stopped trying


class _Conn:
    """One client as the engine sees it (a DEALER in dial-in mode, a routing id in listen)."""

    __slots__ = (
        "address",
        "bytes_in",
        "bytes_out",
        "calls",
        "calls_total",
        "client_id",
        "errors",
        "hello_delay",
        "last_seen",
        "max_message_bytes",
        "next_hello",
        "prefix",
        "reject",
        "route",
        "shm",
        "sock",
        "state",
        "stream_window",
    )

    def __init__(self, sock: AsyncSocket, route: bytes | None, address: str | None) -> None:
        self.sock = sock
        #: The client's routing id on our ROUTER (listen mode), None on a DEALER.
        self.route = route
        #: Frames to put before every message (the routing id on a ROUTER).
        self.prefix: list[Buffer] = [] if route is None else [route]
        #: The endpoint we dial (dial-in mode).
        self.address = address
        self.state = _ConnState.HELLO
        self.client_id = ""
        self.stream_window = 16
        #: The largest frame the client accepts (from WELCOME; 0: no limit announced).
        self.max_message_bytes = 0
        self.last_seen = time.monotonic()
        self.calls: dict[int, _Call] = {}
        self.calls_total = 0
        self.errors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.hello_delay = _HELLO_RETRY_MIN_S
        self.next_hello = 0.0
        self.reject: Reject | None = None
        #: torch_shm with this client: (its pid, it attaches to our handles, we to its).
        self.shm: tuple[int, bool, bool] | None = None

    @property
    def name(self) -> str:
        if self.client_id:
            return self.client_id
        if self.address is not None:
            return self.address
        return repr(self.route)


class _Call:
    """One accepted call, from the receive loop through its worker."""

    __slots__ = (
        "buffers",
        "call_id",
        "cancelled",
        "conn",
        "credit_event",
        "credits",
        "deadline",
        "failure",
        "fn",
        "observed",
        "payload",
        "result",
        "results",
        "scope",
        "shutdown",
        "spec",
    )

    def __init__(
        self,
        conn: _Conn,
        call_id: int,
        spec: MethodSpec,
        fn: Callable[..., Any],
        deadline: float,
        payload: Buffer,
        buffers: Sequence[Buffer],
    ) -> None:
        self.conn = conn
        self.call_id = call_id
        self.spec = spec
        self.fn = fn
        #: ``anyio.current_time()`` deadline, ``inf`` for none.
        self.deadline = deadline
        self.payload: Buffer | None = payload
        self.buffers: Sequence[Buffer] = buffers
        self.scope: anyio.CancelScope | None = None
        #: The client cancelled the call, or is gone: no reply.
        self.cancelled = False
        #: Shutdown cancelled the call: reply DRAINING.
        self.shutdown = False
        #: Stream items the engine may still send before it needs CREDIT.
        self.credits = conn.stream_window
        self.credit_event: anyio.Event | None = None
        #: Unary calls: the handler's return value (``_MISSING`` until it returns).
        self.result: object = _MISSING
        #: Unary calls: the exception the handler raised.
        self.failure: BaseException | None = None
        #: The CALL's SHM_RESULTS / SHM_RESULTS_ALL flag bits (how to send result tensors).
        self.results = 0
        #: What the engine's observer watches of this call (None: no observer).
        self.observed: CallObservation | None = None

    def stop(self) -> None:
        scope = self.scope
        if scope is not None:
            scope.cancel()
        event = self.credit_event
        if event is not None:
            event.set()


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    """What one client did on this engine."""

    #: The client's id (from its WELCOME), or its address / routing id before that.
    client_id: str
    #: ``"hello"``, ``"live"`` or ``"rejected"``.
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
    """A snapshot of an engine's counters (see :meth:`Server.statistics`)."""

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


def _hello_signature(spec: MethodSpec) -> str:
    # HELLO caps each signature; a huge dataclass description is cut, never refused.
    text = spec.signature
    if len(text) <= MAX_SIGNATURE_CHARS:
        return text
    return text[: MAX_SIGNATURE_CHARS - 5] + " ..."


def _addresses_of(connect: str | Sequence[str] | None) -> tuple[str, ...]:
    if connect is None:
        return ()
    if isinstance(connect, str):
        return (connect,)
    return tuple(connect)


def _gone(call: _Call) -> bool:
    # A function, not an attribute test, so that mypy does not keep a narrowing of
    # ``call.cancelled`` from before an await (other tasks set it meanwhile).
    return call.cancelled


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


class Server:
    """An engine: serves one ``@service`` instance to one or more clients.

    Use it as an async context manager: entering binds/connects the sockets and starts
    serving; leaving drains (see :meth:`aclose`)::

        async with Server(Calculator(), bind="tcp://127.0.0.1:0") as server:
            print(server.endpoint)
            await server.serve_forever()

    Exactly one of ``connect`` and ``bind`` is given.

    Args:
        instance: An instance of a ``@service`` class.
        connect: Dial-in mode: the address (or addresses) of the clients' bound ROUTERs.
        bind: Listen mode: the address to bind a ROUTER to (``tcp://127.0.0.1:0`` picks a
            free port, see :attr:`endpoint`).
        engine_id: This engine's id, unique among a client's engines (default
            ``hostname-pid``).
        max_concurrency: Calls handled at once (worker tasks); also sent in HELLO.
        max_queued: Calls accepted beyond those running; more are refused with
            OVERLOADED. Calls flagged NO_WAIT are refused as soon as they would queue.
        sync_workers: Threads running sync handlers at once.
        grace_period: Seconds running calls may take to finish at shutdown.
        heartbeat_interval: Seconds between PINGs to each client.
        dead_after: A client silent for this long is forgotten and its calls cancelled.
        codec: Codec limits (must match the clients').
        socket_options: ZMQ socket options (HWMs, MAXMSGSIZE, ...). ``maxmsgsize`` is
            the largest frame this engine accepts (a peer sending more is disconnected
            by ZMQ) and sends (a bigger result is answered with a BAD_RESULT error); it
            is lowered to the largest frame ``codec`` accepts (the larger of
            ``max_tensor_bytes`` and ``max_payload_bytes``), and announced in HELLO.
        curve: CURVE encryption and authentication for the engine's sockets (see
            docs/security.md): usually a ``CurveServerConfig`` with an allow-list of
            client keys in listen mode, a ``CurveClientConfig`` holding the client's
            public key in dial-in mode. None: plaintext.
        torch_shm: Offer and use the ``torch_shm`` tensor transport with clients on this
            host (Linux; checked at handshake). ``False``: frames only.
        shm_threshold: For calls whose transport is ``auto``, CPU result tensors of at
            least this many bytes go by ``torch_shm``.
        observer: An [`Observer`][tensorrpc.Observer] (or several) told about every call
            this engine runs (see docs/observability.md).
        metrics_port: Export Prometheus metrics of this engine (the default registry) over
            HTTP on this port (needs the ``metrics`` extra; 0 picks a free port).

    Raises:
        ValueError: Bad arguments (both or neither of connect/bind, bad numbers).
        ServiceDefinitionError: ``instance`` is not an instance of a ``@service`` class.
    """

    def __init__(
        self,
        instance: object,
        *,
        connect: str | Sequence[str] | None = None,
        bind: str | None = None,
        engine_id: str | None = None,
        max_concurrency: int = 64,
        max_queued: int = 256,
        sync_workers: int = 8,
        grace_period: float = 5.0,
        heartbeat_interval: float = 1.0,
        dead_after: float = 5.0,
        codec: _codec.CodecConfig = _codec.DEFAULT,
        socket_options: SocketOptions = DEFAULT_OPTIONS,
        curve: CurveConfig | None = None,
        torch_shm: bool = True,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        observer: Observer | Sequence[Observer] | None = None,
        metrics_port: int | None = None,
    ) -> None:
        addresses = _addresses_of(connect)
        if (bind is None) == (not addresses):
            raise ValueError("give exactly one of connect= (dial in) and bind= (listen)")
        if max_concurrency < 1 or max_queued < 0 or sync_workers < 1:
            raise ValueError("max_concurrency and sync_workers must be >= 1, max_queued >= 0")
        if not heartbeat_interval > 0 or not dead_after > heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < dead_after")
        if grace_period < 0:
            raise ValueError("grace_period must not be negative")
        self._spec: ServiceSpec = describe(instance)
        self._instance = instance
        self._methods: dict[str, tuple[MethodSpec, Callable[..., Any]]] = {
            name: (spec, getattr(instance, name)) for name, spec in self._spec.methods.items()
        }
        if engine_id is None:
            engine_id = f"{_socket.gethostname()}-{os.getpid()}"
        if not engine_id or "/" in engine_id or len(engine_id.encode()) > 200:
            raise ValueError("engine_id must be 1..200 bytes of UTF-8 without '/'")
        self._engine_id = engine_id
        self._routing_id = f"{engine_id}/{secrets.token_hex(6)}".encode()
        self._addresses = addresses
        self._bind = bind
        self._max_concurrency = max_concurrency
        self._max_queued = max_queued
        self._grace_period = grace_period
        self._heartbeat_interval = heartbeat_interval
        self._dead_after = dead_after
        self._codec = codec
        # A frame over the codec's limits would be buffered only to be refused: ZMQ drops
        # it at its header instead, and HELLO announces the limit (clients check it).
        socket_options = socket_options.capped(_codec.frame_limit(codec))
        self._socket_options = socket_options
        self._curve = curve
        self._policy = TransportPolicy(torch_shm=torch_shm, shm_threshold=shm_threshold)
        self._limiter = anyio.CapacityLimiter(sync_workers)
        self._hello_frames = encode_control(
            MessageKind.HELLO,
            Hello(
                engine_id=engine_id,
                service=self._spec.name,
                fingerprint=self._spec.fingerprint,
                protocol_version=PROTOCOL_VERSION,
                host_id=_host_id(),
                pid=os.getpid(),
                transports=self._policy.offered(),
                concurrency=max_concurrency,
                heartbeat_ms=max(1, round(heartbeat_interval * 1000)),
                methods=tuple(self._spec.methods),
                streaming=tuple(m.name for m in self._spec.methods.values() if m.streaming),
                signatures=tuple(_hello_signature(m) for m in self._spec.methods.values()),
                probe=self._policy.probe(),
                max_message_bytes=max(0, socket_options.maxmsgsize),
                features=_observe.FEATURES,
            ),
        )
        self._endpoint: str | None = None
        self._sockets: list[AsyncSocket] = []
        self._conns: list[_Conn] = []  # dial-in: one per address
        self._peers: dict[bytes, _Conn] = {}  # listen: by routing id
        self._pending = PendingSends()
        # Accepted calls waiting for a worker, and the parked (idle) workers' wake-ups.
        self._queue: deque[_Call] = deque()
        self._idle: list[anyio.Event] = []
        self._queue_closed = False
        self._busy = 0
        self._calls_total = 0
        self._errors_total = 0
        self._overloaded = 0
        self._dropped = 0
        self._ping_nonce = 0
        self._started = False
        self._draining = False
        self._hard_stop = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._stopped: anyio.Event | None = None
        self._outer_tg: TaskGroup | None = None
        self._inner_tg: TaskGroup | None = None
        self._inner_scope: anyio.CancelScope | None = None
        self._workers_done: anyio.Event | None = None
        self._workers_left = 0
        self._observer = _observe.resolve(observer, metrics_port)
        # Per-method counters for the built-in statistics method, from its first use on.
        self._recorder: _observe.StatisticsRecorder | None = None
        self._started_at = time.time()

    # -- public surface ---------------------------------------------------------------------

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
        """Listen mode: the bound endpoint (a ``tcp://...:0`` bind reads back its port)."""
        return self._endpoint

    @property
    def addresses(self) -> tuple[str, ...]:
        """Dial-in mode: the client addresses this engine connects to."""
        return self._addresses

    def statistics(self) -> ServerStatistics:
        """Return a snapshot of the engine's counters, with one entry per known client."""
        conns = self._conns if self._bind is None else list(self._peers.values())
        return ServerStatistics(
            engine_id=self._engine_id,
            calls=self._calls_total,
            errors=self._errors_total,
            in_flight=self._busy + len(self._queue),
            queued=len(self._queue),
            overloaded=self._overloaded,
            dropped=self._dropped,
            clients=tuple(
                PeerStatistics(
                    client_id=c.name,
                    state=c.state.value,
                    calls=c.calls_total,
                    errors=c.errors,
                    in_flight=len(c.calls),
                    bytes_in=c.bytes_in,
                    bytes_out=c.bytes_out,
                )
                for c in conns
            ),
            transports=self._policy.statistics(),
        )

    async def __aenter__(self) -> Self:
        if self._started:
            raise RuntimeError("a Server can be entered only once")
        self._started = True
        self._stopped = anyio.Event()
        self._workers_done = anyio.Event()
        self._open_sockets()
        if self._observer is not None:  # observe: the engine opened
            self._observer.opened(self)
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

    def _open_sockets(self) -> None:
        try:
            if self._bind is not None:
                sock = create_socket(zmq.ROUTER, options=self._socket_options, curve=self._curve)
                self._sockets.append(sock)
                self._endpoint = sock.bind(self._bind)
                logger.info("engine %r listening on %s", self._engine_id, self._endpoint)
            else:
                for address in self._addresses:
                    sock = create_socket(
                        zmq.DEALER,
                        options=self._socket_options,
                        routing_id=self._routing_id,
                        curve=self._curve,
                    )
                    self._sockets.append(sock)
                    # Only queue on a live connection: no HELLOs piling up while the
                    # client is down, and sends to a vanished client fail fast.
                    sock.socket.setsockopt(zmq.IMMEDIATE, 1)
                    sock.connect(address)
                    self._conns.append(_Conn(sock, None, address))
                logger.info("engine %r dialing %s", self._engine_id, ", ".join(self._addresses))
        except BaseException:
            self._close_sockets()
            raise

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            if not sock.closed:
                with contextlib.suppress(zmq.ZMQError):
                    sock.socket.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
                sock.close()
        self._pending.clear()

    async def _host(self, *, task_status: TaskStatus[None]) -> None:
        # The tasks live in a shielded scope: cancelling the code that entered the Server
        # must not cancel running handlers before the drain has given them their grace.
        with anyio.CancelScope(shield=True) as scope:
            self._inner_scope = scope
            async with anyio.create_task_group() as tg:
                self._inner_tg = tg
                self._workers_left = self._max_concurrency
                for _ in range(self._max_concurrency):
                    tg.start_soon(self._worker)
                if self._bind is not None:
                    tg.start_soon(self._router_loop, self._sockets[0])
                else:
                    for conn in self._conns:
                        tg.start_soon(self._dealer_loop, conn)
                tg.start_soon(self._housekeeping)
                task_status.started()

    async def _drain(self) -> None:
        self._draining = True
        self._queue_closed = True  # workers finish what is queued, then exit
        self._wake_idle()
        assert self._workers_done is not None
        if self._fatal is None:
            with anyio.move_on_after(self._grace_period):
                await self._workers_done.wait()
        if not self._workers_done.is_set():
            self._hard_stop = True
            for conn in self._all_conns():
                for call in list(conn.calls.values()):
                    call.shutdown = True
                    call.stop()
            with anyio.move_on_after(self._dead_after + 1.0):
                await self._workers_done.wait()
        # Also to clients whose WELCOME may still be on its way.
        bye = encode_control(_BYE, Bye("shutdown"))
        for conn in self._all_conns():
            if conn.state is not _ConnState.REJECTED:
                self._send_now(conn, bye, count=False)
        logger.info("engine %r stopped", self._engine_id)

    def _all_conns(self) -> list[_Conn]:
        return self._conns if self._bind is None else list(self._peers.values())

    def _fail(self, error: BaseException) -> None:
        """Stop serving because of ``error`` (raised by serve_forever)."""
        if self._fatal is None:
            self._fatal = error
        if self._stopped is not None:
            self._stopped.set()

    # -- sending ----------------------------------------------------------------------------

    def _send_now(self, conn: _Conn, frames: list[bytes], *, count: bool = True) -> bool:
        """Send a small message without waiting; drop it (and count) if ZMQ is full."""
        try:
            conn.sock.send_nowait([*conn.prefix, *frames])
        except (anyio.WouldBlock, PeerUnreachableError, ClosedError) as exc:
            self._dropped += count
            logger.debug("dropped a message to %s: %r", conn.name, exc)
            return False
        except TransportError as exc:
            self._dropped += 1
            logger.warning("cannot send to %s: %s", conn.name, exc)
            return False
        conn.bytes_out += sum(len(f) for f in frames)
        return True

    def _send_hello(self, conn: _Conn) -> bool:
        # Dial-in: fails (uncounted) until ZMQ has connected; the next retry sends it.
        return self._send_now(conn, self._hello_frames, count=False)

    def _send_error(
        self,
        conn: _Conn,
        call_id: int,
        code: ErrorCode,
        message: str,
        type_name: str = "",
        tb: str = "",
    ) -> None:
        conn.errors += 1
        self._errors_total += 1
        self._send_now(conn, encode_error(call_id, ErrorInfo(int(code), type_name, message, tb)))
        if self._observer is not None:  # observe: an ERROR reply to an observed call
            call = conn.calls.get(call_id)
            if call is not None and call.observed is not None:
                call.observed.error(code.name)

    async def _send_reply(
        self, call: _Call, frames: list[Buffer], keepalive: list[object] | None
    ) -> None:
        """Send a (possibly large, zero-copy) reply from a worker, waiting a bounded time.

        The wait (ZMQ full, or a DEALER whose client is not connected) ends after
        ``dead_after``, or when the call is cancelled (CANCEL, its client is forgotten).
        """
        conn = call.conn
        parts = [*conn.prefix, *frames]
        track = keepalive is not None
        sock = conn.sock
        try:
            try:
                tracker = sock.send_nowait(parts, track=track)
            except anyio.WouldBlock:
                if _gone(call):
                    raise
                with anyio.move_on_after(self._dead_after) as scope:
                    borrowed = call.scope is None  # unary: no scope of its own any more
                    if borrowed:
                        call.scope = scope
                    try:
                        tracker = await sock.send(parts, track=track)
                    finally:
                        if borrowed:
                            call.scope = None
                if scope.cancelled_caught:
                    raise
        except (anyio.WouldBlock, PeerUnreachableError, ClosedError) as exc:
            self._dropped += 1
            logger.debug("dropped a reply to %s: %r", conn.name, exc)
            return
        except TransportError as exc:
            self._dropped += 1
            logger.warning("cannot send a reply to %s: %s", conn.name, exc)
            return
        if keepalive is not None:
            self._pending.add(tracker, keepalive)
        size = 0
        for frame in frames:
            size += memoryview(frame).nbytes
        conn.bytes_out += size

    # -- receiving --------------------------------------------------------------------------

    async def _dealer_loop(self, conn: _Conn) -> None:
        recv = conn.sock.recv
        on_message = self._on_message
        while True:
            try:
                frames = await recv()
            except ClosedError:
                return
            try:
                on_message(conn, frames)
            except Exception:  # one bad message must never stop the loop
                self._dropped += 1
                logger.exception("error handling a message from %s", conn.name)

    async def _router_loop(self, sock: AsyncSocket) -> None:
        recv = sock.recv
        on_message = self._on_message
        peers = self._peers
        while True:
            try:
                frames = await recv()
            except ClosedError:
                return
            try:
                route = frames[0].bytes
                conn = peers.get(route)
                if conn is None:
                    conn = self._on_stranger(sock, route, frames)
                    if conn is None:
                        continue
                on_message(conn, frames[1:])
            except Exception:  # one bad message must never stop the loop
                self._dropped += 1
                logger.exception("error handling a message")

    def _on_stranger(
        self, sock: AsyncSocket, route: bytes, frames: list[zmq.Frame]
    ) -> _Conn | None:
        """Listen mode: a message from a routing id we do not know yet."""
        try:
            header = unpack_header(cast("Buffer", frames[1])) if len(frames) > 1 else None
        except RemoteProtocolError:
            header = None
        if header is not None and header.kind is _PING and len(frames) == 3:
            if self._draining:
                return None
            conn = _Conn(sock, route, None)
            self._peers[route] = conn
            return conn  # _on_message answers the PING with HELLO
        self._dropped += 1
        if header is not None and header.kind is _CALL:
            stranger = _Conn(sock, route, None)
            self._send_error(
                stranger, header.call_id, ErrorCode.PROTOCOL, "no handshake: send PING first"
            )
        return None

    def _on_message(self, conn: _Conn, frames: list[zmq.Frame]) -> None:
        try:
            header, payload, buffers = split_frames(
                cast("list[Buffer]", frames), max_buffers=self._codec.max_tensors
            )
        except RemoteProtocolError as exc:
            self._on_garbage(conn, frames, exc)
            return
        size = 0
        for frame in frames:
            size += len(frame)
        conn.bytes_in += size
        kind = header.kind
        if kind is not _PING:
            # A client's own PINGs do not prove it still knows us: one that forgot us
            # (it declared us dead) keeps pinging our address but answers none of our
            # PINGs. Counting only its other messages (PONGs included) lets us forget it
            # after dead_after and say HELLO again.
            conn.last_seen = time.monotonic()
        if kind is _CALL:
            self._on_call(
                conn,
                header.call_id,
                header.method,
                header.flags,
                header.timeout_ms,
                payload,
                buffers,
                header.trace,
            )
        elif kind is _CREDIT:
            self._on_credit(conn, header.call_id, header, payload)
        elif kind is _CANCEL:
            call = conn.calls.get(header.call_id)
            if call is not None:
                call.cancelled = True
                call.stop()
        elif kind is _PING:
            if conn.route is not None and (
                header.call_id == 0 or conn.state is not _ConnState.LIVE
            ):
                self._send_hello(conn)  # listen mode: a hello request
            else:
                self._send_now(conn, encode_control(_PONG, None, header.call_id))
        elif kind is _PONG:
            pass
        elif kind is _WELCOME:
            self._on_welcome(conn, header, payload)
        elif kind is _REJECT:
            self._on_reject(conn, header, payload)
        elif kind is _BYE:
            logger.info("client %s said BYE", conn.name)
            self._forget(conn, "said BYE")
        elif kind is _RELEASE:
            self._on_release(conn, header, payload)
        else:
            self._dropped += 1
            logger.warning("dropped an unexpected %s from %s", kind.name, conn.name)

    def _on_garbage(self, conn: _Conn, frames: list[zmq.Frame], exc: RemoteProtocolError) -> None:
        self._dropped += 1
        logger.warning("dropped a malformed message from %s: %s", conn.name, exc)
        if not frames:
            return
        try:
            header = unpack_header(cast("Buffer", frames[0]))
        except RemoteProtocolError:
            return  # no usable call id
        if header.kind is _CALL and conn.state is _ConnState.LIVE:
            self._send_error(conn, header.call_id, ErrorCode.PROTOCOL, str(exc))

    def _on_call(
        self,
        conn: _Conn,
        call_id: int,
        method: str,
        flags: int,
        timeout_ms: int,
        payload: Buffer,
        buffers: Sequence[Buffer],
        trace: bytes = b"",
    ) -> None:
        if conn.state is not _ConnState.LIVE:
            self._send_error(conn, call_id, ErrorCode.PROTOCOL, "CALL before the handshake")
            return
        if self._draining:
            self._send_error(
                conn, call_id, ErrorCode.DRAINING, f"engine {self._engine_id!r} is shutting down"
            )
            return
        entry = self._methods.get(method)
        if entry is None and method == _observe.STATISTICS_METHOD:
            self._answer_statistics(conn, call_id)  # observe: the built-in statistics method
            return
        if entry is None:
            self._send_error(
                conn,
                call_id,
                ErrorCode.METHOD_NOT_FOUND,
                f"service {self._spec.name!r} has no method {method!r}",
            )
            return
        spec, fn = entry
        flags = int(flags)  # plain int arithmetic: IntFlag operators cost microseconds
        if bool(flags & _STREAM) != spec.streaming:
            what = "a stream" if spec.streaming else "a unary call"
            self._send_error(
                conn,
                call_id,
                ErrorCode.INVALID_ARGUMENT,
                f"{spec.qualname} must be called as {what}",
            )
            return
        if call_id in conn.calls:
            self._send_error(
                conn, call_id, ErrorCode.PROTOCOL, f"call id {call_id} is already in flight"
            )
            return
        queue = self._queue
        if flags & _NO_WAIT and self._busy + len(queue) >= self._max_concurrency:
            self._overloaded += 1
            self._send_error(
                conn,
                call_id,
                ErrorCode.OVERLOADED,
                f"engine {self._engine_id!r} is busy ({self._max_concurrency} calls running)",
            )
            return
        deadline = anyio.current_time() + timeout_ms / 1000 if timeout_ms else math.inf
        if len(queue) >= self._max_queued + len(self._idle):
            self._overloaded += 1
            self._send_error(
                conn,
                call_id,
                ErrorCode.OVERLOADED,
                f"engine {self._engine_id!r} is full ({self._max_concurrency} running, "
                f"{self._max_queued} queued)",
            )
            return
        call = _Call(conn, call_id, spec, fn, deadline, payload, buffers)
        call.results = flags & (_SHM_RESULTS | _SHM_RESULTS_ALL)
        queue.append(call)
        if self._idle:
            self._idle.pop().set()
        conn.calls[call_id] = call
        conn.calls_total += 1
        self._calls_total += 1
        if self._observer is not None:  # observe: a CALL was accepted
            call.observed = self._observer.engine_call(
                method, self._engine_id, conn.name, spec.streaming, trace,
                memoryview(payload).nbytes + sum(memoryview(b).nbytes for b in buffers),
            )  # fmt: skip

    def _on_credit(self, conn: _Conn, call_id: int, header: Any, payload: Buffer) -> None:
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            self._dropped += 1
            logger.warning("dropped a malformed CREDIT from %s: %s", conn.name, exc)
            return
        assert isinstance(body, Credit)
        call = conn.calls.get(call_id)
        if call is None:
            return  # the stream already ended
        call.credits += body.n
        event = call.credit_event
        if event is not None:
            call.credit_event = None
            event.set()

    def _on_release(self, conn: _Conn, header: Any, payload: Buffer) -> None:
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            self._dropped += 1
            logger.warning("dropped a malformed RELEASE from %s: %s", conn.name, exc)
            return
        assert isinstance(body, Release)
        self._policy.release(body.leases, conn)

    def _on_welcome(self, conn: _Conn, header: Any, payload: Buffer) -> None:
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            self._dropped += 1
            logger.warning("dropped a malformed WELCOME from %s: %s", conn.name, exc)
            return
        assert isinstance(body, Welcome)
        if conn.state is _ConnState.LIVE:
            return  # answer to a repeated HELLO
        if conn.state is _ConnState.REJECTED:
            return
        conn.state = _ConnState.LIVE
        conn.client_id = body.client_id
        conn.stream_window = max(1, body.stream_window)
        conn.max_message_bytes = body.max_message_bytes
        # The client lists torch_shm only if it opened our probe; we open its probe to know
        # whether we can attach to the arguments it sends by handle.
        host = _host_id()
        policy = self._policy
        conn.shm = (
            body.pid,
            bool(policy.probe()) and body.host_id == host and "torch_shm" in body.transports,
            policy.can_receive_from(
                our_host=host,
                peer_host=body.host_id,
                offered=body.transports,
                probe=body.probe,
                pid=body.pid,
            ),
        )
        logger.info("engine %r joined client %s", self._engine_id, conn.name)

    def _on_reject(self, conn: _Conn, header: Any, payload: Buffer) -> None:
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            body = Reject("other", f"malformed REJECT: {exc}")
        assert isinstance(body, Reject)
        logger.warning(
            "client %s refused engine %r: %s: %s",
            conn.name,
            self._engine_id,
            body.reason,
            body.message,
        )
        self._cancel_calls(conn)
        if conn.route is not None:
            self._peers.pop(conn.route, None)
            return
        conn.state = _ConnState.REJECTED
        conn.reject = body
        if all(c.state is _ConnState.REJECTED for c in self._conns):
            reasons = "; ".join(
                f"{c.address}: {c.reject.reason}: {c.reject.message}"
                for c in self._conns
                if c.reject is not None
            )
            self._fail(
                HandshakeRejectedError(
                    f"every client refused engine {self._engine_id!r}: {reasons}",
                    reason=body.reason,
                    engine_id=self._engine_id,
                )
            )

    def _cancel_calls(self, conn: _Conn) -> None:
        for call in conn.calls.values():
            call.cancelled = True
            call.stop()
        # The client is gone (or refused us): free what we shared with it.
        shm, conn.shm = conn.shm, None
        self._policy.peer_gone(conn, shm[0] if shm is not None else 0)

    def _forget(self, conn: _Conn, why: str) -> None:
        """The client is gone: cancel its calls; dial-in: say HELLO again until it is back."""
        self._cancel_calls(conn)
        if conn.route is not None:
            self._peers.pop(conn.route, None)
            return
        if conn.state is _ConnState.REJECTED:
            return
        conn.state = _ConnState.HELLO
        conn.client_id = ""
        conn.hello_delay = _HELLO_RETRY_MIN_S
        conn.next_hello = 0.0
        logger.info("client at %s %s; saying HELLO again", conn.address, why)

    # -- housekeeping -----------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        interval = self._heartbeat_interval
        next_ping = time.monotonic() + interval
        while True:
            now = time.monotonic()
            hello_wait = interval
            for conn in self._all_conns():
                if conn.state is _ConnState.LIVE:
                    if now - conn.last_seen > self._dead_after:
                        logger.warning(
                            "client %s silent for %.1f s: cancelling its %d calls",
                            conn.name,
                            now - conn.last_seen,
                            len(conn.calls),
                        )
                        self._forget(conn, "went silent")
                elif conn.state is _ConnState.HELLO:
                    if conn.route is not None:
                        if now - conn.last_seen > self._dead_after:
                            self._peers.pop(conn.route, None)  # never finished its handshake
                    elif not self._draining:
                        if now >= conn.next_hello:
                            if self._send_hello(conn):
                                # Connected: give the client time to answer.
                                conn.next_hello = now + interval
                            else:
                                # Not connected yet: retry soon, backing off.
                                conn.next_hello = now + conn.hello_delay
                                conn.hello_delay = min(conn.hello_delay * 2, interval)
                        hello_wait = min(hello_wait, conn.next_hello - now)
            if now >= next_ping:
                next_ping = now + interval
                self._policy.sweep()
                for conn in self._all_conns():
                    if conn.state is _ConnState.LIVE:
                        self._ping_nonce = self._ping_nonce % 0xFFFF_FFFF + 1
                        self._send_now(conn, encode_control(_PING, None, self._ping_nonce))
            self._pending.prune()
            await anyio.sleep(max(0.005, min(hello_wait, next_ping - now)))

    # -- workers ----------------------------------------------------------------------------

    def _wake_idle(self) -> None:
        idle, self._idle = self._idle, []
        for event in idle:
            event.set()

    async def _worker(self) -> None:
        # Workers take calls from a plain deque and park on an Event when it is empty: a
        # memory object stream costs several checkpoints per item, a task per call costs a
        # task creation per call (measured; see docs/internals.md). A worker runs its calls
        # inside one cancel scope, replaced only after a call got it cancelled (CANCEL,
        # deadline, shutdown): a new scope per call costs ~5 us on asyncio, more on trio.
        queue = self._queue
        streak = 0
        try:
            while True:
                stopped: _Call | None = None
                try:
                    with anyio.CancelScope() as scope:
                        while stopped is None:
                            if not queue:
                                if self._queue_closed:
                                    return
                                event = anyio.Event()
                                self._idle.append(event)
                                await event.wait()
                                streak = 0
                                continue
                            call = queue.popleft()
                            self._busy += 1
                            try:
                                await self._run(call, scope)
                            except Exception:
                                logger.exception("internal error running %s", call.spec.qualname)
                                self._reply_internal(call)
                            finally:
                                if scope.cancel_called:
                                    stopped = call  # answered below, outside the spent scope
                                else:
                                    self._release(call)
                            streak += 1
                            if streak >= _FAIRNESS_STREAK:
                                # Handlers that never wait would otherwise keep this worker
                                # from yielding while the queue stays full.
                                streak = 0
                                await anyio.lowlevel.checkpoint()
                    if stopped is not None:
                        await self._reply(stopped)
                finally:
                    if stopped is not None:
                        self._release(stopped)
        finally:
            self._workers_left -= 1
            if self._workers_left == 0 and self._workers_done is not None:
                self._workers_done.set()

    def _release(self, call: _Call) -> None:
        self._busy -= 1
        call.conn.calls.pop(call.call_id, None)
        if call.observed is not None:  # observe: the worker is done with the call
            call.observed.finished("cancelled" if call.cancelled else "ok", 0)

    def _answer_statistics(self, conn: _Conn, call_id: int) -> None:
        """Answer the built-in statistics method (``tensorrpc top``): a RESULT map."""
        if not _observe.statistics_allowed(self._curve):
            self._send_error(
                conn,
                call_id,
                ErrorCode.METHOD_NOT_FOUND,
                "statistics are only given to authenticated peers: this engine's CURVE "
                "socket accepts any client key (set allowed_clients)",
            )
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
        encoded = _codec.encode(body, self._codec)
        self._send_now(conn, [pack_reply_header(_RESULT, call_id), encoded.payload])

    def _reply_internal(self, call: _Call) -> None:
        if not call.cancelled:
            self._send_error(
                call.conn, call.call_id, ErrorCode.INTERNAL, "internal engine error (see its log)"
            )

    def _decode(self, call: _Call) -> list[Any] | None:
        """Decode and validate the arguments; on failure reply with an ERROR and return None."""
        conn = call.conn
        payload = call.payload
        assert payload is not None
        buffers = call.buffers
        call.payload = None
        call.buffers = ()
        self._policy.received_frames(buffers)
        try:
            wire = _codec.decode(payload, buffers, self._codec, resolver=self._resolver(conn))
            return call.spec.decode_args(wire)
        except ValidationError as exc:
            self._send_error(conn, call.call_id, ErrorCode.INVALID_ARGUMENT, str(exc))
        except DecodeError as exc:
            self._send_error(conn, call.call_id, ErrorCode.DECODE, str(exc))
        except TensorTransportError as exc:
            self._send_error(conn, call.call_id, ErrorCode.TENSOR_TRANSPORT, str(exc))
        return None

    def _encode(self, call: _Call, value: object) -> _codec.Encoded | None:
        """Check and encode a result or stream item; on failure reply ERROR, return None."""
        placer = self._placer(call)
        try:
            wire = call.spec.check_result(value)
            encoded = _codec.encode(wire, self._codec, placer=placer)
            self._check_sizes(call.conn, encoded)
            self._policy.sent_frames(encoded.buffers)
            return encoded
        except (ValidationError, EncodeError) as exc:
            if placer is not None:
                placer.abort()
            self._send_error(
                call.conn,
                call.call_id,
                ErrorCode.BAD_RESULT,
                f"{call.spec.qualname} returned a bad result: {exc}",
                _type_name(exc),
            )
        except TensorTransportError as exc:
            self._send_error(call.conn, call.call_id, ErrorCode.TENSOR_TRANSPORT, str(exc))
        return None

    def _check_sizes(self, conn: _Conn, encoded: _codec.Encoded) -> None:
        # A frame over the client's MAXMSGSIZE makes its ZMQ drop the whole connection
        # (and every call on it) without a word: refuse it here instead. The limit is the
        # smaller of ours and the one the client announced in its WELCOME.
        _codec.check_message_size(
            encoded,
            self._socket_options.maxmsgsize,
            conn.max_message_bytes,
            what="the results",
            peer=f"client {conn.name!r}",
        )

    def _placer(self, call: _Call) -> PolicyPlacer | None:
        # The CALL's flags say how the client wants result tensors; it only asks for
        # torch_shm when it can attach to ours, and conn.shm[1] says it told us so.
        results = call.results
        shm = call.conn.shm
        if not results or shm is None:
            return None
        mode = "torch_shm" if results & _SHM_RESULTS_ALL else "auto"
        return self._policy.placer(mode, call.conn, peer_receives=shm[1])

    def _resolver(self, conn: _Conn) -> ShmResolver | None:
        # Handles the client sent name its own process; a failure to attach is answered
        # with TENSOR_TRANSPORT before the handler runs, and the client resends as frames.
        shm = conn.shm
        if shm is None:
            return None
        return self._policy.resolver(shm[0])

    def _reply_stopped(self, call: _Call) -> None:
        """The call's scope was cancelled: say why, unless the client gave up on it."""
        if call.cancelled:
            return
        if call.shutdown:
            self._send_error(
                call.conn,
                call.call_id,
                ErrorCode.DRAINING,
                f"engine {self._engine_id!r} shut down before {call.spec.qualname} finished "
                f"(grace period {self._grace_period} s)",
            )
        else:
            self._send_error(
                call.conn,
                call.call_id,
                ErrorCode.DEADLINE_EXCEEDED,
                f"{call.spec.qualname} ran past its deadline and was cancelled",
            )

    async def _run(self, call: _Call, scope: anyio.CancelScope) -> None:
        """Run one call inside its worker's ``scope`` and reply.

        If ``scope`` gets cancelled for this call (CANCEL, deadline, shutdown), the outcome
        is left in ``call.result``/``call.failure`` and the worker replies once it has left
        the spent scope (see :meth:`_reply`).
        """
        if call.cancelled:
            return
        if self._hard_stop:
            call.shutdown = True
            self._reply_stopped(call)
            return
        deadline = call.deadline
        finite = deadline != math.inf
        if finite and anyio.current_time() >= deadline:
            self._send_error(
                call.conn,
                call.call_id,
                ErrorCode.DEADLINE_EXCEEDED,
                f"{call.spec.qualname} was already past its deadline when a worker took it",
            )
            return
        args = self._decode(call)
        if args is None:
            return
        if call.observed is not None:  # observe: the handler starts (in this task)
            call.observed.started()
        if call.spec.streaming:
            await self._run_stream(call, args)
            return
        call.scope = scope
        if finite:
            scope.deadline = deadline
        try:
            if call.spec.is_async:
                call.result = await call.fn(*args)
            else:
                call.result = await anyio.to_thread.run_sync(
                    call.fn, *args, limiter=self._limiter, abandon_on_cancel=True
                )
        except Exception as exc:
            call.failure = exc
        finally:
            call.scope = None
            if finite:
                scope.deadline = math.inf
        if not scope.cancel_called:
            await self._reply(call)

    async def _reply(self, call: _Call) -> None:
        """Answer a unary call from its outcome (nothing if the client gave up on it)."""
        if _gone(call):
            return
        if call.failure is not None:
            self._reply_exception(call, call.failure)
            return
        if call.result is _MISSING:
            self._reply_stopped(call)
            return
        encoded = self._encode(call, call.result)
        if encoded is not None:
            await self._send_value(call, _RESULT, encoded)

    def _reply_exception(self, call: _Call, exc: BaseException) -> None:
        self._send_error(
            call.conn,
            call.call_id,
            ErrorCode.REMOTE,
            str(exc),
            _type_name(exc),
            "".join(traceback.format_exception(exc)),
        )

    async def _send_value(self, call: _Call, kind: MessageKind, encoded: _codec.Encoded) -> None:
        frames: list[Buffer] = [pack_reply_header(kind, call.call_id), encoded.payload]
        if encoded.buffers:
            frames.extend(encoded.buffers)
            await self._send_reply(call, frames, encoded.keepalive)
        else:
            await self._send_reply(call, frames, None)

    async def _run_stream(self, call: _Call, args: list[Any]) -> None:
        conn = call.conn
        gen: AsyncGenerator[Any, None] | None = None
        failure: BaseException | None = None
        finished = False
        with anyio.CancelScope(deadline=call.deadline) as scope:
            call.scope = scope
            try:
                gen = call.fn(*args)
                assert gen is not None
                while True:
                    while call.credits <= 0:
                        event = call.credit_event = anyio.Event()
                        await event.wait()
                    try:
                        item = await gen.__anext__()
                    except StopAsyncIteration:
                        finished = True
                        break
                    encoded = self._encode(call, item)
                    if encoded is None:
                        call.cancelled = True  # the ERROR is sent: nothing more
                        break
                    call.credits -= 1
                    await self._send_value(call, _STREAM_ITEM, encoded)
                    if call.observed is not None:  # observe: a stream item went out
                        call.observed.item()
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
        if call.cancelled:
            return
        if failure is not None:
            self._reply_exception(call, failure)
        elif finished:
            self._send_now(conn, encode_control(MessageKind.STREAM_END, None, call.call_id))
        else:
            self._reply_stopped(call)


async def serve(
    instance: object,
    *,
    connect: str | Sequence[str] | None = None,
    bind: str | None = None,
    engine_id: str | None = None,
    max_concurrency: int = 64,
    max_queued: int = 256,
    sync_workers: int = 8,
    grace_period: float = 5.0,
    heartbeat_interval: float = 1.0,
    dead_after: float = 5.0,
    codec: _codec.CodecConfig = _codec.DEFAULT,
    socket_options: SocketOptions = DEFAULT_OPTIONS,
    curve: CurveConfig | None = None,
    torch_shm: bool = True,
    shm_threshold: int = DEFAULT_SHM_THRESHOLD,
    observer: Observer | Sequence[Observer] | None = None,
    metrics_port: int | None = None,
    task_status: TaskStatus[Server] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``instance`` until cancelled; cancelling drains (see :meth:`Server.aclose`).

    Run it with ``await tg.start(serve, ...)`` to learn when it is ready: ``start``
    returns the :class:`Server` (its :attr:`Server.endpoint` is the bound address).
    The arguments are those of :class:`Server`.

    Raises:
        HandshakeRejectedError: Dial-in mode: every client refused this engine.
        ConnectError: ``bind`` or ``connect`` is malformed or the address is in use.
        ValueError: Bad arguments.
    """
    async with Server(
        instance,
        connect=connect,
        bind=bind,
        engine_id=engine_id,
        max_concurrency=max_concurrency,
        max_queued=max_queued,
        sync_workers=sync_workers,
        grace_period=grace_period,
        heartbeat_interval=heartbeat_interval,
        dead_after=dead_after,
        codec=codec,
        socket_options=socket_options,
        curve=curve,
        torch_shm=torch_shm,
        shm_threshold=shm_threshold,
        observer=observer,
        metrics_port=metrics_port,
    ) as server:
        task_status.started(server)
        await server.serve_forever()
