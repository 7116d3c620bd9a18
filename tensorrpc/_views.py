"""The user-facing call surface: options, views, stubs, streams and statistics.

`CallView` (and `tensorrpc.Client`, which is one) turns typed method calls
into calls on the client's I/O shell; `CallStream` is one streaming call;
the statistics classes are frozen snapshots. Nothing here touches a socket.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    Literal,
    NoReturn,
    ParamSpec,
    TypeVar,
    cast,
    overload,
)

import anyio

from tensorrpc import _compression
from tensorrpc._interceptors import ClientCall
from tensorrpc._metadata import EMPTY, check_metadata, encode_block
from tensorrpc._stream_io import RequestSource, request_source
from tensorrpc._stub import Stub
from tensorrpc.transports._policy import TRANSPORTS, TransportName, TransportStatistics

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
    from types import TracebackType
    from typing import Self

    from tensorrpc import _codec
    from tensorrpc._calls import Call
    from tensorrpc._client import Client
    from tensorrpc._compression import Compression
    from tensorrpc._service import MethodSpec

__all__ = [
    "CallOptions",
    "CallStream",
    "CallView",
    "ClientStatistics",
    "EngineStatistics",
]

S = TypeVar("S")
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Keep(enum.Enum):
    """The default of `CallView.with_options`: keep the view's value of that option."""

    KEEP = "keep"


KEEP = Keep.KEEP


@dataclass(frozen=True, slots=True)
class CallOptions:
    """Per-call options; set through `Client.stub` or `Client.with_options`.

    Attributes:
        engine: Send to this engine id; ``None`` balances over the live engines.
        timeout: Deadline in seconds for the whole call (waiting for capacity, the
            round trip, and for a stream every item); ``None`` for none.
        wait: When the client's per-engine in-flight bound is reached, or an engine
            answers that its queue is full, wait and retry (bounded by the deadline);
            ``False`` raises `tensorrpc.OverloadedError` at once and asks the
            engine to refuse rather than queue.
        transport: Tensor transport for arguments and results: ``"auto"`` (default:
            ``torch_shm`` for tensors of at least ``shm_threshold`` bytes when the engine
            is on this host and can attach to our shared memory, frames otherwise),
            ``"frames"`` or ``"torch_shm"`` (every out-of-band tensor by shared memory
            when possible, else frames, counted as a fallback). See docs/transports.md.
        wait_for_ready: When no engine for the call is live, wait for one instead of
            failing (gRPC's wait-for-ready). ``None`` (default): only within the call's
            ``timeout``, if it has one; ``True``: even without a timeout; ``False``:
            never. A call that gives up raises `tensorrpc.EngineNotFoundError` saying why.
        compression: Compress the arguments' payload and tensor frames, and ask the
            engine to compress the results', with zstd (a `Compression`, or ``None``:
            never). Only to an engine that announced zstd, only payloads and tensors of at
            least ``min_bytes``, never what travels by ``torch_shm``. See
            docs/compression.md.
        metadata: Request metadata sent with each call (key → value; keys lowercase
            ``[a-z0-9._-]``, values ``str`` without control characters, bounded: see
            docs/context.md). Checked here: `tensorrpc.MetadataError`.
    """

    engine: str | None = None
    timeout: float | None = None
    wait: bool = True
    transport: TransportName = "auto"
    wait_for_ready: bool | None = None
    compression: Compression | None = None
    metadata: Mapping[str, str] | None = field(default=None, hash=False)
    # The metadata's header block, encoded once here (b"": none).
    _block: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.metadata is not None:
            checked = check_metadata(self.metadata, "request metadata")
            object.__setattr__(self, "metadata", MappingProxyType(checked))
            object.__setattr__(self, "_block", encode_block(checked))
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {self.transport!r}; expected one of {sorted(TRANSPORTS)}"
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
        methods: Per method: ``calls`` started, ``items`` (stream items taken),
            ``outcomes`` (``"ok"``, ``"cancelled"``, an ERROR code's name, see
            docs/observability.md) and ``duration`` (send to result, as sparse
            ``[bucket, count]`` pairs on the engine's latency scale) with
            ``duration_sum_s``.
        events: ``"joined"``, ``"rejoined"`` and ``"lost"``: how often each happened.
        heartbeat_rtt: Heartbeat PING round trips (sparse ``[bucket, count]`` pairs).
        heartbeat_rtt_sum_s: Their sum in seconds.
    """

    engine_id: str
    live: bool
    calls: int
    errors: int
    in_flight: int
    bytes_sent: int
    bytes_received: int
    methods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    events: Mapping[str, int] = field(default_factory=dict)
    heartbeat_rtt: Sequence[Sequence[int]] = ()
    heartbeat_rtt_sum_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ClientStatistics:
    """A snapshot of a client's state, from `Client.statistics`.

    Attributes:
        engines: Per engine id counters, for every engine seen since the client opened.
        calls_in_flight: Calls in flight over all engines.
        waiting_for_capacity: Callers waiting for an in-flight slot.
        rejected: Engine id → why it was refused at handshake (the latest 64).
        overload_retries: Calls an engine refused as OVERLOADED and the client retried.
    """

    engines: Mapping[str, EngineStatistics]
    calls_in_flight: int
    waiting_for_capacity: int
    rejected: Mapping[str, str]
    overload_retries: int = 0
    #: Per tensor transport: tensors and bytes moved, and fallbacks to frames.
    transports: TransportStatistics = field(default_factory=TransportStatistics)
    #: Engines refused at handshake since the client opened (``rejected`` keeps only
    #: the latest 64, each text cut to 2048 characters).
    rejected_total: int = 0


# ----------------------------------------------------------------------------- user views


class CallView(Generic[S]):
    """Calls on a client with a fixed set of `CallOptions`.

    `Client` is itself a view with the default options; `with_options`
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
        engine: str | Keep | None = KEEP,
        timeout: float | Keep | None = KEEP,
        wait: bool | Keep = KEEP,
        transport: TransportName | Keep = KEEP,
        wait_for_ready: bool | Keep | None = KEEP,
        metadata: Mapping[str, str] | Keep | None = KEEP,
        compression: Compression | Literal["zstd"] | Keep | None = KEEP,
    ) -> CallView[S]:
        """A view on the same client whose calls use these options.

        An option not given keeps this view's value, so views chain:
        ``client.with_options(timeout=5).with_options(engine="e1")`` has both; pass
        ``None`` to clear one (``timeout=None``: no deadline). The client itself is the
        view with the defaults of `CallOptions`.

        The options are the attributes of `CallOptions`; ``compression`` also takes
        ``"zstd"`` (needs the ``compression`` extra).

        Raises:
            MetadataError: ``metadata`` breaks a rule or a bound.
        """
        given = {
            "engine": engine,
            "timeout": timeout,
            "wait": wait,
            "transport": transport,
            "wait_for_ready": wait_for_ready,
            "metadata": metadata,
        }
        changes: dict[str, Any] = {k: v for k, v in given.items() if v is not KEEP}
        if compression is not KEEP:
            changes["compression"] = _compression.resolve(compression)
        return CallView(self._client, replace(self._options, **changes))

    def stub(self) -> Stub[S]:
        """A [`Stub`][tensorrpc.Stub] of the service whose calls use this view's options:
        ``await stub.add(1, 2)``; ``stub.count(5)`` is a [`CallStream`][tensorrpc.CallStream]."""
        return _Stub(self._client, self._options)

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

    @overload
    async def call_with_metadata(
        self,
        method: Callable[Concatenate[Any, P], Awaitable[R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[R, Mapping[str, str]]: ...

    @overload
    async def call_with_metadata(
        self,
        method: Callable[Concatenate[Any, P], AsyncIterator[Any]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> NoReturn: ...

    @overload
    async def call_with_metadata(
        self,
        method: Callable[Concatenate[Any, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[R, Mapping[str, str]]: ...

    async def call_with_metadata(
        self,
        method: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """`call`, also returning the response metadata the engine sent with the result.

        ``value, metadata = await client.call_with_metadata(Greeter.hello, "ada")``; the
        metadata is empty when the engine sent none (docs/context.md).

        Raises:
            MetadataError: A client interceptor added metadata that breaks a rule.
            CallError: As `call` (and every other error `call` raises).
        """
        client = self._client
        spec = client._method(method, streaming=False)
        details = ClientCall(spec, client._spec.name, self._options)
        result = await client._call(spec, args, kwargs, self._options, None, details)
        return result, details.response_metadata

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

        Raises:
            TypeError: ``method`` is not a streaming method of this client's service.
        """
        spec = self._client._method(method, streaming=True)
        return CallStream(self._client, spec, args, kwargs, self._options)

    async def broadcast(self, method: str, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call a unary method on every live engine concurrently.

        The arguments are encoded once and the same frames go to every engine. The
        ``engine`` option is ignored; the deadline applies to each engine's call.

        Returns:
            ``{engine_id: result}`` for every engine live when the broadcast started.

        Raises:
            BroadcastError: At least one engine failed; ``results`` holds every engine's
                result or exception.
            EngineNotFoundError: No engine is live.
            TypeError: No such unary method.
        """
        return await self._client._broadcast(method, args, kwargs, self._options)

    async def call_by_name(self, method: str, arguments: Mapping[str, Any] | None = None, /) -> Any:
        """Call a unary method by name, with its arguments given by name.

        On a typed client the arguments are bound and checked like `call` and the
        result is typed. On a schemaless client (`Client.dynamic`) the arguments
        travel as a map of name -> value that the engine binds and validates (missing
        ones take their defaults), and the result is returned as decoded (lists, dicts,
        tensors), without conversion.

        Raises:
            MethodNotFoundError: No live engine (or not the targeted one) offers
                ``method``; the message lists what is offered.
            TypeError: ``method`` streams (use `stream_by_name`).
            InvalidArgumentError: The engine refused the arguments (schemaless).
            CallError: As `call`.
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

        Raises:
            MethodNotFoundError: No live engine (or not the targeted one) offers
                ``method``.
            TypeError: ``method`` does not stream (use `call_by_name`).
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

    Raises (from iteration): the same errors as `CallView.call`; a deadline bounds
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
        self._wire: list[Any] | RequestSource | None = None
        if spec.request_streaming:  # a bidirectional stream: its request items
            self._wire = request_source(spec, args, kwargs)
        elif encoded is None:
            self._wire = spec.encode_args(args, dict(kwargs))
        self._call: Call | None = None
        # With client interceptors: the items they returned (None: read the call's).
        self._items: AsyncIterator[Any] | None = None
        self._deadline: float | None = None
        self._finished = False
        # Kept by the finalizer without the client, so that GC never touches the socket.
        self._orphans = client._orphans

    @property
    def engine(self) -> str | None:
        """The id of the engine serving this stream (``None`` until the first item)."""
        return None if self._call is None else self._call.engine.engine_id

    @property
    def response_metadata(self) -> Mapping[str, str]:
        """The response metadata the engine sent with the stream's end (empty until the
        stream ended, or when it sent none)."""
        call = self._call
        if call is None or call.reply_metadata is None:
            return EMPTY
        return call.reply_metadata

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        if self._finished:
            raise StopAsyncIteration
        client = self._client
        try:
            if self._call is None and self._items is None:
                wire, self._wire = self._wire, None
                encoded, self._encoded = self._encoded, None
                if wire is None and encoded is None:
                    raise StopAsyncIteration
                if self._options.timeout is not None:
                    self._deadline = anyio.current_time() + self._options.timeout
                args = (self._spec, wire, self._options, self._deadline, encoded)
                if client._open_stream is None:
                    self._call = await client._start_stream(*args)
                else:  # through the client's interceptors
                    self._call, self._items = await client._open_stream(*args)
            if self._items is not None:
                return cast("T", await self._items.__anext__())
            assert self._call is not None
            return cast("T", await client._next_item(self._call, self._deadline))
        except StopAsyncIteration:
            self._finished = True
            if self._call is not None:
                client._ended(self._call, None)
            raise
        except BaseException as exc:
            self._finished = True
            if self._call is not None:
                client._abandon(self._call)
                client._ended(self._call, exc)
            raise

    async def aclose(self) -> None:
        """Stop the stream; the engine's generator is cancelled at once (idempotent)."""
        self._finished = True
        self._wire = None
        self._encoded = None
        if self._call is not None:
            self._client._abandon(self._call)
            self._client._ended(self._call, None)
        items, self._items = self._items, None
        aclose = getattr(items, "aclose", None)
        if aclose is not None:  # the interceptors' iterators run their finally blocks
            await aclose()

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
        if call is not None and not call.ended:
            # May run on any thread, at any point: only an atomic deque append here. The
            # client's loop sends the CANCEL.
            self._orphans.append(call)
