"""A blocking client for scripts and notebooks: the async `Client` on a background loop
(docs/client.md, "Blocking client").

`BlockingClient` runs an anyio ``BlockingPortal`` on a daemon thread of its own and turns
each call into "run this coroutine on that loop and wait for its result"; a client that
is neither closed nor in a ``with`` is closed by a ``weakref.finalize`` (at GC or exit).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import weakref
from collections.abc import AsyncIterable, Iterable
from types import MappingProxyType, TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    Literal,
    NoReturn,
    ParamSpec,
    Self,
    TypeVar,
    cast,
    overload,
)

import anyio
import anyio.to_thread
from anyio.from_thread import BlockingPortal

from tensorrpc._client import CallStream, CallView, Client, ClientStatistics, EngineInfo
from tensorrpc._exceptions import ClosedError
from tensorrpc._views import KEEP, Keep

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

    from tensorrpc._compression import Compression
    from tensorrpc._health import HealthStatus
    from tensorrpc._service import ServiceSpec
    from tensorrpc.transports import TransportName

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

#: How long ``close()`` waits for the client to say BYE and the loop thread to end.
CLOSE_TIMEOUT = 10.0
#: How long the constructor waits for the background loop to start.
START_TIMEOUT = 30.0


class _Runner:
    """The loop thread, its portal and the open client; owns the shutdown sequence.

    Kept apart from `BlockingClient` so that the finalizer holds no reference to the
    user's object (it would never be collected otherwise).
    """

    def __init__(self, make_client: Callable[[], Client[Any]], backend: str) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, args=(backend,), name="tensorrpc-blocking-client", daemon=True
        )
        self._thread.start()
        try:
            self.portal = self._ready.result(timeout=START_TIMEOUT)
        except BaseException:
            self._thread.join(timeout=CLOSE_TIMEOUT)
            raise
        self._client_cm: contextlib.AbstractContextManager[Client[Any]] | None = None
        try:
            client = self.portal.call(make_client)
            cm = self.portal.wrap_async_context_manager(client)
            self.client = cm.__enter__()
            self._client_cm = cm
        except BaseException:
            self.close()
            raise

    def _main(self, backend: str) -> None:
        async def serve() -> None:
            try:
                async with BlockingPortal() as portal:
                    self._ready.set_result(portal)
                    await portal.sleep_until_stopped()
            except BaseException as exc:
                if not self._ready.done():
                    self._ready.set_exception(exc)
                raise

        with contextlib.suppress(BaseException):
            # Whatever ends the loop has already been reported to the caller (set_exception
            # above, or the result of the call that failed).
            anyio.run(serve, backend=backend)

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the loop and wait for it; cancel it if the wait is interrupted."""
        if self._closed:
            raise ClosedError("the client was closed")
        future = self.portal.start_task_soon(fn)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt in the caller's thread: cancel the call on the loop (anyio
            # cancels the task's scope, and the client sends CANCEL to the engine).
            future.cancel()
            raise

    def run_sync(self, fn: Callable[[], T]) -> T:
        """Run a plain function on the loop's thread (to read the client's state safely)."""
        if self._closed:
            raise ClosedError("the client was closed")
        return self.portal.call(fn)

    def close(self) -> None:
        """Close the client (BYE to every engine), stop the loop, join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if threading.current_thread() is self._thread:
            raise RuntimeError("a BlockingClient cannot be closed from its own loop thread")
        try:
            cm, self._client_cm = self._client_cm, None
            if cm is not None:
                with contextlib.suppress(Exception):
                    cm.__exit__(None, None, None)
        finally:
            if self._ready.done() and self._ready.exception() is None:
                with contextlib.suppress(RuntimeError):  # the loop already ended
                    self.portal.call(self.portal.stop, True)
            self._thread.join(timeout=CLOSE_TIMEOUT)


_Args = tuple[tuple[Any, ...], dict[str, Any]]


async def _pulled_in_thread(items: Iterable[Any]) -> AsyncIterator[Any]:
    """The caller's plain iterable as request items, each pulled in a worker thread (so
    that a slow or blocking iterator never stalls the client's loop)."""
    iterator = iter(items)
    done = object()
    while True:
        item = await anyio.to_thread.run_sync(next, iterator, done)
        if item is done:
            return
        yield item


def _threaded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Args:
    """A request-streaming call's one argument, an iterable, pulled in a worker thread."""
    if len(args) == 1 and not kwargs and _plain(args[0]):
        return (_pulled_in_thread(args[0]),), kwargs
    if not args and len(kwargs) == 1:
        ((name, items),) = kwargs.items()
        if _plain(items):
            return (), {name: _pulled_in_thread(items)}
    return args, kwargs  # the async client says what is wrong with them


def _plain(items: object) -> bool:
    return isinstance(items, Iterable) and not isinstance(items, str | bytes | AsyncIterable)


def _request_items(
    runner: _Runner, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _Args:
    """``method``'s arguments, its request items pulled in a worker thread if it takes them."""
    spec = runner.client.service.methods.get(getattr(method, "__name__", ""))
    return (
        _threaded(args, kwargs) if spec is not None and spec.request_streaming else (args, kwargs)
    )


class _ClosesOnExit:
    """``with obj:`` returns ``obj`` and calls ``obj.close()`` on the way out."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class BlockingStream(_ClosesOnExit, Generic[T]):
    """The items of one streaming call as a plain iterator (and context manager).

    The call is sent on the first ``next()``. Leave early with ``close()`` or by leaving
    its ``with`` block: the engine's generator is cancelled at once. A stream that is
    dropped is cancelled on the engine soon after it is garbage-collected, as for
    [`CallStream`][tensorrpc.CallStream].
    """

    __slots__ = ("__weakref__", "_runner", "_stream")

    def __init__(self, runner: _Runner, stream: CallStream[T]) -> None:
        self._runner = runner
        self._stream = stream

    @property
    def engine(self) -> str | None:
        """The id of the engine serving this stream (``None`` until the first item)."""
        return self._stream.engine

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        stream = self._stream

        async def step() -> tuple[bool, T | None]:
            try:
                return True, await stream.__anext__()
            except StopAsyncIteration:
                return False, None

        more, item = self._runner.run(step)
        if not more:
            raise StopIteration
        return cast("T", item)

    def close(self) -> None:
        """Stop the stream; the engine's generator is cancelled at once (idempotent)."""
        if not self._runner.closed:
            self._runner.run(self._stream.aclose)


def _open_stream(runner: _Runner, make: Callable[[], CallStream[T]]) -> BlockingStream[T]:
    """Make a stream on the loop's thread (it sends nothing yet) and wrap it."""
    return BlockingStream(runner, runner.run_sync(make))


class BlockingCallView(Generic[S]):
    """The blocking twin of [`CallView`][tensorrpc.CallView]: the same methods, returning
    results and [`BlockingStream`][tensorrpc.BlockingStream]s."""

    __slots__ = ("__weakref__", "_runner", "_view")

    def __init__(self, runner: _Runner, view: CallView[S]) -> None:
        self._runner = runner
        self._view = view

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
    ) -> BlockingCallView[S]:
        """A view whose calls use these options (as
        [`CallView.with_options`][tensorrpc.CallView.with_options])."""
        view = self._view.with_options(
            engine=engine,
            timeout=timeout,
            wait=wait,
            transport=transport,
            wait_for_ready=wait_for_ready,
            metadata=metadata,
            compression=compression,
        )
        return BlockingCallView(self._runner, view)

    def stub(self) -> BlockingStub[S]:
        """A [`BlockingStub`][tensorrpc.BlockingStub] whose calls use this view's options:
        ``stub.add(1, 2)`` is the result, ``stub.count(5)`` a
        [`BlockingStream`][tensorrpc.BlockingStream]."""
        return _BlockingStub(self._runner, self._view, self._runner.client.service)

    @overload
    def call(
        self,
        method: Callable[Concatenate[Any, P], Awaitable[R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R: ...

    @overload
    def call(
        self,
        method: Callable[Concatenate[Any, P], AsyncIterator[Any]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> NoReturn: ...

    @overload
    def call(
        self,
        method: Callable[Concatenate[Any, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R: ...

    def call(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call one method with one result and wait for it, typed from the service's method.

        ``client.call(Calculator.add, 1, 2)`` checks the arguments against
        ``Calculator.add`` and returns its result, raising as
        [`CallView.call`][tensorrpc.CallView.call] does. Interrupting the wait (Ctrl-C)
        cancels the call on the engine. A client-streaming method takes a plain iterable
        of its request items (``client.call(Files.upload, chunks)``), pulled in a worker
        thread as the engine's credit allows.
        """
        args, kwargs = _request_items(self._runner, method, args, kwargs)
        return self._runner.run(functools.partial(self._view.call, method, *args, **kwargs))

    @overload
    def call_with_metadata(
        self,
        method: Callable[Concatenate[Any, P], Awaitable[R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[R, Mapping[str, str]]: ...

    @overload
    def call_with_metadata(
        self,
        method: Callable[Concatenate[Any, P], AsyncIterator[Any]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> NoReturn: ...

    @overload
    def call_with_metadata(
        self,
        method: Callable[Concatenate[Any, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[R, Mapping[str, str]]: ...

    def call_with_metadata(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`call`, also returning the response metadata the engine sent with the result.

        ``value, metadata = client.call_with_metadata(Greeter.hello, "ada")``; the metadata
        is empty when the engine sent none (docs/context.md).
        """
        args, kwargs = _request_items(self._runner, method, args, kwargs)
        call = functools.partial(self._view.call_with_metadata, method, *args, **kwargs)
        return self._runner.run(call)

    def stream(
        self,
        method: Callable[Concatenate[Any, P], AsyncIterator[T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> BlockingStream[T]:
        """Start a streaming call: ``for item in client.stream(Calc.count, 5): ...``.

        A bidirectional method takes a plain iterable of its request items
        (``client.stream(Chat.talk, lines)``), pulled in a worker thread as the engine's
        credit allows while the response is read.
        """
        given, named = _request_items(self._runner, method, args, kwargs)
        start = functools.partial(self._view.stream, method, *given, **named)
        return _open_stream(self._runner, start)

    def broadcast(self, method: str, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call a unary method on every live engine concurrently; ``{engine id: result}``.

        As [`CallView.broadcast`][tensorrpc.CallView.broadcast], waiting for the results.
        """
        return self._runner.run(functools.partial(self._view.broadcast, method, *args, **kwargs))

    def call_by_name(self, method: str, arguments: Mapping[str, Any] | None = None, /) -> Any:
        """Call a unary method by name, with its arguments given by name, and wait.

        See [`CallView.call_by_name`][tensorrpc.CallView.call_by_name].
        """
        return self._runner.run(functools.partial(self._view.call_by_name, method, arguments))

    def stream_by_name(
        self, method: str, arguments: Mapping[str, Any] | None = None, /
    ) -> BlockingStream[Any]:
        """Start a streaming call by name, with its arguments given by name."""
        start = functools.partial(self._view.stream_by_name, method, arguments)
        return _open_stream(self._runner, start)


class BlockingStub(Generic[S]):
    """The blocking twin of [`Stub`][tensorrpc.Stub]: attributes call the ``@rpc``
    methods of ``S`` and wait (typed by the mypy plugin ``tensorrpc.mypy_plugin``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        raise AttributeError(f"{type(self).__name__} has no rpc method {name!r}")


class _BlockingStub(BlockingStub[Any]):
    """Runtime object behind [`BlockingCallView.stub`][tensorrpc.BlockingCallView.stub]."""

    __slots__ = ("__dict__", "_async_stub", "_runner", "_spec")

    def __init__(self, runner: _Runner, view: CallView[Any], spec: ServiceSpec) -> None:
        self._runner = runner
        self._spec = spec
        self._async_stub: Any = view.stub()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = self._spec.methods.get(name)
        if method is None or name.startswith("_"):
            raise AttributeError(f"service {self._spec.name!r} has no rpc method {name!r}")
        async_fn: Callable[..., Any] = getattr(self._async_stub, name)
        runner = self._runner

        def fn(*args: Any, **kwargs: Any) -> Any:
            if method.request_streaming:
                args, kwargs = _threaded(args, kwargs)
            call = functools.partial(async_fn, *args, **kwargs)
            return _open_stream(runner, call) if method.streaming else runner.run(call)

        fn.__name__ = name
        fn.__qualname__ = async_fn.__qualname__
        fn.__doc__ = async_fn.__doc__
        self.__dict__[name] = fn  # later lookups skip __getattr__
        return fn

    def __repr__(self) -> str:
        return f"<blocking {self._async_stub!r}>"


class BlockingClient(_ClosesOnExit, BlockingCallView[S]):
    """A blocking [`Client`][tensorrpc.Client] for scripts, notebooks and sync code.

    An async client on an event loop of its own in a background thread (docs/client.md,
    "Blocking client"): usable from any thread, even one whose loop runs. It is open once
    made; close it with ``close()`` or ``with`` (else at garbage collection or exit).

        with BlockingClient(Calculator, connect="tcp://127.0.0.1:5555") as client:
            client.wait_for_engines(1, timeout=10)
            print(client.call(Calculator.add, 1, 2))

    Args:
        service: The ``@service`` class (its schema fingerprint must match the engines').
        bind: Address(es) to bind; engines dial in.
        connect: Address(es) of engines that listen.
        backend: The background loop: ``"asyncio"`` (default) or ``"trio"``.
        **options: Any other keyword argument of [`Client`][tensorrpc.Client]
            (``max_in_flight``, ``curve``, ``torch_shm``, ...).

    Raises:
        ConnectError: An address is malformed or already in use.
        ValueError: Inconsistent arguments.
    """

    __slots__ = ("_finalizer",)

    def __init__(
        self,
        service: type[S],
        *,
        bind: str | Sequence[str] | None = None,
        connect: str | Sequence[str] | None = None,
        backend: Literal["asyncio", "trio"] = "asyncio",
        **options: Any,
    ) -> None:
        def make() -> Client[Any]:
            return Client(service, bind=bind, connect=connect, **options)

        self._init(make, backend)

    def _init(self, make: Callable[[], Client[Any]], backend: str) -> None:
        runner = _Runner(make, backend)
        super().__init__(runner, runner.client)
        # Closes the client at GC or at interpreter exit; holds the runner, not self.
        self._finalizer = weakref.finalize(self, runner.close)

    @classmethod
    def dynamic(
        cls,
        *,
        bind: str | Sequence[str] | None = None,
        connect: str | Sequence[str] | None = None,
        backend: Literal["asyncio", "trio"] = "asyncio",
        **options: Any,
    ) -> BlockingClient[Any]:
        """A blocking schemaless client (see [`Client.dynamic`][tensorrpc.Client.dynamic]).

        Takes the arguments of the constructor less ``service``; call it with
        ``call_by_name`` and ``stream_by_name``.
        """
        self: BlockingClient[Any] = cls.__new__(cls)

        def make() -> Client[Any]:
            return Client.dynamic(bind=bind, connect=connect, **options)

        self._init(make, backend)
        return self

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the client (BYE to every engine; calls in flight raise ClosedError).

        Stops the background loop and joins its thread. Idempotent.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True once the client is closed."""
        return self._runner.closed

    # -- state ------------------------------------------------------------------------------

    @property
    def service(self) -> ServiceSpec:
        """The service spec this client calls."""
        return self._runner.client.service

    @property
    def schemaless(self) -> bool:
        """True for a client made by [`dynamic`][tensorrpc.BlockingClient.dynamic]."""
        return self._runner.client.schemaless

    @property
    def client_id(self) -> str:
        """This client's id, as sent to engines in WELCOME."""
        return self._runner.client.client_id

    @property
    def addresses(self) -> tuple[str, ...]:
        """The addresses actually bound (ephemeral ports resolved)."""
        return self._runner.client.addresses

    @property
    def engines(self) -> Mapping[str, EngineInfo]:
        """The live engines: engine id -> what the engine said in HELLO (a snapshot)."""
        client = self._runner.client
        return self._runner.run_sync(lambda: MappingProxyType(dict(client.engines)))

    @property
    def rejected(self) -> Mapping[str, str]:
        """Engine id -> why it was refused at handshake (latest refusal)."""
        client = self._runner.client
        return self._runner.run_sync(lambda: MappingProxyType(dict(client.rejected)))

    def statistics(self) -> ClientStatistics:
        """Counters per engine and for the whole client (a frozen snapshot)."""
        return self._runner.run_sync(self._runner.client.statistics)

    def wait_for_engines(
        self, count: int = 1, *, timeout: float | None = None
    ) -> Mapping[str, EngineInfo]:
        """Wait until at least ``count`` engines are live; the live engines.

        As [`Client.wait_for_engines`][tensorrpc.Client.wait_for_engines].
        """
        client = self._runner.client
        return self._runner.run(functools.partial(client.wait_for_engines, count, timeout=timeout))

    def health(
        self, engine: str | None = None, *, service: str = "", timeout: float | None = 5.0
    ) -> HealthStatus:
        """Ask one engine for its health (see [`Client.health`][tensorrpc.Client.health])."""
        client = self._runner.client
        return self._runner.run(
            functools.partial(client.health, engine, service=service, timeout=timeout)
        )

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<BlockingClient of {self.service.name} ({state})>"
