"""Interceptors: ordered async functions ``(call, proceed) -> result`` around every call.

The first given is the outermost. On the engine ``call`` is the `CallContext` and
``proceed()`` runs the handler (a stream: the whole stream, returning None); on the
client ``call`` is a `ClientCall` and ``proceed()`` sends the call (a stream: returns the
iterator of its items). docs/interceptors.md has the rules, examples and the cost.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

from tensorrpc._metadata import EMPTY, check_metadata, encode_block

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

    from tensorrpc._calls import Call
    from tensorrpc._codec import Encoded
    from tensorrpc._context import CallContext
    from tensorrpc._service import MethodSpec
    from tensorrpc._views import CallOptions

__all__ = [
    "ClientCall",
    "ClientInterception",
    "ClientInterceptor",
    "ServerInterceptor",
    "check_interceptors",
    "intercept",
]


class ServerInterceptor(Protocol):
    """An engine interceptor: ``async def icpt(context, proceed) -> Any``."""

    async def __call__(self, context: CallContext, proceed: Callable[[], Awaitable[Any]], /) -> Any:
        """Run around one call's handler; ``await proceed()`` runs the rest of the chain."""
        ...


class ClientInterceptor(Protocol):
    """A client interceptor: ``async def icpt(call, proceed) -> Any``."""

    async def __call__(self, call: ClientCall, proceed: Callable[[], Awaitable[Any]], /) -> Any:
        """Run around one call; ``await proceed()`` sends it (see the module docs)."""
        ...


class ClientCall:
    """One call as a client interceptor sees it.

    Attributes:
        method: The method's bare name.
        service: The service's name.
        streaming: Whether it is a streaming call.
        timeout: The call's deadline in seconds (its options'), or None.
        metadata: The request metadata: the options' and what interceptors added so far.
            Add keys here before ``proceed()``; it is checked when the call is sent (a
            `tensorrpc.MetadataError` then).
    """

    __slots__ = ("_call", "metadata", "method", "service", "streaming", "timeout")

    def __init__(self, spec: MethodSpec, service: str, options: CallOptions) -> None:
        self.method = spec.name
        self.service = service
        self.streaming = spec.streaming
        self.timeout = options.timeout
        self.metadata: dict[str, str] = dict(options.metadata) if options.metadata else {}
        self._call: Call | None = None

    @property
    def engine(self) -> str | None:
        """The id of the engine the call went to (None until it is sent)."""
        return None if self._call is None else self._call.engine.engine_id

    @property
    def response_metadata(self) -> Mapping[str, str]:
        """The response metadata of the RESULT (once ``proceed()`` returned) or of the
        STREAM_END (once the stream ended); empty before, or when none came."""
        call = self._call
        if call is None or call.reply_metadata is None:
            return EMPTY
        return call.reply_metadata

    def block(self) -> bytes:
        """The metadata block for the CALL (checked now)."""
        if not self.metadata:
            return b""
        return encode_block(check_metadata(self.metadata, "request metadata"))

    def sent(self, call: Call) -> None:
        """The CALL of this attempt went out as ``call``."""
        self._call = call

    def __repr__(self) -> str:
        return f"<ClientCall {self.service}.{self.method}>"


def check_interceptors(interceptors: Sequence[object] | None, where: str) -> tuple[Any, ...]:
    """The interceptors as a tuple, each checked to be callable.

    Raises:
        TypeError: One is not callable.
    """
    out = tuple(interceptors or ())
    for interceptor in out:
        if not callable(interceptor):
            raise TypeError(f"{where} interceptors must be async callables, got {interceptor!r}")
    return out


def intercept(
    interceptors: tuple[Any, ...], call: object, handler: Callable[[], Awaitable[Any]]
) -> Awaitable[Any]:
    """Run ``handler`` through ``interceptors`` (the first is the outermost)."""
    proceed = handler
    for interceptor in reversed(interceptors):
        proceed = functools.partial(interceptor, call, proceed)
    return proceed()


class StreamItems:
    """The items of a stream the client started (what a stream's ``proceed()`` returns).

    A plain async iterator, not a generator: nothing to finalize when it is dropped (the
    stream's `tensorrpc.CallStream` ends the call).
    """

    __slots__ = ("_call", "_deadline", "_next_item")

    def __init__(
        self,
        next_item: Callable[[Call, float | None], Awaitable[Any]],
        call: Call,
        deadline: float | None,
    ) -> None:
        self._next_item = next_item
        self._call = call
        self._deadline = deadline

    def __aiter__(self) -> StreamItems:
        return self

    def __anext__(self) -> Awaitable[Any]:
        return self._next_item(self._call, self._deadline)


class ClientInterception:
    """A client's calls through its interceptors (what its stubs and views call instead
    of `tensorrpc._client_calls` when it has interceptors).

    Args:
        call: Runs a call (`tensorrpc._client_calls.call`, bound to the client's shell).
        start_stream: Starts a stream (`tensorrpc._client_calls.start_stream`, bound).
        next_item: A stream's next item (`tensorrpc._client_calls.next_item`, bound).
        abandon: Gives up on a call (`tensorrpc._client_io.ClientIO.abandon`).
        service: The service's name.
        interceptors: Outermost first.
    """

    __slots__ = ("_abandon", "_call", "_interceptors", "_next_item", "_service", "_start_stream")

    def __init__(
        self,
        call: Callable[..., Awaitable[Any]],
        start_stream: Callable[..., Awaitable[Call]],
        next_item: Callable[[Call, float | None], Awaitable[Any]],
        abandon: Callable[[Call], None],
        service: str,
        interceptors: tuple[Any, ...],
    ) -> None:
        self._call = call
        self._start_stream = start_stream
        self._next_item = next_item
        self._abandon = abandon
        self._service = service
        self._interceptors = interceptors

    async def call(
        self,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        options: CallOptions,
        encoded: Encoded | None = None,
        details: ClientCall | None = None,
    ) -> Any:
        """A unary call through the interceptors (as `tensorrpc._client_calls.call`;
        ``details``: the call as they see it, made here when not given)."""
        if details is None:
            details = ClientCall(spec, self._service, options)
        proceed = functools.partial(self._call, spec, args, kwargs, options, encoded, details)
        return await intercept(self._interceptors, details, proceed)

    async def open_stream(
        self,
        spec: MethodSpec,
        wire: list[Any] | None,
        options: CallOptions,
        deadline: float | None,
        encoded: Encoded | None = None,
    ) -> tuple[Call | None, AsyncIterator[Any]]:
        """Start a stream through the interceptors: its call (None when an interceptor
        answered without proceeding) and the iterator of its items they returned."""
        details = ClientCall(spec, self._service, options)
        opened: list[Call] = []

        async def proceed() -> AsyncIterator[Any]:
            call = await self._start_stream(spec, wire, options, deadline, encoded, details)
            opened.append(call)
            return StreamItems(self._next_item, call, deadline)

        items = await intercept(self._interceptors, details, proceed)
        if not hasattr(items, "__anext__"):
            if opened:
                self._abandon(opened[0])
            raise TypeError(
                f"a client interceptor returned {type(items).__name__!r} for the stream "
                f"{self._service}.{spec.name}: return what proceed() returned (an async "
                "iterator of the items), or one wrapping it"
            )
        return (opened[0] if opened else None), items
