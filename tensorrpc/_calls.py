"""The client's call table, sans-I/O: one record per call, one state, reply legality, credit.

Rules the table keeps (a hypothesis state machine in tests/unit checks them):

1. A call is in the table exactly while its state is ``IN_FLIGHT`` or ``STREAMING``; it
   ends exactly once (``end`` of an ended call does nothing and says so), and ending it
   takes it out of the table and out of its engine's in-flight set in the same step.
2. A reply is delivered only to the call with its call id *and* only if it came from the
   engine that call was sent to; anything else (late, foreign, unknown id) is dropped.
3. A unary call accepts exactly one RESULT or ERROR. A streaming call accepts
   STREAM_ITEMs, then exactly one STREAM_END or ERROR. A RESULT for a stream or a stream
   message for a unary call ends the call with `tensorrpc.RemoteProtocolError`.
4. Credit: an engine may have sent at most ``window + granted`` items of a stream, where
   ``granted`` is the sum of the CREDITs the client sent. An item beyond that ends the
   stream with `tensorrpc.RemoteProtocolError`; the engine's remaining credit, as
   the client counts it, is never negative.
5. Nothing is sent for a call after it ended, except the one CANCEL that tells the engine
   the caller gave up (a cancelled call ends in ``CANCELLED`` before its CANCEL goes).

The table holds what the I/O shell attaches to a call (its waiter, argument leases) as
opaque slots; it never looks at them.
"""

from __future__ import annotations

import collections
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Final

from tensorrpc._exceptions import EngineDeadError, RemoteProtocolError
from tensorrpc._protocol import MessageKind
from tensorrpc._streams import RequestCredit

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from typing_extensions import Buffer

    from tensorrpc._engines import Engine
    from tensorrpc._service import MethodSpec

__all__ = ["Call", "CallState", "CallTable", "StreamCredit"]

_EMPTY: Final = b""
_RESULT: Final = MessageKind.RESULT
_ERROR: Final = MessageKind.ERROR
_STREAM_ITEM: Final = MessageKind.STREAM_ITEM
_STREAM_END: Final = MessageKind.STREAM_END


class CallState(IntEnum):
    """Where one call stands; the last three are final."""

    #: The CALL was sent; nothing came back yet.
    IN_FLIGHT = 1
    #: A streaming call that received at least one item.
    STREAMING = 2
    #: Ended by the engine's final reply (RESULT, ERROR or STREAM_END).
    REPLIED = 3
    #: Ended here with an error: engine dead or gone, protocol violation, client closed.
    FAILED = 4
    #: Ended because the caller gave up (cancelled, timed out, closed a stream).
    CANCELLED = 5


_IN_FLIGHT: Final = CallState.IN_FLIGHT
_STREAMING: Final = CallState.STREAMING
_REPLIED: Final = CallState.REPLIED
_FAILED: Final = CallState.FAILED
_CANCELLED: Final = CallState.CANCELLED


class StreamCredit:
    """Flow-control credit on the client side of one stream.

    The engine may send ``window`` items plus whatever the client granted. The client
    grants credit in batches of about half a window as the consumer takes items, so that
    the engine keeps streaming while the consumer keeps up and stops when it does not.

    Args:
        window: Initial credit the engine was given (WELCOME's ``stream_window``).
    """

    __slots__ = ("_batch", "_pending", "granted", "received", "window")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("stream window must be at least 1")
        self.window = window
        self._batch = max(1, window // 2)
        self._pending = 0
        #: Sum of the CREDITs sent.
        self.granted = 0
        #: Items received.
        self.received = 0

    @property
    def remaining(self) -> int:
        """Items the engine may still send before it needs more credit (never negative)."""
        return self.window + self.granted - self.received

    def consumed(self, n: int = 1) -> int:
        """Record that the consumer took ``n`` items.

        Returns:
            The credit to send to the engine now (0: send nothing yet).
        """
        self._pending += n
        if self._pending >= self._batch:
            grant, self._pending = self._pending, 0
            self.granted += grant
            return grant
        return 0


class Call:
    """One call: where it went, its state, and what came back.

    The I/O shell owns ``waiter`` (what wakes the caller) and ``observed``; the table
    only carries them. ``lease`` (the argument tensors' torch_shm lease while the engine
    may read them), ``placed`` (tensors and bytes that went by shared memory) and
    ``releases`` (result lease ids its CALL header carried) are the protocol's.
    """

    __slots__ = (
        "call_id",
        "counted",
        "credit",
        "engine",
        "error",
        "items",
        "lease",
        "observed",
        "placed",
        "releases",
        "reply_buffers",
        "reply_kind",
        "reply_metadata",
        "reply_payload",
        "request",
        "spec",
        "state",
        "waiter",
    )

    def __init__(self, call_id: int, engine: Engine, spec: MethodSpec, waiter: Any) -> None:
        self.call_id = call_id
        self.engine = engine
        self.spec = spec
        self.waiter = waiter
        self.state = _IN_FLIGHT
        #: The final reply's kind (RESULT, ERROR or STREAM_END) once REPLIED.
        self.reply_kind: MessageKind | None = None
        self.reply_payload: Buffer = _EMPTY
        self.reply_buffers: Sequence[Buffer] = ()
        #: The response metadata the final RESULT or STREAM_END carried (None: none).
        self.reply_metadata: Mapping[str, str] | None = None
        #: Why the call FAILED (or None).
        self.error: BaseException | None = None
        #: Streams only: items received and not yet taken; the credit.
        self.items: collections.deque[tuple[Buffer, Sequence[Buffer]]] | None = None
        self.credit: StreamCredit | None = None
        #: Calls whose request is a stream: the request items' credit.
        self.request: RequestCredit | None = None
        self.lease: int | None = None
        self.placed = (0, 0)
        self.releases: tuple[int, ...] = ()
        #: What the client's observer watches of this call (None: no observer).
        self.observed: Any = None
        #: The client's counters of this call and when it was sent, until the caller's
        #: end is counted (`ClientProtocol.call_ended`).
        self.counted: tuple[Any, float] | None = None

    @property
    def ended(self) -> bool:
        """Whether the call has ended (REPLIED, FAILED or CANCELLED)."""
        return self.state >= _REPLIED

    @property
    def stream(self) -> bool:
        """Whether this is a streaming call."""
        return self.items is not None

    def __repr__(self) -> str:
        return f"<Call {self.call_id} {self.spec.name} {self.state.name} on {self.engine}>"


class CallTable:
    """The calls in flight of one client, by call id.

    Call ids start at 1 and are never reused while the table lives.
    """

    __slots__ = ("_calls", "_next_id")

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._calls)

    def get(self, call_id: int) -> Call | None:
        """The call in flight with this id, if any."""
        return self._calls.get(call_id)

    def open(
        self, engine: Engine, spec: MethodSpec, waiter: Any, *, stream: bool, window: int
    ) -> Call:
        """Enter a new call to ``engine`` (the caller then sends its CALL)."""
        call_id = self._next_id
        self._next_id = call_id + 1
        call = Call(call_id, engine, spec, waiter)
        if stream:
            call.items = collections.deque()
            call.credit = StreamCredit(window)
        if spec.request_streaming:
            call.request = RequestCredit(engine.info.stream_window)
        self._calls[call_id] = call
        engine.calls.add(call_id)
        engine.calls_total += 1
        return call

    def end(self, call: Call, state: CallState, error: BaseException | None = None) -> bool:
        """End ``call`` in a final ``state``; False (and no change) if it had ended.

        Ending takes the call out of the table and out of its engine's in-flight set.
        """
        if call.state >= _REPLIED:
            return False
        call.state = state
        if error is not None:
            call.error = error
            call.engine.errors += 1
        del self._calls[call.call_id]
        call.engine.calls.discard(call.call_id)
        return True

    def reply(
        self,
        engine: Engine,
        kind: MessageKind,
        call_id: int,
        payload: Buffer,
        buffers: Sequence[Buffer],
    ) -> Call | None:
        """Apply a reply (RESULT, ERROR, STREAM_ITEM or STREAM_END) from ``engine``.

        Returns:
            The call it concerns (its state says what happened: an item was queued, it
            ended with the reply, or it FAILED on a protocol violation), or ``None`` when
            the reply is dropped (unknown, finished or another engine's call).
        """
        call = self._calls.get(call_id)
        if call is None or call.engine is not engine:
            return None
        items = call.items
        if items is None:
            if kind is _RESULT or kind is _ERROR:
                self._replied(call, kind, payload, buffers)
            else:
                self._violation(call, f"{kind.name} for a unary call")
            return call
        if kind is _STREAM_ITEM:
            credit = call.credit
            assert credit is not None
            if credit.remaining <= 0:
                self._violation(
                    call,
                    f"engine {engine.engine_id!r} sent more stream items than the window "
                    f"({credit.window}) and its credit allow",
                )
                return call
            credit.received += 1
            call.state = _STREAMING
            items.append((payload, buffers))
        elif kind is _STREAM_END or kind is _ERROR:
            self._replied(call, kind, payload, _EMPTY_BUFFERS)
        else:
            self._violation(call, "RESULT for a streaming call")
        return call

    def _replied(
        self, call: Call, kind: MessageKind, payload: Buffer, buffers: Sequence[Buffer]
    ) -> None:
        if kind is _ERROR:
            call.engine.errors += 1
        call.reply_kind = kind
        call.reply_payload = payload
        call.reply_buffers = buffers
        call.state = _REPLIED
        del self._calls[call.call_id]
        call.engine.calls.discard(call.call_id)

    def _violation(self, call: Call, message: str) -> None:
        self.end(call, _FAILED, RemoteProtocolError(message))

    def fail_engine(self, engine: Engine, why: str) -> list[Call]:
        """End every call in flight to ``engine`` with EngineDeadError.

        Returns:
            The calls that ended here (their waiters need waking).
        """
        ended: list[Call] = []
        for call_id in sorted(engine.calls):
            call = self._calls[call_id]  # rule 1: the engine's calls are all in the table
            self.end(
                call,
                _FAILED,
                EngineDeadError(
                    f"engine {engine.engine_id!r} {why} while {call.spec.qualname} was in flight",
                    engine_id=engine.engine_id,
                ),
            )
            ended.append(call)
        return ended

    def fail_all(self, error_factory: type[BaseException], message: str) -> list[Call]:
        """End every call in the table with ``error_factory(message)`` (client closed)."""
        ended = list(self._calls.values())
        for call in ended:
            self.end(call, _FAILED, error_factory(message))
        return ended


_EMPTY_BUFFERS: Final[tuple[Buffer, ...]] = ()
