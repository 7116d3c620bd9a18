"""The client: one ROUTER socket multiplexing typed calls over many engines.

Shape of the I/O shell (routing decisions live in `_routing`):

* One ROUTER socket carries both topologies: engines dial in (``bind=``; each engine's
  DEALER has the routing id ``engine_id/nonce``) and the client dials engines
  (``connect=``; each address gets a ``CONNECT_ROUTING_ID`` alias and a PING so that the
  engine answers with HELLO).
* One reader task receives every message and resolves the call table (call id → pending
  call). The caller that made a call decodes its own reply, so the reader stays lean.
* One housekeeping task sends heartbeats, declares silent engines dead, re-pings engine
  addresses that are not live, cancels calls of garbage-collected streams and releases
  the memory of tensors ZMQ has finished sending.
* All socket I/O happens on the event loop thread; sends are non-blocking (ROUTER sockets
  do not block; a full peer pipe is retried until the caller's deadline).

Reply ordering rules: a reply is delivered only to the call with its call id *and* only
if it came from the engine that call was sent to; late replies (the call finished,
timed out or was cancelled) are dropped. A call ends exactly once, and its per-engine
in-flight slot is released when it ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    NoReturn,
    ParamSpec,
    TypeVar,
    cast,
    overload,
)

import anyio
import anyio.lowlevel
import zmq

from tensorrpc import _codec, _observe
from tensorrpc._exceptions import (
    BroadcastError,
    CallTimeoutError,
    ClosedError,
    EngineDeadError,
    EnginesUnavailableError,
    MethodNotFoundError,
    OverloadedError,
    PeerUnreachableError,
    RemoteProtocolError,
    TensorRPCError,
    TensorTransportError,
)
from tensorrpc._hostinfo import host_id as _host_id
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Bye,
    Credit,
    ErrorInfo,
    Flags,
    Header,
    Hello,
    MessageKind,
    Proof,
    Reject,
    Release,
    Welcome,
    decode_control,
    encode_control,
    pack_call_header,
    split_frames,
)
from tensorrpc._routing import (
    Balancing,
    EngineInfo,
    EngineRegistry,
    EngineState,
    StreamCredit,
    unavailable_message,
)
from tensorrpc._service import ServiceSpec, describe, schemaless_method
from tensorrpc._stub import Stub
from tensorrpc._zmq import AsyncSocket, PendingSends, SocketOptions, create_socket
from tensorrpc.transports._policy import (
    DEFAULT_SHM_THRESHOLD,
    TRANSPORTS,
    LeaseCollector,
    PolicyPlacer,
    TransportName,
    TransportPolicy,
    TransportStatistics,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
    from typing import Self

    from typing_extensions import Buffer

    from tensorrpc._observe import CallObservation, Observer
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
]

logger = logging.getLogger("tensorrpc.client")

S = TypeVar("S")
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: Tensor transport names a call may ask for.
Transport = TransportName
_TRANSPORTS: frozenset[str] = TRANSPORTS
#: Transports this client can receive (announced in WELCOME).
_RECEIVES: tuple[str, ...] = ("frames",)
_NO_TRANSPORT_STATISTICS = TransportStatistics()
_SHM_RESULTS_FLAG = int(Flags.SHM_RESULTS)
_SHM_RESULTS_ALL_FLAG = int(Flags.SHM_RESULTS_ALL)

_RESULT = MessageKind.RESULT
_ERROR = MessageKind.ERROR
_STREAM_ITEM = MessageKind.STREAM_ITEM
_STREAM_END = MessageKind.STREAM_END
_PING = MessageKind.PING
_PONG = MessageKind.PONG
_HELLO = MessageKind.HELLO
_BYE = MessageKind.BYE
_REJECT = MessageKind.REJECT
_EMPTY = b""
_U32_MAX = 0xFFFF_FFFF
# Back-off between retries of a call an engine refused as OVERLOADED (wait=True only).
_RETRY_MIN_S = 0.001
_RETRY_MAX_S = 0.05
_STREAM_FLAG = int(Flags.STREAM)
_NO_WAIT_FLAG = int(Flags.NO_WAIT)
# PING nonce 0 asks a listening engine to (re)send HELLO.
_HELLO_REQUEST = 0
# wait_for_engines: how long to wait for another engine once every one that tried was refused.
_REFUSAL_GRACE_S = 0.5
# Heartbeat PINGs carry time.monotonic_ns() as their nonce (always > 1), to time the PONG.


@dataclass(frozen=True, slots=True)
class CallOptions:
    """Per-call options; set through `Client.stub` or `Client.with_options`.

    Attributes:
        engine: Send to this engine id; ``None`` balances over the live engines.
        timeout: Deadline in seconds for the whole call (waiting for capacity, the
            round trip, and for a stream every item); ``None`` for none.
        wait: When the client's per-engine in-flight bound is reached, or an engine
            answers that its queue is full, wait and retry (bounded by the deadline);
            ``False`` raises [`OverloadedError`][tensorrpc.OverloadedError] at once and asks the
            engine to refuse rather than queue.
        transport: Tensor transport for arguments and results: ``"auto"`` (default:
            ``torch_shm`` for tensors of at least ``shm_threshold`` bytes when the engine
            is on this host and can attach to our shared memory, frames otherwise),
            ``"frames"`` or ``"torch_shm"`` (every out-of-band tensor by shared memory
            when possible, else frames, counted as a fallback). See [Transports](transports.md).
    """

    engine: str | None = None
    timeout: float | None = None
    wait: bool = True
    transport: Transport = "auto"

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout!r}")
        if self.transport not in _TRANSPORTS:
            raise ValueError(
                f"unknown transport {self.transport!r}; expected one of {sorted(_TRANSPORTS)}"
            )


_DEFAULT_OPTIONS = CallOptions()


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Counters for one engine id (summed over restarts under that id).

    Attributes:
        engine_id: The engine.
        live: Whether the engine is live now.
        calls: Calls (and streams) started on it.
        errors: Calls that ended in an error (remote or local: timeouts, death...).
        in_flight: Calls in flight now.
        bytes_sent: Bytes sent to it (all frames).
        bytes_received: Bytes received from it (all frames).
    """

    engine_id: str
    live: bool
    calls: int
    errors: int
    in_flight: int
    bytes_sent: int
    bytes_received: int


@dataclass(frozen=True, slots=True)
class ClientStatistics:
    """A snapshot of a client's state, from [`Client.statistics`][tensorrpc.Client.statistics].

    Attributes:
        engines: Per engine id counters, for every engine seen since the client opened.
        calls_in_flight: Calls in flight over all engines.
        waiting_for_capacity: Callers waiting for an in-flight slot.
        rejected: Engine id → why it was refused at handshake.
        overload_retries: Calls an engine refused as OVERLOADED and the client retried.
    """

    engines: Mapping[str, EngineStatistics]
    calls_in_flight: int
    waiting_for_capacity: int
    rejected: Mapping[str, str]
    overload_retries: int = 0
    #: Per tensor transport: tensors and bytes moved, and fallbacks to frames.
    transports: TransportStatistics = _NO_TRANSPORT_STATISTICS


# ------------------------------------------------------------------------------ call table


class _Call:
    """One pending call in the call table: where it went and what came back."""

    __slots__ = (
        "call_id",
        "credit",
        "done",
        "engine",
        "error",
        "items",
        "lease",
        "observed",
        "placed",
        "reply_buffers",
        "reply_kind",
        "reply_payload",
        "spec",
        "waiter",
    )

    def __init__(self, call_id: int, engine: EngineState, spec: MethodSpec, waiter: Any) -> None:
        self.call_id = call_id
        self.engine = engine
        self.spec = spec
        self.waiter = waiter
        self.reply_kind: MessageKind | None = None
        self.reply_payload: Buffer = _EMPTY
        self.reply_buffers: Sequence[Buffer] = ()
        self.error: BaseException | None = None
        # Streams only:
        self.items: collections.deque[tuple[Buffer, Sequence[Buffer]]] | None = None
        self.done = False
        self.credit: StreamCredit | None = None
        # torch_shm: the lease of the argument tensors (released when the engine replies)
        # and how many tensors (and bytes) went by handle.
        self.lease: int | None = None
        self.placed = (0, 0)
        #: What the client's observer watches of this call (None: no observer).
        self.observed: CallObservation | None = None


class _Waiters:
    """Backend-specific one-shot wake-ups: an asyncio Future or a trio Event per wait.

    A bare future costs far less than ``anyio.Event`` on the hot path; both are awaited
    inside anyio cancel scopes, which cancel them like any other await.
    """

    __slots__ = ("new", "wait", "wake")

    def __init__(self, backend: str) -> None:
        self.new: Callable[[], Any]
        self.wake: Callable[[Any], None]
        self.wait: Callable[[Any], Awaitable[Any]]
        if backend == "asyncio":
            loop = asyncio.get_running_loop()
            self.new = loop.create_future
            self.wake = _wake_future
            self.wait = _identity
        else:
            import trio

            self.new = trio.Event
            self.wake = _set_event
            self.wait = _event_wait


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


def _identity(fut: Awaitable[Any]) -> Awaitable[Any]:
    return fut


def _set_event(event: Any) -> None:
    event.set()


def _event_wait(event: Any) -> Awaitable[Any]:
    return cast("Awaitable[Any]", event.wait())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class _Schemaless:
    """Stands for "no service class" when [`Client.dynamic`][tensorrpc.Client.dynamic] builds a
    client."""


#: The (empty) spec of a schemaless client.
_SCHEMALESS_SPEC = ServiceSpec(name="(schemaless)", methods=MappingProxyType({}), fingerprint="")


# ----------------------------------------------------------------------------- user views


class CallView(Generic[S]):
    """Calls on a client with a fixed set of [`CallOptions`][tensorrpc.CallOptions].

    [`Client`][tensorrpc.Client] is itself a view with the default options; `with_options`
    returns another view on the same client. Options are set this way (or through
    `stub`) because ``call(method, /, *args, **kwargs)`` forwards every keyword to
    the method.
    """

    __slots__ = ("_client", "_options")

    _client: Client[S]
    _options: CallOptions

    def __init__(self, client: Client[S], options: CallOptions) -> None:
        self._client = client
        self._options = options

    @property
    def options(self) -> CallOptions:
        """The options this view's calls use."""
        return self._options

    def with_options(
        self,
        *,
        engine: str | None = None,
        timeout: float | None = None,
        wait: bool = True,
        transport: Transport = "auto",
    ) -> CallView[S]:
        """A view on the same client whose calls use these options.

        Args:
            engine: Target engine id, or ``None`` to balance.
            timeout: Per-call deadline in seconds, or ``None``.
            wait: Wait for an in-flight slot (``False``: fail with OverloadedError).
            transport: ``"auto"``, ``"frames"`` or ``"torch_shm"`` (see
                [`CallOptions`][tensorrpc.CallOptions]).

        Returns:
            The new view.
        """
        options = CallOptions(engine=engine, timeout=timeout, wait=wait, transport=transport)
        return CallView(self._client, options)

    def stub(
        self,
        *,
        engine: str | None = None,
        timeout: float | None = None,
        wait: bool = True,
        transport: Transport = "auto",
    ) -> Stub[S]:
        """A proxy whose methods call the engines: a [`Stub`][tensorrpc.Stub] of the service.

        ``await stub.add(1, 2)`` calls ``add``, whether the handler is ``async def`` or a
        sync ``def``; ``stub.count(5)`` returns a [`CallStream`][tensorrpc.CallStream]
        for ``async for``. The mypy plugin ``tensorrpc.mypy_plugin`` types each method
        exactly (see [`Stub`][tensorrpc.Stub]); [`call`][tensorrpc.CallView.call] is
        exact under any type checker.

        Args:
            engine: Target engine id, or ``None`` to balance.
            timeout: Per-call deadline in seconds, or ``None``.
            wait: Wait for an in-flight slot (``False``: fail with OverloadedError).
            transport: ``"auto"``, ``"frames"`` or ``"torch_shm"`` (see
                [`CallOptions`][tensorrpc.CallOptions]).

        Returns:
            The stub.
        """
        options = CallOptions(engine=engine, timeout=timeout, wait=wait, transport=transport)
        return _Stub(self._client, options)

    @overload
    async def call(
        self,
        method: Callable[Concatenate[Any, P], Awaitable[R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R: ...

    @overload
    async def call(
        self,
        method: Callable[Concatenate[Any, P], AsyncIterator[Any]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> NoReturn: ...

    @overload
    async def call(
        self,
        method: Callable[Concatenate[Any, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R: ...

    async def call(
        self,
        method: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Call one unary method, typed from the service class's method.

        ``await client.call(Calculator.add, 1, 2)`` checks the arguments against
        ``Calculator.add`` and returns its result type, for async and sync methods alike.

        Args:
            method: The method, taken from the service class (``Calculator.add``).
            *args: Positional arguments.
            **kwargs: Keyword arguments.

        Returns:
            The method's result.

        Raises:
            TypeError: ``method`` is not a unary method of this client's service.
            ValidationError: An argument or the result does not match the declared types.
            EngineNotFoundError: The targeted engine is not live, or none is.
            OverloadedError: No in-flight slot and ``wait=False``, or the engine refused.
            CallTimeoutError: The deadline passed.
            EngineDeadError: The engine died or left while the call was in flight.
            RemoteError: The handler raised (and other CallError subclasses).
            ClosedError: The client is closed.
        """
        spec = self._client._method(method, streaming=False)
        return await self._client._call(spec, args, kwargs, self._options)

    def stream(
        self,
        method: Callable[Concatenate[Any, P], AsyncIterator[T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> CallStream[T]:
        """Start a streaming call: ``async for item in client.stream(Calc.count, 5)``.

        The call is sent on the first iteration. Leave early with ``aclose()`` (or
        ``async with``) to stop the engine's generator at once; an abandoned stream is
        cancelled on the engine soon after it is garbage-collected.

        Args:
            method: The streaming method, taken from the service class.
            *args: Positional arguments.
            **kwargs: Keyword arguments.

        Returns:
            The stream of items.

        Raises:
            TypeError: ``method`` is not a streaming method of this client's service.
        """
        spec = self._client._method(method, streaming=True)
        return CallStream(self._client, spec, args, kwargs, self._options)

    async def broadcast(self, method: str, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call a unary method on every live engine concurrently.

        The arguments are encoded once and the same frames go to every engine. The
        ``engine`` option is ignored; the deadline applies to each engine's call.

        Args:
            method: The method name.
            *args: Positional arguments.
            **kwargs: Keyword arguments.

        Returns:
            ``{engine_id: result}`` for every engine live when the broadcast started.

        Raises:
            BroadcastError: At least one engine failed; ``results`` holds every engine's
                result or exception.
            EngineNotFoundError: No engine is live.
            TypeError: No such unary method.
            ValidationError: The arguments do not match the method's types.
            ClosedError: The client is closed.
        """
        return await self._client._broadcast(method, args, kwargs, self._options)

    async def call_by_name(self, method: str, arguments: Mapping[str, Any] | None = None, /) -> Any:
        """Call a unary method by name, with its arguments given by name.

        On a typed client the arguments are bound and checked like `call` and the
        result is typed. On a schemaless client ([`Client.dynamic`][tensorrpc.Client.dynamic]) the
        arguments
        travel as a map of name -> value that the engine binds and validates (missing
        ones take their defaults), and the result is returned as decoded (lists, dicts,
        tensors), without conversion.

        Args:
            method: The method name.
            arguments: Parameter name -> value.

        Returns:
            The method's result.

        Raises:
            MethodNotFoundError: No live engine (or not the targeted one) offers
                ``method``; the message lists what is offered.
            TypeError: ``method`` streams (use `stream_by_name`).
            InvalidArgumentError: The engine refused the arguments (schemaless).
            ValidationError: The arguments do not match (typed client).
            EngineNotFoundError: The targeted engine is not live, or none is.
            CallTimeoutError: The deadline passed.
            EngineDeadError: The engine died or left while the call was in flight.
            RemoteError: The handler raised (and other CallError subclasses).
            ClosedError: The client is closed.
        """
        client = self._client
        spec, encoded = client._by_name(method, arguments or {}, self._options, streaming=False)
        if encoded is None:
            return await client._call(spec, (), arguments or {}, self._options)
        return await client._call(spec, (), {}, self._options, encoded)

    def stream_by_name(
        self, method: str, arguments: Mapping[str, Any] | None = None, /
    ) -> CallStream[Any]:
        """Start a streaming call by name, with its arguments given by name.

        The by-name form of `stream`; see `call_by_name` for how arguments
        and items are handled on typed and schemaless clients.

        Args:
            method: The streaming method's name.
            arguments: Parameter name -> value.

        Returns:
            The stream of items.

        Raises:
            MethodNotFoundError: No live engine (or not the targeted one) offers
                ``method``.
            TypeError: ``method`` does not stream (use `call_by_name`).
            ValidationError: The arguments do not match (typed client).
            ClosedError: The client is closed.
        """
        client = self._client
        spec, encoded = client._by_name(method, arguments or {}, self._options, streaming=True)
        return CallStream(client, spec, (), arguments or {}, self._options, encoded=encoded)


class _Stub(Stub[Any]):
    """Runtime object behind `CallView.stub`; attributes are bound method callers."""

    def __init__(self, client: Client[Any], options: CallOptions) -> None:
        self._client = client
        self._options = options

    def __getattr__(self, name: str) -> Callable[..., Any]:
        spec = self._client._spec.methods.get(name)
        if spec is None or name.startswith("_"):
            raise AttributeError(f"service {self._client._spec.name!r} has no rpc method {name!r}")
        client, options = self._client, self._options
        fn: Callable[..., Any]
        if spec.streaming:

            def fn(*args: Any, **kwargs: Any) -> CallStream[Any]:
                return CallStream(client, spec, args, kwargs, options)

        else:

            def fn(*args: Any, **kwargs: Any) -> Awaitable[Any]:
                return client._call(spec, args, kwargs, options)

        fn.__name__ = name
        fn.__qualname__ = f"{client._spec.name}.{name}"
        fn.__doc__ = f"Call {spec.signature} on an engine."
        self.__dict__[name] = fn  # later lookups skip __getattr__
        return fn

    def __repr__(self) -> str:
        return f"<stub of {self._client._spec.name} {self._options}>"


class CallStream(Generic[T]):
    """The items of one streaming call, in order; an async iterator and context manager.

    Flow control: the engine may run ahead of the consumer by at most the stream window
    (WELCOME's ``stream_window``); credit is granted back as items are taken.

    Raises (from iteration): the same errors as [`CallView.call`][tensorrpc.CallView.call]; a
        deadline bounds
    the whole stream.
    """

    def __init__(
        self,
        client: Client[Any],
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: CallOptions,
        *,
        encoded: _codec.Encoded | None = None,
    ) -> None:
        self._client = client
        self._spec = spec
        self._options = options
        # Pre-encoded arguments (schemaless calls) skip encode_args.
        self._encoded = encoded
        self._wire: list[Any] | None = (
            None if encoded is not None else spec.encode_args(args, dict(kwargs))
        )
        self._call: _Call | None = None
        self._deadline: float | None = None
        self._finished = False
        # Kept by the finalizer without the client, so that GC never touches the socket.
        self._orphans = client._orphans

    @property
    def engine(self) -> str | None:
        """The id of the engine serving this stream (``None`` until the first item)."""
        return None if self._call is None else self._call.engine.engine_id

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        if self._finished:
            raise StopAsyncIteration
        client = self._client
        try:
            if self._call is None:
                wire, self._wire = self._wire, None
                encoded, self._encoded = self._encoded, None
                if wire is None and encoded is None:
                    raise StopAsyncIteration
                if self._options.timeout is not None:
                    self._deadline = anyio.current_time() + self._options.timeout
                self._call = await client._start_stream(
                    self._spec, wire, self._options, self._deadline, encoded
                )
            return cast("T", await client._next_item(self._call, self._deadline))
        except StopAsyncIteration:
            self._finished = True
            _observe.stream_finished(self._call, None)  # observe: the stream ended
            raise
        except BaseException as exc:
            self._finished = True
            if self._call is not None:
                client._abandon(self._call)
                _observe.stream_finished(self._call, exc)  # observe: the stream failed
            raise

    async def aclose(self) -> None:
        """Stop the stream; the engine's generator is cancelled at once (idempotent)."""
        self._finished = True
        self._wire = None
        self._encoded = None
        if self._call is not None:
            self._client._abandon(self._call)
            _observe.stream_finished(self._call, None)  # observe: closed by the consumer

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)  # absent if __init__ raised
        if call is not None and not call.done:
            # May run on any thread, at any point: only an atomic deque append here. The
            # client's loop sends the CANCEL.
            self._orphans.append(call)


# ---------------------------------------------------------------------------------- client


class Client(CallView[S]):
    """A client of one service over any number of engines, through one ROUTER socket.

    Use it as an async context manager::

        async with Client(Calculator, bind="ipc:///tmp/calc.sock") as client:
            await client.wait_for_engines(2, timeout=30)
            print(await client.stub().add(1, 2))

    Engines join and leave at any time. A balanced call fails at once with
    [`EngineNotFoundError`][tensorrpc.EngineNotFoundError] when no engine is live (use
    `wait_for_engines` first). When an engine dies (silent for ``dead_after``, or its
    connection closes) or says BYE, every call in flight to it, streams included, fails
    with [`EngineDeadError`][tensorrpc.EngineDeadError]; replies it sent before its BYE are
    delivered
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
        codec_config: Codec limits (must agree with the engines').
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
            engine and heartbeat (see [Observability](observability.md)): e.g.
            ``tensorrpc.metrics.PrometheusObserver`` or ``tensorrpc.tracing.TracingObserver``.
        metrics_port: Export Prometheus metrics of this client (the default registry) over
            HTTP on this port (needs the ``metrics`` extra; 0 picks a free port).

    Raises:
        ConnectError: From ``async with``: an address is malformed or already in use.
        ValueError: Inconsistent arguments.
    """

    __slots__ = (
        "_addresses",
        "_aliases",
        "_bind",
        "_call_ids",
        "_calls",
        "_capacity",
        "_client_id",
        "_closed",
        "_codec_config",
        "_connect",
        "_curve",
        "_dead_after",
        "_engines_changed",
        "_heartbeat_interval",
        "_host_id",
        "_hwm",
        "_observer",
        "_opened",
        "_orphans",
        "_past",
        "_policy",
        "_registry",
        "_retries",
        "_scopes",
        "_shm_peers",
        "_sock",
        "_socket_options",
        "_spec",
        "_stream_window",
        "_tg",
        "_tracked",
        "_waiters",
        "_waiting",
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
        if not heartbeat_interval > 0 or not dead_after > heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < dead_after")
        if stream_window < 1:
            raise ValueError("stream_window must be at least 1")
        self._registry = EngineRegistry(balancing=balancing, max_in_flight=max_in_flight)
        self._heartbeat_interval = heartbeat_interval
        self._dead_after = dead_after
        self._stream_window = stream_window
        self._codec_config = codec_config or _codec.DEFAULT
        self._client_id = client_id or f"client-{secrets.token_hex(6)}"
        self._hwm = high_water_mark
        self._curve = curve
        self._socket_options = socket_options or SocketOptions(
            sndhwm=high_water_mark, rcvhwm=high_water_mark
        )
        self._host_id = _host_id()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count(1)
        self._orphans: collections.deque[_Call] = collections.deque()
        self._tracked = PendingSends()
        self._aliases: dict[bytes, str] = {}
        self._addresses: list[str] = []
        self._past: dict[str, list[int]] = {}
        self._waiting = 0
        self._retries = 0
        self._scopes: list[anyio.CancelScope] = []
        self._opened = False
        self._closed = False
        self._sock: AsyncSocket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._capacity: anyio.Event | None = None
        self._engines_changed: anyio.Event | None = None
        self._waiters: _Waiters | None = None
        self._policy = TransportPolicy(torch_shm=torch_shm, shm_threshold=shm_threshold)
        # Engine routing id -> (its pid, it attaches to our handles, we attach to its).
        self._shm_peers: dict[bytes, tuple[int, bool, bool]] = {}
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
            **options: Any other keyword argument of [`Client`][tensorrpc.Client].

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
        self._capacity = anyio.Event()
        self._engines_changed = anyio.Event()
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
        if self._closed:
            return  # closed before this task first ran
        with anyio.CancelScope() as scope:
            self._scopes.append(scope)
            try:
                await fn()
            except ClosedError:
                if not self._closed:
                    raise

    async def aclose(self) -> None:
        """Close the client: say BYE to every engine, fail calls still in flight, reap tasks.

        Calls still in flight raise [`ClosedError`][tensorrpc.ClosedError]. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            for state in list(self._registry.engines.values()):
                self._send_control(state.peer, _BYE, Bye("closed"))
        for call in list(self._calls.values()):
            self._finish(call, ClosedError("the client was closed"))
        self._wake_capacity()
        if self._engines_changed is not None:
            self._engines_changed.set()
        for scope in self._scopes:
            scope.cancel()
        self._close_socket()
        self._policy.close()
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
        return self._client_id

    @property
    def addresses(self) -> tuple[str, ...]:
        """The addresses actually bound (ephemeral ports resolved)."""
        return tuple(self._addresses)

    @property
    def engines(self) -> Mapping[str, EngineInfo]:
        """The live engines: engine id → what the engine said in HELLO (a snapshot)."""
        return MappingProxyType({k: s.info for k, s in self._registry.engines.items()})

    @property
    def rejected(self) -> Mapping[str, str]:
        """Engine id → why it was refused at handshake (latest refusal)."""
        return MappingProxyType(dict(self._registry.rejected))

    def statistics(self) -> ClientStatistics:
        """Counters per engine and for the whole client (a frozen snapshot)."""
        engines: dict[str, EngineStatistics] = {}
        for engine_id, past in self._past.items():
            calls, errors, sent, received = past
            engines[engine_id] = EngineStatistics(
                engine_id, False, calls, errors, 0, sent, received
            )
        for engine_id, s in self._registry.engines.items():
            past = self._past.get(engine_id, [0, 0, 0, 0])
            engines[engine_id] = EngineStatistics(
                engine_id,
                True,
                s.calls_total + past[0],
                s.errors + past[1],
                s.in_flight,
                s.bytes_sent + past[2],
                s.bytes_received + past[3],
            )
        return ClientStatistics(
            engines=MappingProxyType(dict(sorted(engines.items()))),
            calls_in_flight=len(self._calls),
            waiting_for_capacity=self._waiting,
            rejected=MappingProxyType(dict(self._registry.rejected)),
            overload_retries=self._retries,
            transports=self._policy.statistics(),
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
                to join was refused; it names the refused engines and why (for a schema
                mismatch, the methods that differ) and the handshakes that failed on the
                client's socket, with libzmq's reason (a CURVE key not on the allow-list,
                a wrong server key, CURVE against plaintext) (also a ``TimeoutError``).
            ClosedError: The client is closed.
        """
        self._check_open()
        registry = self._registry
        with anyio.move_on_after(timeout):
            while len(registry.engines) < count:
                changed = self._engines_changed
                assert changed is not None
                if timeout is not None and registry.rejected and not registry.engines:
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
        rejected = dict(registry.rejected)
        failures = self._sock.handshake_failures() if self._sock is not None else ()
        text = unavailable_message(len(registry.engines), count, timeout, rejected, failures)
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
        alias = f"@{secrets.token_hex(4)}/{len(self._aliases)}".encode()
        self._sock.connect(address, peer_id=alias)
        self._aliases[alias] = address
        self._send_control(alias, _PING, None, _HELLO_REQUEST)

    def disconnect(self, address: str) -> None:
        """Stop dialling an address given to `connect` or to ``connect=``.

        The engine behind it stays live until it says BYE or goes silent for
        ``dead_after``. Unknown addresses are ignored.

        Raises:
            ClosedError: The client is not open or is closed.
        """
        self._check_open()
        assert self._sock is not None
        for alias, known in list(self._aliases.items()):
            if known == address:
                del self._aliases[alias]
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
        state = self._registry.engines.get(engine_id)
        if state is None or state.info.pid != pid:
            return False
        self._engine_lost(state, reason)
        return True

    # -- socket layer ----------------------------------------------------------------------

    def _open_socket(self) -> None:
        sock = create_socket(zmq.ROUTER, options=self._socket_options, curve=self._curve)
        self._sock = sock
        try:
            for address in self._bind:
                self._addresses.append(sock.bind(address))
            token = secrets.token_hex(4)
            for i, address in enumerate(self._connect):
                alias = f"@{token}/{i}".encode()
                sock.connect(address, peer_id=alias)
                self._aliases[alias] = address
        except BaseException:
            self._close_socket()
            raise
        for alias in self._aliases:
            self._send_control(alias, _PING, None, _HELLO_REQUEST)

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._tracked.clear()

    # -- sending ---------------------------------------------------------------------------

    def _send_control(self, peer: bytes, kind: MessageKind, body: Any, call_id: int = 0) -> bool:
        """Send a control message without waiting; False (logged) when it could not go."""
        sock = self._sock
        if sock is None:
            return False
        try:
            frames = encode_control(kind, body, call_id)
            sock.send_nowait([peer, *frames])
        except PeerUnreachableError:
            state = self._registry.by_peer(peer)
            if state is not None:
                self._engine_lost(state, "is unreachable (its connection closed)")
            return False
        except anyio.WouldBlock:
            logger.debug("dropped %s to %r: peer pipe full", kind.name, peer)
            return False
        except TensorRPCError as exc:
            logger.debug("could not send %s: %s", kind.name, exc)
            return False
        state = self._registry.by_peer(peer)
        if state is not None:
            state.bytes_sent += len(frames[0]) + len(frames[1])
        return True

    async def _send_call(self, call: _Call, frames: list[Any], keepalive: list[object]) -> None:
        """Send a CALL; waits (bounded by the caller's scope) only while the pipe is full."""
        sock = self._sock
        if sock is None:
            raise ClosedError("the client is closed")
        track = len(frames) > 3
        try:
            try:
                tracker = sock.send_nowait(frames, track=track)
            except anyio.WouldBlock:
                tracker = await sock.send(frames, track=track)
        except PeerUnreachableError as exc:
            self._engine_lost(call.engine, "is unreachable (its connection closed)")
            raise EngineDeadError(
                f"engine {call.engine.engine_id!r} is unreachable", engine_id=call.engine.engine_id
            ) from exc
        if track:
            self._tracked.add(tracker, keepalive)

    # -- call plumbing ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
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
        use = "stream_by_name()" if not streaming else "call_by_name()"
        if not self.schemaless:
            spec = self._spec.methods.get(name)
            if spec is None:
                raise MethodNotFoundError(
                    f"service {self._spec.name!r} has no method {name!r}; it offers: "
                    + ", ".join(self._spec.methods)
                )
            if spec.streaming != streaming:
                raise TypeError(
                    f"{spec.qualname} is {'a' if spec.streaming else 'not a'} streaming "
                    f"method: use {use}"
                )
            return spec, None
        engines = self._registry.engines
        if options.engine is not None:
            target = engines.get(options.engine)
            infos = [] if target is None else [target.info]
        else:
            infos = [state.info for state in engines.values()]
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
                    raise TypeError(
                        f"{info.service}.{name} is {'not ' if streaming else ''}a streaming "
                        f"method: use {use}"
                    )
                service = info.service
                break
        spec = schemaless_method(service, name, streaming=streaming)
        for key in arguments:
            if not isinstance(key, str):
                raise TypeError(f"argument names must be str, got {key!r}")
        return spec, self._encode(spec, dict(arguments), _DEFAULT_OPTIONS, None)

    def _placer(self, options: CallOptions, engine: EngineState) -> PolicyPlacer | None:
        """Where large argument tensors go (None: frames only)."""
        shm = self._shm_peers.get(engine.peer)
        return self._policy.placer(
            options.transport, engine.peer, peer_receives=shm is not None and shm[1]
        )

    def _resolver(self, engine: EngineState) -> ShmResolver | None:
        """Resolves tensors that come back by torch_shm handle (None: the engine sends none).

        Kept after torch_shm *from* the engine was switched off (``shm[2]``): replies that
        were already in flight may still carry handles, and must fail (or succeed) as
        transport errors, not as undecodable messages.
        """
        shm = self._shm_peers.get(engine.peer)
        # An engine already lost (or never proven): handles are refused with a
        # TensorTransportError, not a DecodeError.
        return self._policy.resolver(shm[0] if shm is not None else 0)

    def _result_flags(self, options: CallOptions, engine: EngineState) -> int:
        """The CALL flag bits that tell the engine how to send result tensors."""
        mode = options.transport
        if mode == "frames":
            return 0
        shm = self._shm_peers.get(engine.peer)
        if shm is None or not shm[2]:
            return 0
        return _SHM_RESULTS_ALL_FLAG if mode == "torch_shm" else _SHM_RESULTS_FLAG

    def _released(self, engine: EngineState, resolver: ShmResolver | None) -> None:
        """Tell the engine we attached to the result tensors sent under these leases."""
        if resolver is not None:
            leases = resolver.leases
            if leases:
                self._send_control(engine.peer, MessageKind.RELEASE, Release(leases))

    def _discard(self, engine: EngineState, payload: Buffer, buffers: Sequence[Buffer]) -> None:
        """A reply nobody will decode: release the torch_shm leases it carries, if any."""
        if engine.peer not in self._shm_peers:
            return  # the engine sends us no handles
        collector = LeaseCollector()
        with contextlib.suppress(TensorRPCError):
            _codec.decode(payload, buffers, self._codec_config, resolver=collector)
        if collector.leases:
            leases = tuple(dict.fromkeys(collector.leases))
            self._send_control(engine.peer, MessageKind.RELEASE, Release(leases))

    def _shm_failed(self, engine: EngineState, *, sending: bool) -> None:
        """The engine could not attach to our handles (or we to its): stop using torch_shm."""
        shm = self._shm_peers.get(engine.peer)
        if shm is not None:
            pid, send, receive = shm
            self._shm_peers[engine.peer] = (pid, False, receive) if sending else (pid, send, False)
            logger.warning(
                "torch_shm %s engine %r failed; using frames from now on",
                "to" if sending else "from",
                engine.engine_id,
            )

    async def _acquire(self, options: CallOptions) -> EngineState:
        """Pick an engine with a free in-flight slot, waiting for one if allowed."""
        registry = self._registry
        while True:
            self._check_open()
            state = registry.select(options.engine)
            if state is not None:
                return state
            if not options.wait:
                what = f"engine {options.engine!r}" if options.engine else "every engine"
                raise OverloadedError(
                    f"{what} has {registry.max_in_flight} calls in flight "
                    "(max_in_flight) and wait=False"
                )
            assert self._capacity is not None
            self._waiting += 1
            try:
                await self._capacity.wait()
            finally:
                self._waiting -= 1

    def _wake_capacity(self) -> None:
        if self._waiting and self._capacity is not None:
            self._capacity.set()
            self._capacity = anyio.Event()

    def _begin(self, state: EngineState, spec: MethodSpec, *, stream: bool) -> _Call:
        assert self._waiters is not None
        call_id = next(self._call_ids)
        call = _Call(call_id, state, spec, self._waiters.new())
        if stream:
            call.items = collections.deque()
            call.credit = StreamCredit(self._stream_window)
        self._calls[call_id] = call
        state.calls.add(call_id)
        state.calls_total += 1
        return call

    def _finish(self, call: _Call, error: BaseException | None = None) -> None:
        """End a call: leave the table, free its slot, wake its waiter (exactly once)."""
        if call.done:
            return
        call.done = True
        if error is not None:
            call.error = error
            call.engine.errors += 1
        if call.lease is not None:
            # The engine replied (so it attached to the arguments), or never will.
            self._policy.release_one(call.lease)
            call.lease = None
        self._calls.pop(call.call_id, None)
        state = call.engine
        state.calls.discard(call.call_id)
        if self._waiting:
            self._wake_capacity()
        assert self._waiters is not None
        self._waiters.wake(call.waiter)

    def _abandon(self, call: _Call) -> None:
        """The caller gave up (cancelled, timed out, closed a stream): tell the engine."""
        items = call.items
        while items:  # stream items nobody will read
            payload, buffers = items.popleft()
            self._discard(call.engine, payload, buffers)
        if call.done:
            return
        self._finish(call)
        if call.engine.alive and self._sock is not None:
            self._send_control(call.engine.peer, MessageKind.CANCEL, None, call.call_id)

    def _encode(
        self,
        spec: MethodSpec,
        wire: object,
        options: CallOptions,
        state: EngineState | None,
        placer: TensorPlacer | None = None,
    ) -> _codec.Encoded:
        encoded = _codec.encode(wire, self._codec_config, placer=placer)
        self._check_sizes(spec, encoded, state)
        return encoded

    def _check_sizes(
        self, spec: MethodSpec, encoded: _codec.Encoded, state: EngineState | None
    ) -> None:
        """Refuse arguments with a frame over our ``maxmsgsize`` or the engine's.

        A frame over the receiver's MAXMSGSIZE makes its ZMQ drop the whole connection
        (and every call on it) without a word, so it is refused here, before sending: the
        limit is the smaller of ours and the one the engine announced in its HELLO.
        """
        _codec.check_message_size(
            encoded,
            self._socket_options.maxmsgsize,
            0 if state is None else state.info.max_message_bytes,
            what=f"{spec.qualname}: the arguments",
            peer="engine" if state is None else f"engine {state.engine_id!r}",
        )

    async def _start(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        encoded: _codec.Encoded | None,
        options: CallOptions,
        deadline: float | None,
        flags: int,
    ) -> _Call:
        """Pick an engine, enter the call in the table and send the CALL."""
        if self._orphans:
            self._reap_orphans()
        state = self._registry.select(options.engine) if not self._closed else None
        if state is None:
            state = await self._acquire(options)
        placer = None
        if encoded is not None:
            # Encoded before an engine was chosen (by name, broadcast): check its limit.
            self._check_sizes(spec, encoded, state)
        else:
            placer = self._placer(options, state)
            try:
                encoded = self._encode(spec, cast("list[Any]", wire), options, state, placer)
            except BaseException:
                if placer is not None:
                    placer.abort()
                raise
        call = self._begin(state, spec, stream=bool(flags & _STREAM_FLAG))
        if placer is not None:
            call.lease = placer.lease
            call.placed = (placer.placed, placer.placed_bytes)
        flags |= self._result_flags(options, state)
        self._policy.sent_frames(encoded.buffers)
        timeout_ms = 0
        if deadline is not None:
            timeout_ms = min(_U32_MAX, max(1, int((deadline - anyio.current_time()) * 1000)))
        header = pack_call_header(call.call_id, spec.name, flags, timeout_ms)
        payload = encoded.payload
        buffers = encoded.buffers
        nbytes = len(payload)
        for buffer in buffers:
            nbytes += buffer.nbytes
        if self._observer is not None:  # observe: a CALL goes out (may add trace context)
            call.observed, header = _observe.client_call(
                self._observer, header, spec.name, state.engine_id, state.info.features,
                bool(flags & _STREAM_FLAG), nbytes, call.placed[0], len(buffers),
            )  # fmt: skip
        frames: list[Any] = [state.peer, header, payload, *buffers]
        nbytes += len(header)
        state.bytes_sent += nbytes
        sock = self._sock
        track = bool(buffers)
        try:
            if sock is None:
                raise ClosedError("the client is closed")
            try:
                tracker = sock.send_nowait(frames, track=track)
            except anyio.WouldBlock:
                tracker = await sock.send(frames, track=track)
        except PeerUnreachableError as exc:
            self._engine_lost(state, "is unreachable (its connection closed)")
            raise (
                call.error
                or EngineDeadError(
                    f"engine {state.engine_id!r} is unreachable", engine_id=state.engine_id
                )
            ) from exc
        except BaseException as exc:
            if not call.done:
                self._abandon(call)
                state.errors += 1
            if call.observed is not None:  # observe: the CALL could not be sent
                call.observed.finished(_observe.outcome_of(exc), 0)
            raise
        if track:
            self._tracked.add(tracker, encoded.keepalive)
        return call

    async def _result(self, call: _Call, options: CallOptions) -> Any:
        """Wait for a unary call's reply and decode it (in the caller's task)."""
        waiters = self._waiters
        assert waiters is not None
        try:
            await waiters.wait(call.waiter)
        except BaseException:
            if not call.done:
                self._abandon(call)
                call.engine.errors += 1
            elif call.reply_kind is _RESULT:  # it came, but nobody will decode it
                self._discard(call.engine, call.reply_payload, call.reply_buffers)
            raise
        if call.error is not None:
            raise call.error
        state = call.engine
        if call.reply_kind is _RESULT:
            resolver = self._resolver(state)
            self._policy.received_frames(call.reply_buffers)
            try:
                value = _codec.decode(
                    call.reply_payload, call.reply_buffers, self._codec_config, resolver=resolver
                )
                return call.spec.decode_result(value)
            except TensorRPCError as exc:
                state.errors += 1
                if isinstance(exc, TensorTransportError):
                    self._shm_failed(state, sending=False)
                raise
            finally:
                self._released(state, resolver)
        state.errors += 1
        raise self._reply_error(call.reply_payload)

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
                    return await _observe.observe_result(
                        call.observed, self._result(call, options), call
                    )
                return await self._result(call, options)
            except TensorTransportError:
                if call.reply_kind is not _ERROR or not call.placed[0] or wire is None:
                    raise
                # The engine could not attach to the arguments' shared memory (it answers
                # so before running the handler): resend them as frames.
                call.engine.errors -= 1
                self._shm_failed(call.engine, sending=True)
                if options.transport == "auto":
                    self._policy.record_fallback(*call.placed)
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

    def _reply_error(self, payload: Buffer) -> TensorRPCError:
        try:
            info = decode_control(_ERROR_HEADER, payload)
        except RemoteProtocolError as exc:
            return exc
        assert isinstance(info, ErrorInfo)
        return info.to_exception()

    async def _start_stream(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        options: CallOptions,
        deadline: float | None,
        encoded: _codec.Encoded | None = None,
    ) -> _Call:
        self._check_open()
        flags = _STREAM_FLAG if options.wait else _STREAM_FLAG | _NO_WAIT_FLAG
        if deadline is None:
            return await self._start(spec, wire, encoded, options, None, flags)
        with anyio.move_on_after(deadline - anyio.current_time()):
            return await self._start(spec, wire, encoded, options, deadline, flags)
        raise CallTimeoutError(f"{spec.qualname} stream did not start within {options.timeout} s")

    async def _next_item(self, call: _Call, deadline: float | None) -> Any:
        items = call.items
        waiters = self._waiters
        assert items is not None
        assert waiters is not None
        while not items:
            if call.done:
                if call.error is not None:
                    raise call.error
                if call.reply_kind is _ERROR:
                    raise self._reply_error(call.reply_payload)
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
        payload, buffers = items.popleft()
        if call.observed is not None:  # observe: a stream item is taken
            call.observed.item()
        if not call.done:
            assert call.credit is not None
            grant = call.credit.consumed()
            if grant:
                self._send_control(
                    call.engine.peer, MessageKind.CREDIT, Credit(grant), call.call_id
                )
        state = call.engine
        resolver = self._resolver(state)
        self._policy.received_frames(buffers)
        try:
            value = _codec.decode(payload, buffers, self._codec_config, resolver=resolver)
        except TensorTransportError:
            self._shm_failed(state, sending=False)
            raise
        finally:
            self._released(state, resolver)
        return call.spec.decode_result(value)

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
        engines = self._registry.live_ids()
        if not engines:
            self._registry.select(None)  # raises EngineNotFoundError
        encoded = self._encode(spec, wire, _DEFAULT_OPTIONS, None)
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
        ordered = {k: results[k] for k in engines}
        failed = [k for k, v in ordered.items() if isinstance(v, BaseException)]
        if failed:
            raise BroadcastError(
                f"broadcast of {spec.qualname} failed on {len(failed)} of {len(engines)} "
                f"engines: " + "; ".join(f"{k}: {ordered[k]!r}" for k in failed),
                results=ordered,
            )
        return ordered

    # -- receiving -------------------------------------------------------------------------

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

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 3:
            logger.warning("dropped a message of %d frames", len(frames))
            return
        peer = frames[0].bytes
        try:
            header, payload, buffers = split_frames(cast("list[Buffer]", frames[1:]))
        except RemoteProtocolError as exc:
            logger.warning("dropped a malformed message from %r: %s", peer, exc)
            return
        kind = header.kind
        state = self._registry.by_peer(peer)
        if state is not None:
            state.last_seen = time.monotonic()
            size = 0
            for frame in frames[1:]:
                size += len(frame)
            state.bytes_received += size
            if kind is _RESULT or kind is _ERROR or kind is _STREAM_ITEM or kind is _STREAM_END:
                call = self._calls.get(header.call_id)
                if call is None or call.engine is not state:
                    if header.call_id == 0 and kind is _ERROR:
                        logger.warning(
                            "engine %r reported: %s",
                            state.engine_id,
                            self._reply_error(payload),
                        )
                    if kind is _RESULT or kind is _STREAM_ITEM:
                        self._discard(state, payload, buffers)
                    return  # late reply to a finished call, or not ours: drop it
                if call.items is None:
                    if kind is _RESULT or kind is _ERROR:
                        call.reply_kind = kind
                        call.reply_payload = payload
                        call.reply_buffers = buffers
                        self._finish(call)
                    else:
                        self._finish(call, RemoteProtocolError(f"{kind.name} for a unary call"))
                elif kind is _STREAM_ITEM:
                    if len(call.items) >= 2 * self._stream_window:
                        # The engine ignores flow control: stop it rather than buffer more.
                        self._abandon(call)
                        state.errors += 1
                        call.error = RemoteProtocolError(
                            f"engine {state.engine_id!r} sent more stream items than the "
                            f"window ({self._stream_window}) allows"
                        )
                        return
                    call.items.append((payload, buffers))
                    if call.lease is not None:  # the engine has attached to the arguments
                        self._policy.release_one(call.lease)
                        call.lease = None
                    assert self._waiters is not None
                    self._waiters.wake(call.waiter)
                elif kind is _STREAM_END:
                    self._finish(call)
                elif kind is _ERROR:
                    call.reply_kind = kind
                    call.reply_payload = payload
                    call.engine.errors += 1
                    self._finish(call)
                else:
                    self._finish(call, RemoteProtocolError("RESULT for a streaming call"))
                return
        if self._orphans:
            self._reap_orphans()
        if kind is _PING:
            if state is not None:
                self._send_control(peer, _PONG, None, header.call_id)
        elif kind is _PONG:
            if state is not None and self._observer is not None and header.call_id > 1:
                # observe: heartbeat round trip (heartbeat PINGs carry time.monotonic_ns())
                rtt = (time.monotonic_ns() - header.call_id) / 1e9
                self._observer.heartbeat(self._client_id, state.engine_id, rtt)
        elif kind is _HELLO:
            self._on_hello(peer, header, payload)
        elif kind is _BYE:
            if state is not None:
                self._engine_lost(state, "said BYE")
        elif kind is _REJECT:
            self._on_reject(peer, state, header, payload)
        elif kind is MessageKind.PROOF:
            self._on_proof(peer, state, header, payload)
        else:
            logger.warning("dropped an unexpected %s from %r", kind.name, peer)

    def _on_hello(self, peer: bytes, header: Any, payload: Buffer) -> None:
        try:
            hello = decode_control(header, payload)
        except RemoteProtocolError as exc:
            logger.warning("dropped a malformed HELLO from %r: %s", peer, exc)
            return
        assert isinstance(hello, Hello)
        info = EngineInfo(
            engine_id=hello.engine_id,
            service=hello.service,
            fingerprint=hello.fingerprint,
            protocol_version=hello.protocol_version,
            host_id=hello.host_id,
            pid=hello.pid,
            transports=hello.transports,
            concurrency=hello.concurrency,
            heartbeat_ms=hello.heartbeat_ms,
            methods=hello.methods,
            address=self._aliases.get(peer),
            streaming=hello.streaming,
            signatures=hello.signatures,
            max_message_bytes=hello.max_message_bytes,
            features=hello.features,
        )
        registry = self._registry
        previous = registry.by_peer(peer)
        if previous is not None and (
            previous.engine_id != info.engine_id
            or previous.info.pid != info.pid
            or previous.info.host_id != info.host_id
        ):
            # Same connection, another process: the engine behind this address restarted.
            self._engine_lost(previous, "was replaced by a new engine at its address")
        current = registry.engines.get(info.engine_id)
        if (
            current is not None
            and current.peer != peer
            and current.info.host_id == self._host_id == info.host_id
            and not _pid_alive(current.info.pid)
        ):
            self._engine_lost(current, f"is gone (process {current.info.pid} exited)")
        # A schemaless client takes any service; it still checks the protocol version.
        schemaless = self._spec is _SCHEMALESS_SPEC
        outcome = registry.admit(
            info,
            peer,
            time.monotonic(),
            service=info.service if schemaless else self._spec.name,
            fingerprint=info.fingerprint if schemaless else self._spec.fingerprint,
            protocol_version=PROTOCOL_VERSION,
            signatures={n: m.signature for n, m in self._spec.methods.items()},
        )
        if isinstance(outcome, tuple):
            reason, message = outcome
            logger.warning("refused engine %r: %s", info.engine_id, message)
            self._send_control(peer, _REJECT, Reject(reason, message))
            self._notify_engines()
            return
        # torch_shm only with an engine that proves its pid in PROOF (docs/protocol.md
        # §8.1); until then: frames, and the engine is announced once PROOF settles it.
        policy = self._policy
        shm = policy.welcome_fields(peer, hello, our_host=self._host_id)
        settled = policy.settled(peer)
        self._shm_peers[peer] = settled or (0, False, False)
        welcome = Welcome(
            client_id=self._client_id,
            host_id=self._host_id,
            transports=shm.transports,
            heartbeat_ms=max(1, int(self._heartbeat_interval * 1000)),
            stream_window=self._stream_window,
            pid=os.getpid(),
            probe=shm.probe,
            max_message_bytes=max(0, self._socket_options.maxmsgsize),
            challenge=shm.challenge,
            proof=shm.proof,
        )
        self._send_control(peer, MessageKind.WELCOME, welcome)
        if self._observer is not None:  # observe: an engine joined
            event = "rejoined" if info.engine_id in self._past else "joined"
            self._observer.engine_event(self._client_id, info.engine_id, event)
        if settled is not None or not shm.challenge:
            self._notify_engines()
            self._wake_capacity()

    def _on_proof(
        self, peer: bytes, state: EngineState | None, header: Any, payload: Buffer
    ) -> None:
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            logger.warning("dropped a malformed PROOF from %r: %s", peer, exc)
            body = Proof(b"")
        assert isinstance(body, Proof)
        if state is None or peer not in self._shm_peers:
            return
        self._shm_peers[peer] = self._policy.on_proof(peer, body, our_host=self._host_id)
        self._notify_engines()
        self._wake_capacity()

    def _on_reject(
        self, peer: bytes, state: EngineState | None, header: Any, payload: Buffer
    ) -> None:
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            body = Reject("other", f"malformed REJECT: {exc}")
        assert isinstance(body, Reject)
        who = state.engine_id if state is not None else self._aliases.get(peer, repr(peer))
        logger.warning("engine %s refused this client: %s %s", who, body.reason, body.message)
        self._registry.rejected[who] = f"{body.reason}: {body.message}"
        if state is not None:
            self._engine_lost(state, f"refused this client ({body.reason})")
        self._notify_engines()

    def _notify_engines(self) -> None:
        if self._engines_changed is not None:
            self._engines_changed.set()
            self._engines_changed = anyio.Event()

    def _engine_lost(self, state: EngineState, why: str) -> None:
        """Take an engine out; every call in flight to it fails with EngineDeadError."""
        if self._registry.remove(state.engine_id) is not state:
            return
        logger.info("engine %r %s", state.engine_id, why)
        shm = self._shm_peers.pop(state.peer, None)
        self._policy.peer_gone(state.peer, shm[0] if shm is not None else 0)
        for call_id in list(state.calls):
            call = self._calls.get(call_id)
            if call is not None:
                self._finish(
                    call,
                    EngineDeadError(
                        f"engine {state.engine_id!r} {why} while {call.spec.qualname} "
                        "was in flight",
                        engine_id=state.engine_id,
                    ),
                )
        past = self._past.setdefault(state.engine_id, [0, 0, 0, 0])
        past[0] += state.calls_total
        past[1] += state.errors
        past[2] += state.bytes_sent
        past[3] += state.bytes_received
        if self._observer is not None:  # observe: an engine was lost
            self._observer.engine_event(self._client_id, state.engine_id, "lost")
        self._notify_engines()
        self._wake_capacity()

    # -- housekeeping ----------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        interval = self._heartbeat_interval
        while True:
            await anyio.sleep(interval)
            if self._sock is not None:
                self._sock.handshake_failures()  # logs failed CURVE handshakes at WARNING
            now = time.monotonic()
            registry = self._registry
            for state in registry.expired(now, self._dead_after):
                self._engine_lost(
                    state, f"sent nothing for {now - state.last_seen:.1f} s (dead_after)"
                )
            for state in list(registry.engines.values()):
                # The nonce is the send time, so that a PONG tells the round trip.
                self._send_control(state.peer, _PING, None, time.monotonic_ns())
            live_peers = {s.peer for s in registry.engines.values()}
            for alias in self._aliases:
                if alias not in live_peers:
                    self._send_control(alias, _PING, None, _HELLO_REQUEST)
            self._reap_orphans()
            self._tracked.prune()
            self._policy.sweep()


_ERROR_HEADER = Header(MessageKind.ERROR, 1)
