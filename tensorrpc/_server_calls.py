"""The engine's accepted calls, sans-I/O: from admission until a worker is done.

`CallQueue` is the call side of `ServerProtocol`: the admission checks that depend on
the method and on the engine's capacity (the last rows of `ADMISSION`), the queue of
accepted calls waiting for a worker, the count of busy workers, reply legality (rule 7 of
`tensorrpc._server_protocol`) and stream credit (rule 8). The protocol owns the sessions
and hands it the CALLs of live sessions. Nothing here imports zmq, anyio, asyncio, trio,
threading or ``time``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final, Protocol

from tensorrpc._exceptions import ErrorCode
from tensorrpc._protocol import Flags
from tensorrpc._statistics import MethodStatistics
from tensorrpc._streams import RequestStream

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from typing_extensions import Buffer

    from tensorrpc._observe import CallObservation
    from tensorrpc._protocol import Header
    from tensorrpc._server_protocol import ProtocolSettings, Session
    from tensorrpc._service import MethodSpec

__all__ = [
    "ADMISSION",
    "MISSING",
    "CallQueue",
    "Cancellable",
    "Refusal",
    "ServerCall",
    "Settable",
]

_STREAM: Final = int(Flags.STREAM)
_REQUEST_STREAM: Final = int(Flags.REQUEST_STREAM)
_NO_WAIT: Final = int(Flags.NO_WAIT)
# How the client wants its results: torch_shm, compressed (`ServerCall.results`).
_RESULT_BITS: Final = int(Flags.SHM_RESULTS | Flags.SHM_RESULTS_ALL | Flags.COMPRESS)
_INF: Final = float("inf")
#: ``ServerCall.result`` before the handler returned.
MISSING: Final = object()

#: Every refusal of a CALL, in the order the checks run: (check, error code).
ADMISSION: Final[tuple[tuple[str, ErrorCode], ...]] = (
    ("malformed header (readable call id)", ErrorCode.PROTOCOL),
    ("malformed frames", ErrorCode.PROTOCOL),
    ("no session", ErrorCode.PROTOCOL),
    ("call id in flight", ErrorCode.PROTOCOL),
    ("health method: not unary, tensors, or bad arguments", ErrorCode.INVALID_ARGUMENT),
    ("draining", ErrorCode.DRAINING),
    ("unknown method", ErrorCode.METHOD_NOT_FOUND),
    ("STREAM or REQUEST_STREAM flag does not match the method", ErrorCode.INVALID_ARGUMENT),
    ("NO_WAIT and every worker busy", ErrorCode.OVERLOADED),
    ("queue full", ErrorCode.OVERLOADED),
)


#: A refused CALL: the ERROR code and message to answer it with.
Refusal = tuple[ErrorCode, str]


def _kind(spec: MethodSpec) -> str:
    """How a method must be called, for the refusal of a CALL with the wrong flags."""
    if spec.request_streaming:
        return "a bidirectional stream" if spec.streaming else "a client stream"
    return "a stream" if spec.streaming else "a unary call"


class Cancellable(Protocol):
    """What the shell hangs on a call to stop it (its cancel scope)."""

    def cancel(self) -> None:
        """Stop the running handler."""


class Settable(Protocol):
    """What the shell hangs on a call to wake it (the event a stream waits on)."""

    def set(self) -> None:
        """Wake the waiter."""


class ServerCall:
    """One accepted call, from admission until its worker is done with it.

    The last six slots belong to the I/O shell (one object per call, built in one
    ``__init__``: the hot path); the protocol never reads them.
    """

    __slots__ = (
        "answered",
        "buffers",
        "call_id",
        "cancelled",
        "credit_event",
        "credits",
        "deadline",
        "failure",
        "fn",
        "keep",
        "key",
        "metadata",
        "observed",
        "outcome",
        "parked",
        "payload",
        "received",
        "reply_metadata",
        "request",
        "result",
        "results",
        "scope",
        "session",
        "shutdown",
        "spec",
        "started",
        "stats",
        "trace",
    )

    def __init__(
        self,
        session: Session,
        header: Header,
        entry: tuple[MethodSpec, Callable[..., object]],
        flags: int,
        deadline: float,
        payload: Buffer | None,
        buffers: Sequence[Buffer],
        now: float,
    ) -> None:
        self.session = session
        self.key = session.key
        self.call_id: int = header.call_id
        self.spec, self.fn = entry
        #: Absolute deadline on the shell's clock, ``inf`` for none.
        self.deadline = deadline
        self.payload = payload
        self.buffers = buffers
        #: The CALL's SHM_RESULTS, SHM_RESULTS_ALL and COMPRESS bits.
        self.results = flags & _RESULT_BITS
        #: The client cancelled the call or lost its session: no reply at all.
        self.cancelled = False
        #: Shutdown stopped the call: the reply is DRAINING.
        self.shutdown = False
        #: The final reply was handed out.
        self.answered = False
        #: Stream items the engine may still send (window + credit - sent).
        self.credits = session.stream_window
        #: A call whose request is a stream: its request items (`tensorrpc._streams`).
        self.request: RequestStream | None = None
        #: The stream waits for credit.
        self.parked = False
        #: The binary W3C trace context the CALL carried (``Flags.TRACE``), or ``b""``.
        self.trace: bytes = header.trace
        #: The request metadata the CALL carried (``Flags.METADATA``; read-only).
        self.metadata: Mapping[str, str] = header.metadata
        #: The response metadata its RESULT or STREAM_END carries (None: none; checked
        #: against the bounds as it is set: `tensorrpc._metadata.merge_metadata`).
        self.reply_metadata: dict[str, str] | None = None
        #: When it was accepted and its handler started (0: not yet), on the shell's clock.
        self.received = now
        self.started = 0.0
        #: ``"ok"`` or the name of the ERROR code that answered it.
        self.outcome = "ok"
        #: Its method's counters (set when it is accepted).
        self.stats: MethodStatistics | None = None
        # The shell's: the handler's cancel scope while it runs, what a stream waiting for
        # credit waits on, the handler's return value (or exception), what an observer
        # watches of the call.
        self.scope: Cancellable | None = None
        self.credit_event: Settable | None = None
        self.result: object = MISSING
        self.failure: BaseException | None = None
        self.observed: CallObservation | None = None
        #: The argument tensors' torch_shm key while they may be on the client's regions
        #: (detached before the first reply); None: no handle was resolved.
        self.keep: tuple[Session, int] | None = None

    def take_args(self) -> tuple[Buffer, Sequence[Buffer]]:
        """The CALL's payload and buffers, handed to the worker that decodes them (once)."""
        payload = self.payload
        assert payload is not None
        buffers = self.buffers
        self.payload = None
        self.buffers = ()
        return payload, buffers

    def wake(self) -> None:
        """Stop the call if it is cancelled or shut down, and wake its credit wait."""
        if self.cancelled or self.shutdown:
            scope = self.scope
            if scope is not None:
                scope.cancel()
        event = self.credit_event
        if event is not None:
            event.set()
        request = self.request
        if request is not None and request.waiter is not None:
            request.waiter.set()


class CallQueue:
    """Accepted calls between admission and the end of their worker (module docstring).

    Args:
        settings: The engine's methods and limits.
    """

    __slots__ = (
        "_builtins",
        "_capacity",
        "_engine",
        "_limit",
        "_max_parked",
        "_methods",
        "_service",
        "_window",
        "batched",
        "busy",
        "expiry",
        "methods",
        "parked",
        "queue",
    )

    def __init__(self, settings: ProtocolSettings) -> None:
        self._methods = settings.methods
        self._builtins = settings.builtins
        self._engine = settings.hello.engine_id
        self._service = settings.hello.service
        self._capacity = settings.max_concurrency
        self._limit = settings.max_concurrency + settings.max_queued
        self._max_parked = settings.max_parked_streams
        self._window = settings.hello.stream_window
        #: Accepted calls waiting for a worker.
        self.queue: deque[ServerCall] = deque()
        #: Calls taken by a worker and not done (parked streams excluded).
        self.busy = 0
        #: Streams waiting for credit (also those whose session ended meanwhile).
        self.parked = 0
        #: Batched calls waiting for their batch's outcome (`batch_wait`).
        self.batched = 0
        #: No queued call's deadline is earlier than this (``inf``: none has one).
        self.expiry = _INF
        #: Per method of the service: its counters (the engine's only ones).
        self.methods = {name: MethodStatistics() for name in self._methods}

    def admit(
        self,
        session: Session,
        header: Header,
        payload: Buffer,
        buffers: Sequence[Buffer],
        now: float,
    ) -> ServerCall | Refusal | None:
        """The method and capacity rows of `ADMISSION` for a CALL of a live session.

        Returns:
            The accepted call (already queued); the refusal to answer with; or None
            for a method the shell answers itself (``ProtocolSettings.builtins``).
        """
        method: str = header.method
        entry = self._methods.get(method)
        if entry is None:
            if method in self._builtins:
                return None
            return ErrorCode.METHOD_NOT_FOUND, (
                f"service {self._service!r} has no method {method!r}"
            )
        spec = entry[0]
        flags = int(header.flags)
        if (
            bool(flags & _STREAM) != spec.streaming
            or bool(flags & _REQUEST_STREAM) != spec.request_streaming
        ):
            return ErrorCode.INVALID_ARGUMENT, f"{spec.qualname} must be called as {_kind(spec)}"
        if self.busy + len(self.queue) >= (self._capacity if flags & _NO_WAIT else self._limit):
            return ErrorCode.OVERLOADED, self._full_message(flags)
        timeout_ms: int = header.timeout_ms
        deadline = now + timeout_ms / 1000 if timeout_ms else _INF
        call = ServerCall(session, header, entry, flags, deadline, payload, buffers, now)
        if spec.request_streaming:
            call.request = RequestStream(self._window)
        call.stats = stats = self.methods[method]
        stats.calls += 1
        self.queue.append(call)
        if deadline < self.expiry:
            self.expiry = deadline
        return call

    def expire(self, now: float) -> list[ServerCall]:
        """Take the calls whose deadline passed while they waited out of the queue.

        They leave their sessions' tables and were never busy; the caller answers them
        DEADLINE_EXCEEDED. A cancelled call stays for its worker, which ends it quietly.

        Returns:
            The expired calls, oldest first.
        """
        if now < self.expiry:
            return []
        queue = self.queue
        late = [c for c in queue if c.deadline <= now and not c.cancelled]
        if late:
            kept = [c for c in queue if c.deadline > now or c.cancelled]
            queue.clear()
            queue.extend(kept)
            for call in late:
                calls = call.session.calls
                if calls.get(call.call_id) is call:
                    del calls[call.call_id]
                self._ended(call, ErrorCode.DEADLINE_EXCEEDED.name, now)
        self.expiry = min((c.deadline for c in queue if not c.cancelled), default=_INF)
        return late

    def _full_message(self, flags: int) -> str:
        engine = self._engine
        if flags & _NO_WAIT:
            return f"engine {engine!r} is busy ({self._capacity} calls running)"
        queued = self._limit - self._capacity
        return f"engine {engine!r} is full ({self._capacity} running, {queued} queued)"

    # -- for the workers --------------------------------------------------------------------

    def next_call(self) -> ServerCall | None:
        """Take the oldest queued call for a worker (counted busy until `done`)."""
        queue = self.queue
        if not queue:
            return None
        self.busy += 1
        return queue.popleft()

    def started(self, call: ServerCall, now: float) -> None:
        """A worker starts ``call``'s handler at ``now``."""
        call.started = now

    def done(self, call: ServerCall, now: float) -> None:
        """A worker is finished with ``call`` at ``now``: it leaves its session's table
        (rule 9) and its method counts how it ended."""
        self.busy -= 1
        calls = call.session.calls
        if calls.get(call.call_id) is call:
            del calls[call.call_id]
        outcome = call.outcome
        if outcome == "ok" and call.cancelled:
            outcome = "cancelled"
        stats = call.stats
        if stats is not None:
            stats.ended(outcome, call.received, call.started, now)

    @staticmethod
    def _ended(call: ServerCall, outcome: str, now: float) -> None:
        stats = call.stats
        if stats is not None:
            stats.ended(outcome, call.received, call.started, now)

    def may_reply(self, call: ServerCall) -> bool:
        """Claim the call's final reply: False when it has one or must get none (rule 7)."""
        if call.cancelled or call.answered:
            return False
        call.answered = True
        return True

    def may_send_item(self, call: ServerCall) -> bool:
        """Whether a stream may send its next item now (rule 8)."""
        return call.credits > 0 and not call.cancelled and not call.answered

    def park(self, call: ServerCall) -> str | None:
        """A stream waits for credit; it stops counting as busy.

        Returns:
            None, or the reason to end the stream with OVERLOADED: its client already
            has ``max_parked_streams`` streams waiting for credit.
        """
        session = call.session
        limit = self._max_parked
        if session.parked >= limit:
            return (
                f"client {session.name!r} has {limit} streams waiting for credit (the "
                "engine's limit per client): read or close some of them"
            )
        session.parked += 1
        call.parked = True
        self.busy -= 1
        self.parked += 1
        return None

    def batch_wait(self, call: ServerCall) -> None:
        """A batched call's worker waits for its batch: it stops counting as busy (the
        batcher bounds these: ``max_queue`` and its batches)."""
        self.busy -= 1
        self.batched += 1

    def batch_back(self, call: ServerCall) -> None:
        """The batched call's outcome is in (or it was cancelled): busy again, to reply."""
        self.busy += 1
        self.batched -= 1

    def unpark(self, call: ServerCall) -> None:
        """The stream runs again (credit arrived, or it was cancelled)."""
        call.parked = False
        call.session.parked -= 1
        self.busy += 1
        self.parked -= 1
