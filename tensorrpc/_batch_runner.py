"""The engine's batch runners: the I/O shell around `tensorrpc._batching.Batcher`.

Each batched method gets a runner, and the engine's method table gets the runner's
per-item entry point instead of the handler. The worker pool runs that entry point like
any handler, so a batched item is a call like any other: validated before it gets here,
bounded by its deadline, cancelled with its caller, answered by the worker (RESULT,
ERROR, or stream items with the stream's own credit). What the entry point adds:

* unary (``Batching``): queue the item, wait for its result. A runner task closes
  batches when the batcher says so and runs each in a task of its own; results go back
  to the waiting items.
* stream (``Continuous``): an async generator per item. A step loop per running batch
  calls the handler once per step with the active items; each output waits in the
  item's buffer until its worker takes it. The next step starts at once, and an item
  whose worker is waiting for its output takes part (the worker takes it and sends it
  while the step runs); an item whose worker is away (its stream has no credit) sits
  out with one output buffered until its reader catches up: a stalled reader never
  stalls the others, and costs one buffered output and its place in the batch.

A unary item does not hold one of the engine's ``max_concurrency`` workers while it
waits: the pool parks its task (`tensorrpc._dispatch`, rule 5) and hands us its deadline,
which the batcher keeps: a queued item leaves at its deadline (it never enters a batch),
a running one is failed at its deadline and its batch learns it left. A stream item is a
running stream from its first step to its last and holds its worker as every stream does
(parked while it waits for credit); the batcher keeps its deadline too.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel
import anyio.to_thread

from tensorrpc import _context, _observe
from tensorrpc._batching import Batcher, Continuous, ItemRefused
from tensorrpc._exceptions import ErrorCode
from tensorrpc._statistics import LatencyHistogram
from tensorrpc._zmq import Waiters, loop_clock
from tensorrpc.batching import _CURRENT, BatchContext, BatchItem

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from anyio.abc import TaskGroup

    from tensorrpc._observe import Observer
    from tensorrpc._service import MethodSpec, ServiceSpec

__all__ = ["BatchRunners", "BatchStatistics"]

logger = logging.getLogger("tensorrpc.server")

_INF: Final = math.inf


class BatchStatistics:
    """Counters and histograms of one batched method (see `BatchStatistics.snapshot`)."""

    __slots__ = ("batches", "items", "queue_wait", "run_time", "sizes")

    def __init__(self) -> None:
        self.batches = 0
        self.items = 0
        self.sizes: dict[int, int] = {}
        self.queue_wait = LatencyHistogram()
        self.run_time = LatencyHistogram()

    def ran(self, size: int, seconds: float) -> None:
        self.batches += 1
        self.sizes[size] = self.sizes.get(size, 0) + 1
        self.run_time.add(seconds)

    def waited(self, seconds: float) -> None:
        self.items += 1
        self.queue_wait.add(seconds)

    def snapshot(self) -> dict[str, Any]:
        """``batches`` (continuous: steps) and ``items`` run; ``sizes``: ``[items, batches]``
        pairs; ``queue_wait`` (each item's wait for its batch) and ``run_time`` (each
        handler call): sparse ``[bucket, count]`` latency histograms (the statistics
        method's buckets) with their sums in seconds (``*_sum_s``)."""
        return {
            "batches": self.batches,
            "items": self.items,
            "sizes": [[k, n] for k, n in sorted(self.sizes.items())],
            "queue_wait": self.queue_wait.pairs(),
            "queue_wait_sum_s": self.queue_wait.total,
            "run_time": self.run_time.pairs(),
            "run_time_sum_s": self.run_time.total,
        }


class _Item:
    """One queued or running item (a call the worker pool handed us)."""

    __slots__ = (
        "args",
        "deadline",
        "error",
        "event",
        "gone",
        "handle",
        "outputs",
        "owner",
        "queued_at",
        "result",
        "settled",
        "trace",
        "waiters",
    )

    def __init__(
        self,
        args: tuple[Any, ...],
        now: float,
        deadline: float,
        waiters: Waiters,
        outputs: deque[Any] | None,
    ) -> None:
        self.args = args
        self.queued_at = now
        self.deadline = deadline
        self.result: Any = None
        self.error: BaseException | None = None
        self.settled = False  # unary: result or error is set; stream: no more outputs
        self.gone = False  # the caller cancelled, its deadline passed, or it is done
        #: The one-shot wake-up its worker waits on (`Waiters`: a bare future on asyncio).
        self.event: Any = None
        self.waiters = waiters
        self.handle = BatchItem(_context.current_or_none())  # the item's call
        #: A stream item's outputs not yet taken by its worker (None: a unary item).
        self.outputs = outputs
        self.owner: _Run | None = None
        #: The trace context of the item's call span (``b""``: not traced).
        self.trace = _observe.current_trace()

    def wake(self) -> None:
        event = self.event
        if event is not None:
            self.waiters.wake(event)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.settled = True
        self.wake()


class _Run:
    """A running batch: its items, the scope its handler runs in, what wakes its loop."""

    __slots__ = ("ctx", "items", "scope", "step", "waiters", "wake")

    def __init__(self, items: list[_Item], waiters: Waiters) -> None:
        self.items = items
        #: The items of the running handler call, in the order of its lists.
        self.step: list[_Item] = []
        self.scope: anyio.CancelScope | None = None
        self.ctx: BatchContext | None = None
        self.wake: Any = None
        self.waiters = waiters

    def poke(self) -> None:
        if self.wake is not None:
            self.waiters.wake(self.wake)

    def clear(self) -> None:
        """The batch ended: drop the item <-> run links, so that its items (and their
        calls) are freed by reference counting, not left to the cycle collector, whose
        full passes stall the engine's loop."""
        for it in self.items:
            it.owner = None
        for it in self.step:
            it.owner = None
        self.items = []
        self.step = []
        self.ctx = None
        self.scope = None

    def left(self, item: _Item) -> None:
        """An item's caller is gone: tell the handler, and stop it if nobody is left."""
        ctx = self.ctx
        if ctx is not None:
            with contextlib.suppress(ValueError):  # not in the running step
                ctx._cancelled.add(self.step.index(item))
        if self.scope is not None and all(it.gone for it in self.step):
            self.scope.cancel()
        self.poke()


class _Runner:
    """The batcher, runner task and batch runs of one batched method."""

    def __init__(
        self,
        spec: MethodSpec,
        handler: Callable[..., Any],
        engine_id: str,
        observer: Callable[[], Observer | None],
    ) -> None:
        batch = spec.batch
        assert batch is not None
        self._spec = spec
        self._batch = batch
        self._handler = handler
        self._engine_id = engine_id
        self._observer = observer
        self.batcher: Batcher[_Item] = Batcher(batch.config)
        self._continuous = isinstance(batch.config, Continuous)
        self._tg: TaskGroup | None = None
        self._wake: Any = None
        self._runs: list[_Run] = []
        self.stats = BatchStatistics()
        # Set in `start` (inside the event loop): its clock, and its one-shot wake-ups (an
        # ``anyio.Event()`` looks the backend up on every call, once per item here).
        self._clock: Callable[[], float] = time.monotonic
        self._waiters: Waiters | None = None

    # -- the entry points the worker pool calls ---------------------------------------

    def entry(self) -> Callable[..., Any]:
        """The per-item callable that replaces the handler in the method table."""
        if self._continuous:

            def stream(*args: Any) -> AsyncIterator[Any]:
                return self._stream(args)

            return stream

        async def unary(deadline: float, *args: Any) -> Any:
            # The worker pool passes the call's deadline first (`_dispatch`, rule 5).
            return await self._unary(args, deadline)

        return unary

    def _offer(self, args: tuple[Any, ...], deadline: float) -> _Item:
        waiters = self._waiters
        if self._tg is None or waiters is None:
            raise ItemRefused(ErrorCode.DRAINING, f"{self._spec.qualname}: the engine is stopping")
        now = self._clock()
        item = _Item(args, now, deadline, waiters, deque() if self._continuous else None)
        if not self.batcher.offer(item, now, deadline):
            raise ItemRefused(
                ErrorCode.OVERLOADED,
                f"{self._spec.qualname}: {self.batcher.config.max_queue} items are waiting "
                "for a batch (Batching.max_queue)",
            )
        if self._continuous:
            self._kick()  # running batches take it at their next step
        elif self.batcher.poll_sooner and self._wake is not None:
            waiters.wake(self._wake)  # else the loop's timer covers it (one wake per batch)
        return item

    def _abandon(self, item: _Item) -> None:
        """The item's caller cancelled or its deadline passed (or a stream ended)."""
        item.gone = True
        if self.batcher.remove(item):
            return  # still queued: it never enters a batch
        run = item.owner
        if run is not None:
            run.left(item)

    async def _unary(self, args: tuple[Any, ...], deadline: float) -> Any:
        item = self._offer(args, deadline)
        try:
            if not item.settled:  # settled once: one wake-up
                waiters = item.waiters
                item.event = waiter = waiters.new()
                await waiters.wait(waiter)
        finally:
            item.event = None
            if not item.settled:
                self._abandon(item)
            item.gone = True
            if deadline != _INF:
                self.batcher.settled(item)
        if item.error is not None:
            raise item.error
        return item.result

    async def _stream(self, args: tuple[Any, ...]) -> AsyncIterator[Any]:
        # The worker's stream scope carries the call's deadline (`_dispatch`).
        item = self._offer(args, anyio.current_effective_deadline())
        outputs = item.outputs
        assert outputs is not None
        waiters = item.waiters
        try:
            while True:
                if outputs:
                    out = outputs.popleft()
                    if item.owner is not None:
                        item.owner.poke()  # its slot is free: it takes part again
                    yield out
                    continue
                if item.settled:
                    if item.error is not None:
                        raise item.error
                    return
                item.event = waiter = waiters.new()
                await waiters.wait(waiter)
                item.event = None
        finally:
            item.event = None
            self._abandon(item)
            if item.deadline != _INF:
                self.batcher.settled(item)

    # -- the runner task -----------------------------------------------------------------

    def start(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._clock = loop_clock()
        self._waiters = Waiters()
        tg.start_soon(self._loop)

    def _kick(self) -> None:
        if self._wake is not None:
            assert self._waiters is not None
            self._waiters.wake(self._wake)
        for run in self._runs:
            run.poke()

    def _close(self, now: float) -> float:
        """Poll the batcher once: fail what expired and start a batch if one closes.
        Returns when to poll again at the latest (``-inf``: at once, a batch started)."""
        batcher = self.batcher
        if self._continuous and any(len(r.items) < batcher.config.max_size for r in self._runs):
            # A running batch with room takes the queue at its next step.
            poll = batcher.join(0, now)
        else:
            poll = batcher.poll(now)
        self._expire(poll.expired, poll.late)
        if not poll.batch:
            return poll.wake_at
        assert self._tg is not None
        assert self._waiters is not None
        run = _Run(poll.batch, self._waiters)
        self._runs.append(run)
        self._tg.start_soon(self._run_steps if self._continuous else self._run_once, run)
        return -_INF

    async def _loop(self) -> None:
        waiters = self._waiters
        assert waiters is not None
        while True:
            now = self._clock()
            wake_at = self._close(now)
            if wake_at == -_INF:
                continue
            self._wake = wake = waiters.new()
            with anyio.move_on_after(max(0.0, wake_at - now)):
                await waiters.wait(wake)
            self._wake = None

    def _expire(self, queued: list[_Item], running: list[_Item]) -> None:
        """Fail the items whose deadline passed: ``queued`` never enter a batch, the
        ``running`` ones leave theirs (its handler learns it, `BatchContext.cancelled`)."""
        for item in queued:
            item.fail(
                ItemRefused(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"{self._spec.qualname} passed its deadline while waiting for a batch",
                )
            )
        for item in running:
            if item.settled or item.gone:
                continue
            item.gone = True
            item.fail(
                ItemRefused(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"{self._spec.qualname} passed its deadline in a running batch",
                )
            )
            if item.owner is not None:
                item.owner.left(item)

    def _started(self, items: list[_Item], run: _Run) -> None:
        now = self._clock()
        record = self.stats.waited
        for item in items:
            item.owner = run
            item.handle.waited = waited = now - item.queued_at
            record(waited)

    async def _call(self, run: _Run, items: list[_Item]) -> Any:
        """One handler call over ``items`` (a batch, or a step); the outcome is checked by
        the caller. Returns the list the handler returned."""
        columns = [list(col) for col in zip(*(it.args for it in items), strict=True)]
        ctx = BatchContext([it.handle for it in items], continuous=self._continuous)
        ctx._cancelled.update(i for i, it in enumerate(items) if it.gone)
        run.ctx = ctx
        run.step = items
        observer = self._observer()
        observed = None
        if observer is not None:  # observe: a batch (step) starts
            observed = observer.engine_batch(
                self._spec.service,
                self._spec.name,
                self._engine_id,
                len(items),
                [it.trace for it in items],
            )
        token = _CURRENT.set(ctx)
        start = time.perf_counter()
        outcome = "cancelled"
        try:
            if self._batch.is_async:
                result = await self._handler(*columns)
            else:
                context = contextvars.copy_context()
                result = await anyio.to_thread.run_sync(
                    context.run, self._handler, *columns, abandon_on_cancel=True
                )
            outcome = "ok"
            return result
        except Exception:
            outcome = "REMOTE"  # each item is answered ERROR REMOTE
            raise
        finally:
            self.stats.ran(len(items), time.perf_counter() - start)
            _CURRENT.reset(token)
            if observed is not None:
                observed.finished(outcome, 0)

    def _mismatch(self, results: object, n: int) -> ItemRefused | None:
        if isinstance(results, (list, tuple)) and len(results) == n:
            return None
        got = (
            f"{len(results)} results" if isinstance(results, (list, tuple)) else repr(type(results))
        )
        return ItemRefused(
            ErrorCode.BAD_RESULT,
            f"{self._spec.qualname}: the batch handler returned {got} for a batch of {n} "
            "items (it must return a list with one result per item)",
        )

    async def _run_once(self, run: _Run) -> None:
        items = run.items
        self._started(items, run)
        results: Any = None
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                run.scope = scope
                if all(it.gone for it in items):
                    scope.cancel()
                try:
                    results = await self._call(run, items)
                except Exception as exc:
                    error = exc
            if not scope.cancelled_caught and error is None:
                error = self._mismatch(results, len(items))
                if error is not None:
                    logger.error("%s", error)
            # The slot is free: a due batch closes before this one's items are woken, so
            # its task is scheduled ahead of their workers and their replies go out
            # while its handler runs, not before it starts.
            self._finished(run, close=True)
            if error is not None:
                for it in items:
                    it.fail(error)
            elif not scope.cancelled_caught:  # else every caller is gone
                self._deliver(run, results)
        finally:
            for it in items:
                if not it.settled:
                    it.fail(ItemRefused(ErrorCode.INTERNAL, f"{self._spec.qualname}: batch lost"))
            if run in self._runs:  # cancelled (the engine stops): no new batch
                self._finished(run)
            run.clear()

    @staticmethod
    def _deliver(run: _Run, results: list[Any]) -> None:
        """Each item gets its result, or the failure the handler gave it."""
        assert run.ctx is not None
        failed = run.ctx._failed
        for i, it in enumerate(run.items):
            if it.settled:  # failed at its deadline meanwhile
                continue
            if i in failed:
                it.fail(failed[i])
            else:
                it.result = results[i]
                it.settled = True
                it.wake()

    def _finished(self, run: _Run, *, close: bool = False) -> None:
        """``run`` ended: its slot is free. ``close``: start the next batch now, if one
        can close, rather than when the runner task next runs."""
        self._runs.remove(run)
        self.batcher.finished()
        if close:
            self._close(self._clock())
        self._kick()  # the runner task polls again (and sets its timer)

    # -- continuous batching -------------------------------------------------------------

    async def _run_steps(self, run: _Run) -> None:
        self._started(run.items, run)
        max_size = self.batcher.config.max_size
        waiters = run.waiters
        yielded = [False]

        def mark() -> None:
            yielded[0] = True

        try:
            while True:
                if not yielded[0]:  # a handler that never waits starves no one
                    await waiters.checkpoint()
                # Step boundary: the gone and the ended leave, the queue joins.
                kept = []
                for it in run.items:
                    if it.gone or it.settled:
                        it.owner = None  # no cycle through a run it left
                    else:
                        kept.append(it)
                run.items = kept
                room = max_size - len(run.items)
                if room > 0 and self._tg is not None:
                    joined = self.batcher.join(room, self._clock())
                    self._expire(joined.expired, joined.late)
                    self._started(joined.batch, run)
                    run.items.extend(joined.batch)
                if not run.items:
                    return
                # An item takes part while its worker is waiting for its next output
                # (``event`` set: it takes the one buffered first, while this step runs).
                ready = [
                    it
                    for it in run.items
                    if not it.outputs or (len(it.outputs) == 1 and it.event is not None)
                ]
                if not ready:  # every reader is behind: wait for one to take its output
                    run.wake = wake = waiters.new()
                    await waiters.wait(wake)
                    run.wake = None
                    continue
                yielded[0] = False
                waiters.soon(mark)  # runs once this task yields (the handler waits)
                await self._step(run, ready)
        finally:
            for it in run.items:
                if not it.settled:
                    it.fail(ItemRefused(ErrorCode.INTERNAL, f"{self._spec.qualname}: batch lost"))
            self._finished(run)
            run.clear()

    async def _step(self, run: _Run, items: list[_Item]) -> None:
        with anyio.CancelScope() as scope:
            run.scope = scope
            try:
                outputs = await self._call(run, items)
            except Exception as exc:
                for it in run.items:
                    it.fail(exc)
                return
            finally:
                run.scope = None
        if scope.cancelled_caught:
            return
        bad = self._mismatch(outputs, len(items))
        if bad is not None:
            logger.error("%s", bad)
            for it in run.items:
                it.fail(bad)
            return
        assert run.ctx is not None
        failed = run.ctx._failed
        ended = run.ctx._ended
        # Items that joined at this step first: their workers run (and send) in the order
        # they are woken, so a stream's first output does not queue behind the outputs of
        # every item already running (its time to first token).
        order = [i for i, it in enumerate(items) if it.handle.steps == 0]
        if order:
            order += [i for i, it in enumerate(items) if it.handle.steps != 0]
        for i in order or range(len(items)):
            it = items[i]
            if i in failed:
                it.fail(failed[i])
                continue
            send = ended.get(i, True)
            if send and not it.gone:
                assert it.outputs is not None
                it.outputs.append(outputs[i])
            it.handle.steps += 1
            if i in ended:
                it.settled = True
            it.wake()


class BatchRunners:
    """The runners of a service's batched methods (none: nothing to do)."""

    def __init__(
        self,
        spec: ServiceSpec,
        instance: object,
        engine_id: str,
        observer: Callable[[], Observer | None],
    ) -> None:
        self._runners: dict[str, _Runner] = {
            name: _Runner(m, getattr(instance, name), engine_id, observer)
            for name, m in spec.methods.items()
            if m.batch is not None
        }

    def entry(self, name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        """What the method table calls for ``name``: the runner's entry point, or
        ``handler`` for a method that is not batched."""
        runner = self._runners.get(name)
        return handler if runner is None else runner.entry()

    def start(self, tg: TaskGroup) -> None:
        """Start every runner's task in ``tg``."""
        for runner in self._runners.values():
            runner.start(tg)

    def statistics(self) -> Mapping[str, dict[str, Any]]:
        """Per batched method: its histograms (see `BatchStatistics`), the items queued
        and the batches running now."""
        return {
            name: {**r.stats.snapshot(), "queued": len(r.batcher), "running": r.batcher.running}
            for name, r in self._runners.items()
        }
