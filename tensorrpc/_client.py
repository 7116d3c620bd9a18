"""The public client: one ROUTER socket multiplexing typed calls over many engines.

Every decision (handshake, sessions, the call table, reply legality, credit, liveness,
capacity) is made by `tensorrpc._client_protocol.ClientProtocol`. `Client` is the public
surface of its one shell, `tensorrpc._client_io.ClientIO` (the socket, the reader and
timer tasks, the wake-ups), whose calls run in their callers' tasks as the functions
of `tensorrpc._client_calls`, bound to it once here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from dataclasses import replace
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import anyio.lowlevel

from tensorrpc import _client_calls as _calls, _codec, _compression, _observe
from tensorrpc._client_events import ClientConfig, Heartbeat
from tensorrpc._client_io import ClientIO
from tensorrpc._engines import EngineInfo, unavailable_message
from tensorrpc._exceptions import (
    ClosedError,
    DecodeError,
    EnginesUnavailableError,
    TensorRPCError,
)
from tensorrpc._health import HEALTH_METHOD, HealthChange, HealthStatus, decode_answer
from tensorrpc._hostinfo import host_id as _host_id
from tensorrpc._interceptors import ClientInterception, check_interceptors
from tensorrpc._service import ServiceSpec, describe, schemaless_method
from tensorrpc._views import (
    _DEFAULT_OPTIONS,
    CallOptions,
    CallStream,
    CallView,
    ClientStatistics,
    EngineStatistics,
)
from tensorrpc._zmq import SocketOptions, message_peer_address
from tensorrpc.transports._policy import DEFAULT_SHM_THRESHOLD, TransportPolicy

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
    from typing import Self

    from tensorrpc._calls import Call
    from tensorrpc._client_protocol import ClientProtocol
    from tensorrpc._engines import Balancing
    from tensorrpc._interceptors import ClientInterceptor
    from tensorrpc._observe import Observer
    from tensorrpc._security import CurveConfig
    from tensorrpc.transports._peer import AliasSetting
    from tensorrpc.transports._policy import TransportStatistics

__all__ = [
    "CallOptions",
    "CallStream",
    "CallView",
    "Client",
    "ClientStatistics",
    "EngineInfo",
    "EngineStatistics",
]

S = TypeVar("S")

# wait_for_engines: how long to wait for another engine once every one that tried was refused.
_REFUSAL_GRACE_S = 0.5
# One socket carries the traffic of every engine: higher HWMs than a single peer's.
_SOCKET_OPTIONS = SocketOptions(sndhwm=100_000, rcvhwm=100_000)


class _Schemaless:
    """Stands for "no service class" when `Client.dynamic` builds a client."""


#: The (empty) spec of a schemaless client.
_SCHEMALESS_SPEC = ServiceSpec(name="(schemaless)", methods=MappingProxyType({}), fingerprint="")


class Client(CallView[S]):
    """A client of one service over any number of engines, through one ROUTER socket.

    Use it as an async context manager:

    ```python
    async with Client(Calculator, bind="ipc:///tmp/calc.sock") as client:
        await client.wait_for_engines(2, timeout=30)
        print(await client.stub().add(1, 2))
    ```

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
        client_id: Identifies the client to engines (default: random).
        torch_shm: Offer and use the ``torch_shm`` tensor transport with engines on this
            host (Linux; checked at handshake). ``False``: frames only.
        shm_threshold: With ``transport="auto"``, CPU tensors of at least this many
            bytes go by ``torch_shm`` (CUDA tensors always do when it is usable).
        shm_alias_unsealed: ``"same-user"`` (default): tensors in torch's own shared
            memory (``share_memory_()``, torch.multiprocessing, a ``DataLoader`` batch)
            go by alias to and from an engine the kernel says is our user, in our pid
            and user namespaces, with no privilege we lack (docs/security.md);
            ``"never"``: they are copied through the sealed pool. Either side's
            ``"never"`` wins.
        shm_trust_unattested: Use ``torch_shm`` with engines the kernel cannot attest
            (tcp://, loopback too), taking the pid they claim on trust; the engine
            must set it too. Off by default: see docs/security.md.
        curve: CURVE encryption and authentication for the client's ROUTER (see
            docs/security.md): usually a ``CurveClientConfig`` holding the engines'
            public key when the client dials listening engines, or a
            ``CurveServerConfig`` with an allow-list of engine keys when engines dial in.
            None: plaintext.
        engine_keys: Engine id → the z85 CURVE public key that engine dials in with
            (needs a ``CurveServerConfig``): an id is taken only by the engine holding
            its key, and a HELLO with an id not listed is refused. None: ids are first
            come (docs/security.md).
        socket_options: ZMQ socket options (``maxmsgsize`` is the largest frame this
            client sends or accepts: a bigger argument tensor is an ``EncodeError``
            before anything is sent). Default: the safe defaults with high-water marks
            of 100,000 messages (one socket carries the traffic of every engine).
        observer: An [`Observer`][tensorrpc.Observer] (or several) told about every call,
            engine and heartbeat (see docs/observability.md): e.g.
            ``tensorrpc.metrics.PrometheusObserver``, ``tensorrpc.tracing.TracingObserver``,
            or ``tensorrpc.metrics.exporter(port)`` to export Prometheus metrics over HTTP.
        interceptors: Async interceptors around every call and stream (broadcasts
            excepted), the first outermost: ``async def icpt(call, proceed)`` (see
            docs/interceptors.md).

    Raises:
        ConnectError: From ``async with``: an address is malformed or already in use.
        ValueError: Inconsistent arguments.
    """

    __slots__ = (
        "_abandon",
        "_broadcast",
        "_built_keys",
        "_by_name",
        "_call",
        "_curve",
        "_ended",
        "_io",
        "_method",
        "_next_item",
        "_open_stream",
        "_opened",
        "_orphans",
        "_protocol",
        "_runtime_keys",
        "_spec",
        "_start_stream",
        "_tg",
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
        client_id: str | None = None,
        curve: CurveConfig | None = None,
        engine_keys: Mapping[str, bytes | str] | None = None,
        socket_options: SocketOptions | None = None,
        torch_shm: bool = True,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        shm_alias_unsealed: AliasSetting = "same-user",
        shm_trust_unattested: bool = False,
        observer: Observer | Sequence[Observer] | None = None,
        interceptors: Sequence[ClientInterceptor] = (),
    ) -> None:
        super().__init__(self, _DEFAULT_OPTIONS)
        self._spec: ServiceSpec = _SCHEMALESS_SPEC if service is _Schemaless else describe(service)
        binds = [bind] if isinstance(bind, str) else list(bind or ())
        connects = [connect] if isinstance(connect, str) else list(connect or ())
        if not binds and not connects:
            raise ValueError("give bind= (engines dial in) and/or connect= (engine addresses)")
        options = socket_options or _SOCKET_OPTIONS
        policy = TransportPolicy(
            torch_shm=torch_shm,
            shm_threshold=shm_threshold,
            alias_unsealed=shm_alias_unsealed,
            trust_unattested=shm_trust_unattested,
            message_address=message_peer_address,
        )
        config = _client_config(
            self._spec, client_id or f"client-{secrets.token_hex(6)}",
            Heartbeat(heartbeat_interval, dead_after), stream_window=stream_window,
            balancing=balancing, max_in_flight=max_in_flight, maxmsgsize=options.maxmsgsize,
            engine_keys=None if engine_keys is None else _engine_keys(engine_keys, curve),
            policy=policy,
        )  # fmt: skip
        self._built_keys = config.engine_keys
        self._runtime_keys: dict[str, str] = {}
        self._curve = curve
        self._opened = False
        self._tg: anyio.abc.TaskGroup | None = None
        io = self._io = ClientIO(
            config, policy, self._spec, codec or _codec.DEFAULT, bind=binds, connect=connects,
            socket_options=options, curve=curve, observer=_observe.resolve(observer),
        )  # fmt: skip
        self._protocol: ClientProtocol = io.protocol
        self._bind_calls(io, interceptors)

    def _bind_calls(self, io: ClientIO, interceptors: Sequence[ClientInterceptor]) -> None:
        # What CallView, stubs and CallStream call, bound once to the shell.
        bind = functools.partial
        self._call: Callable[..., Awaitable[Any]] = bind(_calls.call, io)
        self._method = bind(_calls.method, io)
        self._by_name = bind(_calls.by_name, io)
        self._broadcast = bind(_calls.broadcast, io)
        self._start_stream = bind(_calls.start_stream, io)
        self._next_item = bind(_calls.next_item, io)
        self._abandon = io.abandon
        self._ended = bind(_calls.ended, io)
        self._orphans = io.orphans
        self._open_stream: Callable[..., Awaitable[tuple[Call | None, Any]]] | None = None
        if interceptors:
            chain = ClientInterception(
                self._call,
                self._start_stream,
                self._next_item,
                io.abandon,
                self._spec.name,
                check_interceptors(interceptors, "client"),
            )
            self._call, self._open_stream = chain.call, chain.open_stream

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
        observer = self._io.observer
        try:
            if observer is not None:  # observe: the client opened
                # Before binding: an exporter's port in use fails before any socket is bound.
                observer.opened(self)
            self._io.open()
        except BaseException:
            if observer is not None:
                observer.closed(self)
            raise
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._io.start(tg)
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

    async def aclose(self) -> None:
        """Close the client: say BYE to every engine, fail calls still in flight, reap tasks.

        Calls still in flight raise [`ClosedError`][tensorrpc.ClosedError]. Idempotent.
        """
        if self._protocol.closed:
            return
        self._io.close()
        if self._io.observer is not None:  # observe: the client closed
            self._io.observer.closed(self)
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
        return tuple(self._io.addresses)

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
        return _statistics(self._protocol, self._io.retries, self._io.policy.statistics())

    async def wait_for_engines(
        self,
        count: int = 1,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> Mapping[str, EngineInfo]:
        """Wait until at least ``count`` engines are live.

        Args:
            count: How many live engines to wait for.
            timeout: Seconds to wait at most; ``None`` (the default) waits as long as
                engines take to start (loading a model can take minutes), but never
                for an engine that was refused: a wait in which every engine that
                tried to join was refused (wrong schema, service or version,
                duplicate id, or the engine refused this client) and none is live
                fails after a short grace (0.5 s), with or without a timeout, since
                waiting does not fix a mismatch. Each refusal is logged once per
                engine and reason at WARNING on the ``tensorrpc.client`` logger.

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
        self._io.check_open()
        table = self._protocol.engines
        with anyio.move_on_after(timeout):
            while len(table.engines) < count:
                changed = self._io.engines_changed
                assert changed is not None
                if table.rejected and not table.engines:
                    # Every engine that tried to join was refused and none is live: give
                    # one still on its way a short grace, then say why.
                    with anyio.move_on_after(_REFUSAL_GRACE_S):
                        await changed.wait()
                    if not changed.is_set():
                        break
                else:
                    await changed.wait()
                self._io.check_open()
            else:
                return self.engines
        rejected = dict(table.rejected)
        sock = self._io.sock
        failures = sock.handshake_failures() if sock is not None else ()
        earlier = table.rejected_total - len(rejected)
        text = unavailable_message(len(table.engines), count, timeout, rejected, failures, earlier)
        raise EnginesUnavailableError(text, rejected=rejected)

    async def health(
        self,
        engine: str | None = None,
        *,
        service: str = "",
        timeout: float | None = 5.0,  # noqa: ASYNC109 - a call's deadline, as with_options
    ) -> HealthStatus:
        """Ask one engine for its health through the built-in health method.

        The engine answers without a worker, so a busy engine answers at once; a
        draining one answers ``NOT_SERVING``, and so does one whose application said so
        ([`Server.set_health`][tensorrpc.Server.set_health]).

        Args:
            engine: The engine's id; ``None``: any live engine (balanced like a call).
            service: The service asked about; ``""`` (the default): the engine as a whole.
                A service the engine does not serve is ``SERVICE_UNKNOWN``.
            timeout: Seconds for the answer (``None``: no deadline).

        Returns:
            ``SERVING``, ``NOT_SERVING`` or ``SERVICE_UNKNOWN``.

        Raises:
            EngineNotFoundError: The engine is not live (or none is).
            CallTimeoutError: No answer in time.
            EngineDeadError: The engine died or left before answering.
            DecodeError: The answer is not a health answer.
            ClosedError: The client is closed.
        """
        spec = schemaless_method(self._spec.name, HEALTH_METHOD, streaming=False)
        options = CallOptions(engine=engine, timeout=timeout, wait_for_ready=False)
        value = await self._call(spec, (service,), {}, options)
        try:
            return decode_answer(value)
        except ValueError as exc:
            raise DecodeError(f"{HEALTH_METHOD}: {exc}") from None

    async def watch_health(
        self,
        *,
        service: str = "",
        interval: float = 1.0,
        timeout: float = 5.0,  # noqa: ASYNC109 - each answer's deadline, as in health()
    ) -> AsyncGenerator[HealthChange, None]:
        """Watch every engine's health: one [`HealthChange`][tensorrpc.HealthChange] per change.

        Each round asks every live engine (concurrently, each answer bounded by
        ``timeout``) and yields a change for each engine whose status differs from the
        last one seen: first the initial status of every engine, then only changes. An
        engine that leaves, or does not answer in time, becomes ``UNKNOWN``. A round
        starts ``interval`` seconds after the previous one ended, and at once when an
        engine joins or leaves. Stop by leaving
        the ``async for`` (or closing the iterator).

        ```python
        async for change in client.watch_health(interval=0.5):
            print(change.engine_id, change.status)
        ```

        Args:
            service: As in `health`.
            interval: Seconds between rounds (> 0).
            timeout: Seconds each engine has to answer in a round (> 0).

        Yields:
            The changes of each round, in engine id order.

        Raises:
            ValueError: ``interval`` or ``timeout`` is not positive.
            ClosedError: The client is closed (at the next round).
        """
        if not interval > 0 or not timeout > 0:
            raise ValueError("interval and timeout must be > 0")
        seen: dict[str, HealthStatus] = {}
        while True:
            self._io.check_open()
            changed = self._io.engines_changed
            live = sorted(self._protocol.engines.engines)
            now = await _health_round(self, live, service, timeout)
            for engine_id in seen.keys() - now.keys():
                now[engine_id] = HealthStatus.UNKNOWN  # it left
            for engine_id in sorted(now):
                status, previous = now[engine_id], seen.get(engine_id)
                if status is not previous:
                    seen[engine_id] = status
                    yield HealthChange(engine_id, status, previous)
            for engine_id in seen.keys() - set(live):  # said UNKNOWN once: forget it
                del seen[engine_id]
            if changed is not None:
                with anyio.move_on_after(interval):
                    await changed.wait()

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
        self._io.check_open()
        sock = self._io.sock
        assert sock is not None
        alias = f"@{secrets.token_hex(4)}/{self._protocol.dial_count}".encode()
        sock.connect(address, peer_id=alias)
        self._protocol.dial(alias, address, self._io.now())
        self._io.flush()

    def disconnect(self, address: str) -> None:
        """Stop dialling an address given to `connect` or to ``connect=``.

        The engine behind it stays live until it says BYE or goes silent for
        ``dead_after``. Unknown addresses are ignored.

        Raises:
            ClosedError: The client is not open or is closed.
        """
        self._io.check_open()
        sock = self._io.sock
        assert sock is not None
        if self._protocol.undial(address):
            with contextlib.suppress(TensorRPCError):
                sock.disconnect(address)

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
        self._io.flush()
        return lost

    @property
    def engine_keys(self) -> Mapping[str, str] | None:
        """Engine id → the z85 CURVE public key it must join with (``None``: ids are first
        come): ``engine_keys=`` and what `bind_engine_keys` added."""
        return self._protocol.config.engine_keys

    def bind_engine_keys(self, keys: Mapping[str, bytes | str]) -> None:
        """Bind more engine ids to CURVE keys while the client runs, and let the keys in.

        The run-time form of ``engine_keys=``, for launchers that make one keypair per
        engine (``tensorrpc.ray.launch``): each id is then taken only by the engine holding
        its key, and each key joins the allow-list of the client's CURVE server until
        `unbind_engine_keys`. A client built with ``engine_keys=None`` (ids first come)
        admits only bound ids while any are bound.

        Args:
            keys: Engine id → z85 public key.

        Raises:
            ValueError: The client is not a CURVE server (``curve=CurveServerConfig``), a
                key is malformed, or an id is already bound to another key.
            ClosedError: The client is not open.
        """
        from tensorrpc._security import allow_clients

        checked = dict(_engine_keys(keys, self._curve))
        current = dict(self._protocol.config.engine_keys or {})
        clash = sorted(k for k, v in checked.items() if current.get(k, v) != v)
        if clash:
            raise ValueError(f"engine ids already bound to another key: {', '.join(clash)}")
        sock = self._io.sock
        if sock is None:
            raise ClosedError("the client is not open")
        new = {k: v for k, v in checked.items() if k not in current}
        allow_clients(sock.socket, [v.encode("ascii") for v in new.values()])
        self._runtime_keys.update(new)
        _set_engine_keys(self._protocol, self._built_keys, self._runtime_keys)

    def unbind_engine_keys(self, engine_ids: Iterable[str]) -> None:
        """Undo `bind_engine_keys` for ``engine_ids``: their keys leave the allow-list
        (live engines stay; a new handshake with those keys is refused). Ids bound by
        ``engine_keys=`` and unknown ids are left alone."""
        from tensorrpc._security import disallow_clients

        gone = {k: self._runtime_keys.pop(k) for k in engine_ids if k in self._runtime_keys}
        if not gone:
            return
        _set_engine_keys(self._protocol, self._built_keys, self._runtime_keys)
        sock = self._io.sock
        if sock is not None:
            still = set(self._runtime_keys.values()) | set((self._built_keys or {}).values())
            disallow_clients(
                sock.socket, [v.encode("ascii") for v in gone.values() if v not in still]
            )


async def _health_round(
    client: Client[Any], engine_ids: list[str], service: str, bound: float
) -> dict[str, HealthStatus]:
    """One health answer per engine (``UNKNOWN`` for those that gave none in time)."""
    answers: dict[str, HealthStatus] = {}

    async def one(engine_id: str) -> None:
        try:
            answers[engine_id] = await client.health(engine_id, service=service, timeout=bound)
        except ClosedError:
            raise
        except TensorRPCError:
            answers[engine_id] = HealthStatus.UNKNOWN

    async with anyio.create_task_group() as tg:
        for engine_id in engine_ids:
            tg.start_soon(one, engine_id)
    return answers


def _set_engine_keys(
    protocol: ClientProtocol, built: Mapping[str, str] | None, runtime: Mapping[str, str]
) -> None:
    """The machine admits ids by ``engine_keys=`` and those bound at run time."""
    keys: Mapping[str, str] | None = None
    if built is not None or runtime:
        keys = MappingProxyType({**(built or {}), **runtime})
    protocol.config = replace(protocol.config, engine_keys=keys)


def _client_config(
    spec: ServiceSpec,
    client_id: str,
    heartbeat: Heartbeat,
    *,
    stream_window: int,
    balancing: Balancing,
    max_in_flight: int,
    maxmsgsize: int,
    engine_keys: Mapping[str, str] | None,
    policy: TransportPolicy,
) -> ClientConfig:
    """What the client's protocol machine is configured with."""
    return ClientConfig(
        service=spec.name,
        fingerprint=spec.fingerprint,
        client_id=client_id,
        host_id=_host_id(),
        pid=os.getpid(),
        heartbeat=heartbeat,
        stream_window=stream_window,
        max_message_bytes=max(0, maxmsgsize),
        balancing=balancing,
        max_in_flight=max_in_flight,
        schemaless=spec is _SCHEMALESS_SPEC,
        signatures={n: m.signature for n, m in spec.methods.items()},
        engine_keys=engine_keys,
        shm_transports=policy.offered(),
        shm_trust_unattested=policy.peers.trust_unattested,
        compression=_compression.available(),
    )


def _statistics(
    protocol: ClientProtocol, retries: int, transports: TransportStatistics
) -> ClientStatistics:
    table = protocol.engines
    counted = protocol.counters.engines
    engines: dict[str, EngineStatistics] = {}
    for engine_id, past in table.past.items():
        engines[engine_id] = EngineStatistics(
            engine_id, False, past.calls, past.errors, 0, past.bytes_sent, past.bytes_received
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
    for engine_id, stats in engines.items():
        counters = counted.get(engine_id)
        if counters is not None:
            engines[engine_id] = replace(stats, **counters.snapshot())
    return ClientStatistics(
        engines=MappingProxyType(dict(sorted(engines.items()))),
        calls_in_flight=len(protocol.calls),
        waiting_for_capacity=len(protocol.capacity),
        rejected=MappingProxyType(dict(table.rejected)),
        overload_retries=retries,
        transports=transports,
        rejected_total=table.rejected_total,
    )


def _engine_keys(
    keys: Mapping[str, bytes | str], curve: CurveConfig | None
) -> MappingProxyType[str, str]:
    """``engine_keys=`` checked: z85 keys (as text), for a client that is a CURVE server."""
    from tensorrpc._security import CurveServerConfig, check_public_key

    if not isinstance(curve, CurveServerConfig):
        raise ValueError(
            "engine_keys= needs curve=CurveServerConfig(...): the keys engines dial in with "
            "are known only to a binding client that is a CURVE server"
        )
    return MappingProxyType(
        {
            str(engine_id): check_public_key(
                key.encode() if isinstance(key, str) else key, f"engine_keys[{engine_id!r}]"
            ).decode("ascii")
            for engine_id, key in keys.items()
        }
    )
