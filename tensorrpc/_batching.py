"""Batching of calls on the engine, sans-I/O: when a batch closes and what it holds.

A [`Batcher`][tensorrpc._batching.Batcher] holds the queue of one batched method's items
(calls whose arguments were validated) and decides, given ``now``, which items form the
next batch. It never sleeps, never reads a clock and owns no task: the engine's shell
feeds it items, cancellations and the time, and runs what it returns.

Rules (docs/batching.md, "Semantics"):

1. A batch closes at once when ``max_size`` items are queued (it takes the oldest
   ``max_size``), or when the largest of ``preferred_sizes`` is queued (it takes that many);
   otherwise when its oldest item has waited ``max_delay`` seconds (``0``: take what is
   queued now). A batch closed by the delay takes the largest preferred size that is
   queued, or every queued item (up to ``max_size``) when none is.
2. At most ``max_batches`` batches run at once; a batch that could close waits for a free
   slot (its items keep waiting, bounded by their deadlines).
3. The queue holds at most ``max_queue`` items: `offer` refuses the next one (the shell
   answers it OVERLOADED).
4. A queued item whose deadline passes, or whose caller cancels, never enters a batch:
   `poll` hands expired items back to be failed, `remove` takes out cancelled ones.
   An item that entered a batch stays bounded by its deadline: `poll` and `join` hand it
   back in ``late`` once its deadline passes, unless the shell said it `settled` first;
   ``wake_at`` covers queued and running items' deadlines alike.
5. Continuous batching: a running batch takes new items at its step boundaries with
   `join` (up to its room, no waiting: what is queued now), before the queue would form a
   batch of its own.

Items are FIFO: a batch holds the oldest eligible items, in arrival order.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from typing import Final, Generic, TypeVar

from tensorrpc._exceptions import ErrorCode, ServiceDefinitionError, TensorRPCError

__all__ = ["Batcher", "Batching", "Continuous", "ItemRefused", "Poll"]

T = TypeVar("T")
_INF: Final = math.inf
#: The largest ``max_size`` / ``max_queue`` / ``max_batches`` accepted.
_MAX_COUNT: Final = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Batching:
    """Dynamic batching of a unary method: ``@rpc(batch=Batching(max_size=32, max_delay=0.005))``.

    The handler takes one list per parameter (``list[T]`` for a per-item ``T``) and returns
    a list with one result per item, in order. Callers see the per-item signature.

    Attributes:
        max_size: The most items in one batch.
        max_delay: Seconds the oldest queued item may wait for more to join (``0``: a batch
            takes what is queued when a slot is free).
        preferred_sizes: Sizes a batch closes at as soon as they are reached (the largest
            one), and that a batch closed by the delay rounds down to when it can.
        max_batches: Batches running at once.
        max_queue: Items waiting for a batch; the next one is refused with OVERLOADED.
    """

    max_size: int = 32
    max_delay: float = 0.005
    preferred_sizes: tuple[int, ...] = ()
    max_batches: int = 1
    max_queue: int = 1024

    def check(self, where: str) -> None:
        """Refuse settings that cannot work, naming the method (``where``).

        Raises:
            ServiceDefinitionError: A count out of range, a negative or non-finite delay,
                or a preferred size above ``max_size``.
        """
        _check_common(self, where)
        sizes = self.preferred_sizes
        if type(sizes) is not tuple or any(
            type(s) is not int or not 1 <= s <= self.max_size for s in sizes
        ):
            raise ServiceDefinitionError(
                f"{where}: Batching.preferred_sizes must be a tuple of ints in "
                f"1..max_size ({self.max_size}), got {sizes!r}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class Continuous:
    """Continuous batching of a streaming method: ``@rpc(batch=Continuous(max_size=32))``.

    The handler is one *step*: it takes one list per parameter (the arguments of the
    items active in this step) and returns one output per item; each output goes to that
    item's stream. Between steps, new items join (up to ``max_size``) and items that ended,
    were cancelled or expired leave. Callers see a streaming method with the per-item
    signature.

    Attributes:
        max_size: The most items active in one batch.
        max_delay: Seconds the oldest queued item waits for more before a new batch starts
            (items that join a running batch join at its next step, without waiting).
        max_batches: Batches running at once.
        max_queue: Items waiting to join; the next one is refused with OVERLOADED.
    """

    max_size: int = 32
    max_delay: float = 0.0
    max_batches: int = 1
    max_queue: int = 1024

    @property
    def preferred_sizes(self) -> tuple[int, ...]:
        """Continuous batches have no preferred sizes (they change at every step)."""
        return ()

    def check(self, where: str) -> None:
        """Refuse settings that cannot work, naming the method (``where``).

        Raises:
            ServiceDefinitionError: A count out of range, or a negative or non-finite delay.
        """
        _check_common(self, where)


def _check_common(cfg: Batching | Continuous, where: str) -> None:
    kind = type(cfg).__name__
    for field in ("max_size", "max_batches", "max_queue"):
        value = getattr(cfg, field)
        if type(value) is not int or not 1 <= value <= _MAX_COUNT:
            raise ServiceDefinitionError(
                f"{where}: {kind}.{field} must be an int in 1..{_MAX_COUNT}, got {value!r}"
            )
    delay = cfg.max_delay
    if type(delay) not in (int, float) or not 0 <= delay < _INF:
        raise ServiceDefinitionError(
            f"{where}: {kind}.max_delay must be a finite number of seconds >= 0, got {delay!r}"
        )


class ItemRefused(TensorRPCError):
    """The engine's batcher ends one item with this error code (queue full, deadline,
    a result count that does not match); the engine answers it with ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Entry(Generic[T]):
    __slots__ = ("deadline", "item", "queued", "running", "since")

    def __init__(self, item: T, since: float, deadline: float) -> None:
        self.item = item
        self.since = since
        self.deadline = deadline
        self.queued = True
        #: In a batch, with a finite deadline, and not settled (rule 4).
        self.running = False


@dataclasses.dataclass(slots=True)
class Poll(Generic[T]):
    """What `Batcher.poll` decided.

    Attributes:
        batch: The items of a batch that closed now (empty: none did). The shell runs it
            and calls `Batcher.finished` once it is done.
        expired: Queued items whose deadline passed: fail them (DEADLINE_EXCEEDED).
        wake_at: When to poll again at the latest (``inf``: only on the next change).
        late: Items of running batches whose deadline passed (each handed back once):
            fail them (DEADLINE_EXCEEDED) and tell their batch they left.
    """

    batch: list[T]
    expired: list[T]
    wake_at: float
    late: list[T] = dataclasses.field(default_factory=list)


class Batcher(Generic[T]):
    """The queue and closing rules of one batched method (module docstring).

    Args:
        config: The method's [`Batching`][tensorrpc.Batching] or
            [`Continuous`][tensorrpc.Continuous] settings.
    """

    __slots__ = (
        "_entries",
        "_finite",
        "_index",
        "_max_delay",
        "_preferred",
        "_reported",
        "_running",
        "_seq",
        "_watch",
        "config",
        "poll_sooner",
        "running",
    )

    def __init__(self, config: Batching | Continuous) -> None:
        self.config = config
        self._max_delay = float(config.max_delay)
        self._preferred = tuple(sorted(set(config.preferred_sizes)))
        self._entries: deque[_Entry[T]] = deque()
        self._index: dict[int, _Entry[T]] = {}
        # Queued items with a finite deadline (none: no scan for late items).
        self._finite = 0
        #: Batches closed and not finished.
        self.running = 0
        # Running items with a finite deadline: a heap of (deadline, seq, entry) with
        # settled entries left in it until they reach the top, and their index.
        self._watch: list[tuple[float, int, _Entry[T]]] = []
        self._running: dict[int, _Entry[T]] = {}
        self._seq = 0
        # The wake_at of the last Poll handed out (the shell sleeps until then).
        self._reported = _INF
        #: Set by `offer`: the shell must poll before the last ``wake_at`` it was given
        #: (a batch can close now, or the new item's delay or deadline ends sooner).
        #: False: the item changes nothing the shell's timer does not already cover.
        self.poll_sooner = True

    def __len__(self) -> int:
        """Items queued (cancelled ones excluded)."""
        return len(self._index)

    def offer(self, item: T, now: float, deadline: float = _INF) -> bool:
        """Queue ``item`` (validated already); False when the queue is full (rule 3)."""
        index = self._index
        if len(index) >= self.config.max_queue:
            self.poll_sooner = False
            return False
        entry = _Entry(item, now, deadline)
        if deadline != _INF:
            self._finite += 1
        self._entries.append(entry)
        index[id(item)] = entry
        n = len(index)
        preferred = self._preferred
        self.poll_sooner = (
            n >= self.config.max_size
            or (bool(preferred) and n == preferred[-1])
            or (n == 1 and now + self._max_delay < self._reported)
            or deadline < self._reported
        )
        return True

    def remove(self, item: T) -> bool:
        """Take a queued item out (its caller cancelled); False if it is not queued."""
        entry = self._index.pop(id(item), None)
        if entry is None:
            return False
        self._dequeued(entry)
        self._compact()
        return True

    def _dequeued(self, entry: _Entry[T]) -> None:
        entry.queued = False
        if entry.deadline != _INF:
            self._finite -= 1

    def queued(self, item: T) -> bool:
        """Whether ``item`` is still waiting for a batch."""
        return id(item) in self._index

    def settled(self, item: T) -> None:
        """A running item got its outcome (or its caller left): its deadline no longer
        matters. Items without a finite deadline need not be reported."""
        entry = self._running.pop(id(item), None)
        if entry is not None:
            entry.running = False
            if len(self._watch) > 2 * len(self._running) + 64:
                self._watch = [w for w in self._watch if w[2].running]
                heapq.heapify(self._watch)

    def _late(self, now: float) -> list[T]:
        late: list[T] = []
        watch = self._watch
        while watch and (not watch[0][2].running or watch[0][0] <= now):
            entry = heapq.heappop(watch)[2]
            if entry.running:
                entry.running = False
                del self._running[id(entry.item)]
                late.append(entry.item)
        return late

    def _wake(self) -> float:
        """The earliest deadline of a queued or running item (``inf``: none)."""
        wake = self._next_deadline()
        watch = self._watch
        while watch and not watch[0][2].running:
            heapq.heappop(watch)
        return min(wake, watch[0][0]) if watch else wake

    def finished(self) -> None:
        """A batch the shell ran is done: its slot is free (rule 2)."""
        if self.running <= 0:
            raise RuntimeError("Batcher.finished() without a running batch")
        self.running -= 1

    def _compact(self) -> None:
        entries = self._entries
        while entries and not entries[0].queued:
            entries.popleft()

    def _expire(self, now: float) -> list[T]:
        expired: list[T] = []
        if not self._finite:
            return expired
        keep: deque[_Entry[T]] = deque()
        for entry in self._entries:
            if not entry.queued:
                continue
            if entry.deadline <= now:
                self._dequeued(entry)
                del self._index[id(entry.item)]
                expired.append(entry.item)
            else:
                keep.append(entry)
        self._entries = keep
        return expired

    def _next_deadline(self) -> float:
        if not self._finite:
            return _INF
        return min((e.deadline for e in self._entries if e.queued), default=_INF)

    def _take(self, count: int) -> list[T]:
        out: list[T] = []
        entries = self._entries
        while len(out) < count and entries:
            entry = entries.popleft()
            if entry.queued:
                self._dequeued(entry)
                del self._index[id(entry.item)]
                out.append(entry.item)
                if entry.deadline != _INF:
                    entry.running = True
                    self._running[id(entry.item)] = entry
                    self._seq += 1
                    heapq.heappush(self._watch, (entry.deadline, self._seq, entry))
        self._compact()
        return out

    def _size_now(self, now: float) -> tuple[int, float]:
        """How many items a batch closing now takes (0: none closes) and, if none, when
        the delay rule would close one."""
        queued = len(self._index)
        if not queued:
            return 0, _INF
        cfg = self.config
        if queued >= cfg.max_size:
            return cfg.max_size, _INF
        preferred = self._preferred
        if preferred and queued >= preferred[-1]:
            return preferred[-1], _INF
        self._compact()
        due = self._entries[0].since + self._max_delay
        if now < due:
            return 0, due
        for size in reversed(preferred):
            if size <= queued:
                return size, _INF
        return queued, _INF

    def poll(self, now: float) -> Poll[T]:
        """Expire late items and close a batch if the rules say so (rules 1, 2, 4).

        Call again while the returned batch is not empty (more may close at once, up
        to ``max_batches``), and at ``wake_at`` at the latest.
        """
        expired = self._expire(now)
        late = self._late(now)
        if self.running >= self.config.max_batches:
            wake = self._wake()
            batch: list[T] = []
        else:
            size, due = self._size_now(now)
            if size:
                self.running += 1
                batch = self._take(size)
                wake = self._wake()
            else:
                wake = min(self._wake(), due)
                batch = []
        self._reported = wake
        return Poll(batch, expired, wake, late)

    def join(self, room: int, now: float) -> Poll[T]:
        """At a running batch's step boundary: up to ``room`` queued items join it (rule 5).

        Expired and late items are handed back as in `poll`; the joiners are in ``batch``. The
        running count does not change (the batch was counted when it started).
        """
        expired = self._expire(now)
        late = self._late(now)
        batch = self._take(room) if room > 0 else []
        self._reported = wake = self._wake()
        return Poll(batch, expired, wake, late)
