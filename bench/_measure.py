"""Timing loops shared by every benchmark case.

Every loop is bounded twice: by a count and by a time budget, whichever comes first, so
a slow system shortens its own sample instead of stretching the whole run. Warm-up calls
run before any sample is kept. Latencies are kept in nanoseconds (``perf_counter_ns``)
and summarised as medians and tail percentiles; nothing is averaged away.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Budget:
    """How long one measurement may run: a sample count and a time limit.

    Attributes:
        warmup: calls made (and discarded) before measuring.
        count: at most this many measured calls.
        seconds: stop measuring after this long, even below ``count``.
        min_count: measure at least this many calls even past ``seconds`` (bounded by
            ``count``), so a slow system still yields a median.
    """

    warmup: int
    count: int
    seconds: float
    min_count: int = 3


def summarize(latencies_ns: list[int]) -> dict[str, Any]:
    """Summarise per-call latencies (nanoseconds) in microseconds.

    Returns a dict with ``n``, ``median_us``, ``p99_us``, ``mean_us``, ``min_us`` and
    ``max_us``. An empty sample raises ``ValueError``: a figure is never invented.
    """
    if not latencies_ns:
        raise ValueError("no samples")
    ordered = sorted(latencies_ns)
    n = len(ordered)
    # nearest-rank percentile: the smallest sample with at least 99% of samples <= it
    p99 = ordered[min(n - 1, max(0, math.ceil(0.99 * n) - 1))]
    return {
        "n": n,
        "median_us": statistics.median(ordered) / 1e3,
        "p99_us": p99 / 1e3,
        "mean_us": statistics.fmean(ordered) / 1e3,
        "min_us": ordered[0] / 1e3,
        "max_us": ordered[-1] / 1e3,
    }


def _keep_going(done: int, started: float, budget: Budget) -> bool:
    if done >= budget.count:
        return False
    if done < budget.min_count:
        return True
    return time.perf_counter() - started < budget.seconds


async def time_async(fn: Callable[[], Awaitable[object]], budget: Budget) -> list[int]:
    """Call ``fn`` sequentially; return each measured call's latency in nanoseconds."""
    for _ in range(budget.warmup):
        await fn()
    samples: list[int] = []
    started = time.perf_counter()
    clock = time.perf_counter_ns
    while _keep_going(len(samples), started, budget):
        t0 = clock()
        await fn()
        samples.append(clock() - t0)
    return samples


def time_sync(fn: Callable[[], object], budget: Budget) -> list[int]:
    """Blocking twin of :func:`time_async` for systems whose client API is synchronous."""
    for _ in range(budget.warmup):
        fn()
    samples: list[int] = []
    started = time.perf_counter()
    clock = time.perf_counter_ns
    while _keep_going(len(samples), started, budget):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return samples


def time_sync_each(
    prepare: Callable[[], Any], fn: Callable[[Any], object], budget: Budget
) -> list[int]:
    """Like :func:`time_sync`, but ``prepare()`` runs untimed before each call of ``fn``.

    Used where every call needs a new input (say a fresh tensor) whose creation is not
    part of what is measured.
    """
    for _ in range(budget.warmup):
        fn(prepare())
    samples: list[int] = []
    started = time.perf_counter()
    clock = time.perf_counter_ns
    while _keep_going(len(samples), started, budget):
        arg = prepare()
        t0 = clock()
        fn(arg)
        samples.append(clock() - t0)
        del arg
    return samples


async def time_async_paired(
    prepare: Callable[[], Awaitable[Any]],
    fn: Callable[[Any], Awaitable[object]],
    ref: Callable[[], Awaitable[object]],
    budget: Budget,
    block: int = 8,
) -> tuple[list[int], list[int]]:
    """Async twin of :func:`time_sync_each` (``await prepare()`` runs untimed before each
    call of ``fn``; it may hand blocking work to a thread, so that the event loop keeps
    serving), in blocks of ``block`` calls, each block followed by as many timed calls
    of ``ref`` (a small call).

    Whatever ``prepare`` hands out should be held by the caller past the timing (a list of
    pre-made inputs, cycled), so that freeing an input never lands in a timed call.

    The two kinds alternate every few milliseconds, so "``fn`` minus ``ref``" does not
    move with what the machine did between two separate measurements; in blocks, not
    one by one, so that what a call leaves running after its reply (a free handed to a
    thread) lands on the next call of its own kind, as back to back, in all but the
    first call of each block.

    Returns:
        ``(samples, ref_samples)``, as many of each.
    """
    for _ in range(budget.warmup):
        await fn(await prepare())
    for _ in range(budget.warmup):
        await ref()
    samples: list[int] = []
    refs: list[int] = []
    started = time.perf_counter()
    clock = time.perf_counter_ns
    while _keep_going(len(samples), started, budget):
        n = 0
        while n < block and _keep_going(len(samples), started, budget):
            arg = await prepare()
            t0 = clock()
            await fn(arg)
            samples.append(clock() - t0)
            del arg
            n += 1
        for _ in range(n):
            t0 = clock()
            await ref()
            refs.append(clock() - t0)
    return samples, refs


async def pipelined(
    fn: Callable[[], Awaitable[object]],
    *,
    inflight: int,
    total: int,
    seconds: float,
    warmup: int,
) -> dict[str, Any]:
    """Throughput with ``inflight`` calls outstanding at all times.

    ``inflight`` worker tasks each await ``fn`` in a loop, the way an application keeps
    many requests in flight. Workers stop after ``total`` calls in all or ``seconds``,
    whichever comes first; a warm-up phase of ``warmup`` calls runs the same way first.

    Returns ``{"calls", "seconds", "calls_per_s", "inflight"}``.
    """

    async def phase(limit: int, deadline_s: float) -> tuple[int, float]:
        issued = 0
        done = 0
        start = time.perf_counter()
        stop_at = start + deadline_s

        async def worker() -> None:
            nonlocal issued, done
            while issued < limit and time.perf_counter() < stop_at:
                issued += 1
                await fn()
                done += 1

        await asyncio.gather(*(worker() for _ in range(inflight)))
        return done, time.perf_counter() - start

    await phase(warmup, seconds)
    calls, elapsed = await phase(total, seconds)
    if calls == 0 or elapsed <= 0:
        raise RuntimeError("no pipelined call completed")
    return {
        "calls": calls,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed,
        "inflight": inflight,
    }


def proc_stats(pid: int) -> tuple[int, int, float]:
    """(current RSS, peak RSS, CPU seconds) of a process, from /proc."""
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss, hwm, (int(fields[11]) + int(fields[12])) / ticks


#: torch names each shared-memory file after the process that made it:
#: ``/dev/shm/torch_<pid>_<random>_<counter>`` (both sharing strategies; ``file_descriptor``
#: unlinks it at once, ``file_system`` keeps it while the memory is shared).
_TORCH_SHM_FILE = re.compile(r"torch_(?P<pid>\d+)_")


def shm_names_of(names: Iterable[str], pids: Iterable[int]) -> set[str]:
    """Of ``/dev/shm`` entry ``names``, those made by ``pids`` or named by tensorrpc.

    torch's files carry their maker's pid; tensorrpc names nothing in ``/dev/shm`` (its
    shared memory is memfds), so a name starting ``tensorrpc`` is a bug of ours, whoever
    made it. Other names belong to other programs and are left out.
    """
    wanted = {str(pid) for pid in pids}
    return {
        name
        for name in names
        if name.startswith("tensorrpc")
        or ((m := _TORCH_SHM_FILE.match(name)) is not None and m["pid"] in wanted)
    }


def shm_files_of(pids: Iterable[int]) -> set[str]:
    """The ``/dev/shm`` entries of these processes now (see `shm_names_of`).

    A leak check that compares the whole listing fails when another program (another
    test worker) makes or removes a file meanwhile; one built on this looks only at the
    files of its own processes. Empty where there is no ``/dev/shm``.
    """
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return shm_names_of(names, pids)
