"""The call a handler is running: `call_context` and `CallContext` (docs/context.md).

The engine sets a context variable around the handler and its interceptors for each call
(sync handlers read it in their thread: anyio copies the context). What a `CallContext`
reports about the caller was written by the peer: escape it before logging.
"""

from __future__ import annotations

import contextvars
import math
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

import anyio

from tensorrpc._exceptions import NoCallContextError
from tensorrpc._metadata import EMPTY, merge_metadata

if TYPE_CHECKING:
    from collections.abc import Mapping

    from tensorrpc._server_calls import ServerCall

__all__ = ["CallContext", "call_context", "current_or_none", "enter", "leave"]

# The current call, its engine's id and its deadline on time.monotonic()'s clock (the
# call's own is on the event loop's, which a sync handler's thread cannot read): a tuple
# is cheaper to make per call than a CallContext, which call_context() builds when asked.
_Current = tuple["ServerCall", str, float]
_CURRENT: Final[contextvars.ContextVar[_Current]] = contextvars.ContextVar("tensorrpc_call")
_monotonic = time.monotonic


class CallContext:
    """The call a handler runs, as the engine sees it; from `call_context`.

    A view on the live call: `cancelled` and `time_remaining` change as the call goes
    on. Use it only while the call runs (in its handler, its interceptors, its stream);
    each `call_context` returns a new view of the same call.
    """

    __slots__ = ("_call", "_deadline", "_engine_id")

    def __init__(self, call: ServerCall, engine_id: str, deadline: float = math.inf) -> None:
        self._call = call
        self._engine_id = engine_id
        self._deadline = deadline

    @property
    def method(self) -> str:
        """The method called (its bare name, ``"add"``)."""
        return self._call.spec.name

    @property
    def engine_id(self) -> str:
        """The id of the engine running the call."""
        return self._engine_id

    @property
    def caller(self) -> str:
        """The caller's client id, as its WELCOME announced it (or its address before).

        The client chose it: a hint for logs, not an identity (escape it before logging).
        """
        return self._call.session.name

    @property
    def call_id(self) -> int:
        """The call's id, unique among the caller's calls in flight."""
        return self._call.call_id

    @property
    def metadata(self) -> Mapping[str, str]:
        """The request metadata the caller sent (read-only; hostile strings)."""
        return self._call.metadata

    @property
    def deadline(self) -> float | None:
        """The call's deadline on ``time.monotonic()``'s clock (None: no deadline)."""
        deadline = self._deadline
        return None if deadline == math.inf else deadline

    def time_remaining(self) -> float | None:
        """Seconds left before the deadline (0.0 once it passed; None: no deadline)."""
        deadline = self._deadline
        if deadline == math.inf:
            return None
        return max(0.0, deadline - _monotonic())

    @property
    def cancelled(self) -> bool:
        """Whether the caller gave up on the call (CANCEL, its session ended) or the
        engine is stopping it at shutdown: whatever the handler returns is not sent."""
        call = self._call
        return call.cancelled or call.shutdown

    @property
    def response_metadata(self) -> Mapping[str, str]:
        """The response metadata set so far (read-only)."""
        current = self._call.reply_metadata
        return EMPTY if not current else MappingProxyType(dict(current))

    def set_response_metadata(self, metadata: Mapping[str, str]) -> None:
        """Add ``metadata`` to the response metadata (a key set twice keeps the later
        value). It travels with the RESULT (unary) or the STREAM_END (stream); a call
        that ends with an error sends none.

        Raises:
            MetadataError: A key or value breaks a rule, or the whole would be over the
                bounds (nothing is changed then).
        """
        call = self._call
        call.reply_metadata = merge_metadata(
            call.reply_metadata or {}, metadata, "response metadata"
        )

    def __repr__(self) -> str:
        return f"<CallContext {self.method} call {self.call_id} on {self._engine_id!r}>"


def call_context() -> CallContext:
    """The context of the call the current handler (or engine interceptor) is running.

    Works in async and sync handlers, streams and interceptors, on asyncio and trio.

    Raises:
        NoCallContextError: Not inside a call's handler (a batched handler serves
            several calls: it reads ``current_batch().items[i].context``).
    """
    try:
        current = _CURRENT.get()
    except LookupError:
        raise NoCallContextError(
            "call_context() is only available while a handler runs a call (in a batched "
            "handler, read current_batch().items[i].context)"
        ) from None
    return CallContext(*current)


def current_or_none() -> CallContext | None:
    """The current call's context, or None outside a call."""
    current = _CURRENT.get(None)
    return None if current is None else CallContext(*current)


def enter(call: ServerCall, engine_id: str) -> contextvars.Token[_Current]:
    """Make ``call`` the current call (the engine's worker, before the handler)."""
    deadline = call.deadline
    if deadline != math.inf:  # the event loop's clock -> time.monotonic()'s
        deadline = _monotonic() + (deadline - anyio.current_time())
    return _CURRENT.set((call, engine_id, deadline))


def leave(token: contextvars.Token[_Current]) -> None:
    """Undo `enter` (the worker, after the handler)."""
    _CURRENT.reset(token)
