"""Batching (``python -m bench --only batching``): batched calls beside unbatched ones.

One engine process serves a handler whose cost is flat in the batch size: a fixed step
(``STEP_S``, 5 ms) on one "accelerator" (a lock: steps never overlap, as kernels on one
device do not). The client (this process) measures:

* ``unbatched``: 64 concurrent callers of a plain method, one step per call;
* ``tensorrpc``: the same callers on ``@rpc(batch=Batching(max_size=64,
  max_delay=MAX_DELAY_S))``, one step per batch;
* ``tensorrpc, max_delay 5 ms`` and ``tensorrpc, max_delay 10 ms``: the same with
  ``max_delay=MID_DELAY_S`` (about the callers' turnaround, 64 times the client's CPU per
  call, on a quiet machine) and ``WIDE_DELAY_S`` (well above it): whether a batch waits
  for every caller instead of closing with those that came back in time;
* ``Ray Serve`` and ``Ray Serve, throughput-optimized``: the peer, Ray Serve's
  ``@serve.batch`` with the same handler and settings in one replica, the same 64 callers
  each awaiting ``handle.batched.remote(x)`` on its ``DeploymentHandle`` from an asyncio
  loop (``bench.peers.ray_serve_batch``, a child process: a private Ray on loopback,
  Serve's HTTP proxy off), with Serve's defaults and with its documented high-throughput
  mode; reported unavailable when ``ray.serve`` cannot be imported (``pip install
  'tensorrpc[bench-ray]'``);
* ``asyncio batcher``: the floor, a plain asyncio batcher written the way Ray Serve's
  documentation describes ``@serve.batch`` (a queue; a task takes the first item, then
  waits up to ``batch_wait_timeout_s`` for up to ``max_batch_size`` items and resolves one
  future per item), inside a plain tensorrpc method: what a user writes without built-in
  batching;
* ``small call``: the same 64 callers of a plain method with no step, for its CPU per
  call beside the batched call's (both ends);
* ``continuous``: 32 concurrent streams of ``TOKENS`` tokens, one step (``TOKEN_STEP_S``)
  per token for every active stream, ``@rpc(batch=Continuous(max_size=32))``, against one
  stream at a time (a plain streaming method, one step per token); and
  ``LATE_STREAMS`` streams that arrive while a batch is running, their first token's time
  split at the engine's step boundaries (`_late_figures`).

Each case is warmed up (a quarter of its budget, not recorded), then reports calls
(tokens) per second and the median and p99 latency per call (time to first token for
streams); the unary cases also report the CPU per call of the client (this process) and
of the engine, and the engine's full garbage collections during the case (the engine
freezes what it holds after start-up, as docs/batching.md advises). Every engine process
is started and reaped here, and every loop is bounded by a time budget.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import importlib
import importlib.util
import itertools
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio

import tensorrpc
from bench._common import Progress, guarded
from bench._report import MID_CASE, SERVE_CASE, SERVE_FAST_CASE, SMALL_CASE, WIDE_CASE
from bench.peers._suite import run_json_child
from tensorrpc import Batching, Continuous, current_batch, rpc, service

ROOT = Path(__file__).resolve().parents[1]
STEP_S = 0.005
TOKEN_STEP_S = 0.002
MAX_DELAY_S = 0.002
#: A ``max_delay`` about the 64 callers' turnaround on a quiet machine.
MID_DELAY_S = 0.005
#: A ``max_delay`` longer than the 64 callers take to come back (their turnaround).
WIDE_DELAY_S = 0.010
#: The ``max_delay`` of each batched method.
DELAYS = {"batched": MAX_DELAY_S, "batched_mid": MID_DELAY_S, "batched_wide": WIDE_DELAY_S}
#: The continuous method's ``max_delay`` (a stream joining a running batch never waits it).
STREAM_DELAY_S = 0.0
CALLERS = 64
STREAMS = 32
TOKENS = 32
LATE_STREAMS = 15
#: The seeds of the late streams (the engine logs their first step).
LATE_SEED = 999_000
#: Ray Serve's lines: `bench.peers.ray_serve_batch`'s ``--mode`` of each.
SERVE_CASES = {SERVE_CASE: "default", SERVE_FAST_CASE: "throughput"}


class _ServeBatch:
    """A batcher as Ray Serve's docs describe ``@serve.batch`` (the peer)."""

    def __init__(
        self, fn: Callable[[list[int]], Awaitable[list[int]]], max_batch_size: int, wait_s: float
    ) -> None:
        self._fn = fn
        self._max = max_batch_size
        self._wait = wait_s
        self._queue: asyncio.Queue[tuple[int, asyncio.Future[int]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, item: int) -> int:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await self._queue.put((item, future))
        return await future

    async def _loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self._wait
            while len(batch) < self._max:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            try:
                results = await self._fn([x for x, _ in batch])
            except Exception as exc:
                for _, f in batch:
                    if not f.done():
                        f.set_exception(exc)
                continue
            for (_, f), r in zip(batch, results, strict=True):
                if not f.done():
                    f.set_result(r)


class _FullCollections:
    """The engine's full (generation 2) garbage collections: how many, and the longest
    pause, since the last `take`."""

    def __init__(self) -> None:
        self._start = 0.0
        self.count = 0
        self.longest = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.longest = max(self.longest, time.perf_counter() - self._start)

    def take(self) -> tuple[int, float]:
        out = (self.count, self.longest)
        self.count, self.longest = 0, 0.0
        return out


@service
class Model:
    """The engine of this section."""

    def __init__(self) -> None:
        self._device = asyncio.Lock()
        # Batches and items of each batched method (and of the peer).
        self._counts = {m: [0, 0] for m in ("batched", "batched_mid", "batched_wide", "peer")}
        # The continuous method's steps, (start, end) on the monotonic clock, and the first
        # step of each late stream: seed -> (arrival, start, end) (see `_late`).
        self._steps: deque[tuple[float, float]] = deque(maxlen=100_000)
        self._joins: dict[int, tuple[float, float, float]] = {}
        # Each batched method's batches: (its oldest item's arrival, start, end, size).
        self._log = {m: deque[tuple[float, float, float, int]](maxlen=100_000) for m in DELAYS}
        self._peer = _ServeBatch(self._peer_batch, CALLERS, MAX_DELAY_S)
        self.server: tensorrpc.Server | None = None
        self._collections = _FullCollections()

    async def _step(self, seconds: float) -> None:
        async with self._device:
            await asyncio.sleep(seconds)

    @rpc
    async def echo(self, x: int) -> int:
        """The small call: no step (what a call costs the client and the engine)."""
        return x + 1

    @rpc
    async def one(self, x: int) -> int:
        await self._step(STEP_S)
        return x + 1

    async def _batch(self, method: str, x: list[int]) -> list[int]:
        counts = self._counts[method]
        counts[0] += 1
        counts[1] += len(x)
        start = time.monotonic()
        await self._step(STEP_S)
        if method in self._log:  # the items' waits: the oldest one's arrival
            waited = max(item.waited for item in current_batch().items)
            self._log[method].append((start - waited, start, time.monotonic(), len(x)))
        return [v + 1 for v in x]

    @rpc
    async def batch_log(self, method: str) -> list[tuple[float, float, float, int]]:
        """A batched method's batches since the last call: its oldest item's arrival, its
        start and end (monotonic clock), and its size."""
        log = list(self._log[method])
        self._log[method].clear()
        return log

    @rpc(batch=Batching(max_size=CALLERS, max_delay=MAX_DELAY_S))
    async def batched(self, x: list[int]) -> list[int]:
        return await self._batch("batched", x)

    @rpc(batch=Batching(max_size=CALLERS, max_delay=MID_DELAY_S))
    async def batched_mid(self, x: list[int]) -> list[int]:
        return await self._batch("batched_mid", x)

    @rpc(batch=Batching(max_size=CALLERS, max_delay=WIDE_DELAY_S))
    async def batched_wide(self, x: list[int]) -> list[int]:
        return await self._batch("batched_wide", x)

    @rpc
    async def counts(self, method: str) -> tuple[int, int]:
        """Batches and items of a batched method (``peer``: of the asyncio batcher)."""
        batches, items = self._counts[method]
        return batches, items

    @rpc
    async def batch_stats(self, method: str = "batched") -> dict[str, float]:
        """The engine's own figures of a batched method (its ``Server.statistics()``)."""
        if self.server is None:
            return {}
        stats = self.server.statistics().batching[method]
        keys = ("items", "batches", "queue_wait_sum_s", "run_time_sum_s")
        return {k: float(stats[k]) for k in keys}

    @rpc
    async def engine_figures(self) -> tuple[float, int, float]:
        """The engine's CPU seconds so far, and its full garbage collections since the
        last call: how many, and the longest pause in seconds."""
        return (time.process_time(), *self._collections.take())

    async def _peer_batch(self, xs: list[int]) -> list[int]:
        return await self._batch("peer", xs)

    @rpc
    async def peer(self, x: int) -> int:
        return await self._peer(x)

    @rpc
    async def generate(self, seed: int, n: int) -> AsyncIterator[int]:
        for i in range(n):
            await self._step(TOKEN_STEP_S)
            yield seed + i

    @rpc(batch=Continuous(max_size=STREAMS, max_delay=STREAM_DELAY_S))
    async def generate_batched(self, seed: list[int], n: list[int]) -> list[int]:
        start = time.monotonic()
        batch = current_batch()
        out = []
        joined = []
        for i, item in enumerate(batch.items):
            out.append(seed[i] + item.steps)
            if item.first and seed[i] >= LATE_SEED:
                joined.append((seed[i], start - item.waited))
            if item.steps + 1 >= n[i]:
                batch.end(i)
        await self._step(TOKEN_STEP_S)
        end = time.monotonic()
        self._steps.append((start, end))
        for s, arrival in joined:
            self._joins[s] = (arrival, start, end)
        return out

    @rpc
    async def step_log(
        self,
    ) -> tuple[list[tuple[float, float]], list[tuple[int, float, float, float]]]:
        """The continuous method's steps since the last call, ``(start, end)``, and the
        late streams' first steps, ``(seed, arrival, start, end)`` (monotonic clock)."""
        steps, joins = list(self._steps), [(k, *v) for k, v in self._joins.items()]
        self._steps.clear()
        self._joins.clear()
        return steps, joins


@dataclass(frozen=True, slots=True)
class Config:
    seconds: float
    ready_timeout: float


def config(quick: bool) -> Config:
    """The full or the reduced (``--quick``) budgets."""
    return Config(1.0 if quick else 4.0, 60.0)


def _summary(latencies: list[float], elapsed: float, count: int) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "n": count,
        "per_s": count / elapsed if elapsed > 0 else None,
        "median_ms": statistics.median(ordered) * 1e3 if ordered else None,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3
        if ordered
        else None,
    }


async def unary(stub: Any, method: str, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    fn = getattr(stub, method)

    async def caller(k: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            result = await fn(k * 1_000_000 + i)
            latencies.append(time.perf_counter() - t0)
            if result != k * 1_000_000 + i + 1:
                raise AssertionError(f"{method}: caller {k} got another caller's result")
            i += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(CALLERS):
            tg.start_soon(caller, k)
    return _summary(latencies, time.perf_counter() - start, len(latencies))


async def _streams(stub: Any, method: str, concurrent: int) -> dict[str, Any]:
    """``STREAMS`` streams of ``TOKENS`` tokens, ``concurrent`` at a time."""
    ttft: list[float] = []
    tokens = 0
    limit = anyio.Semaphore(concurrent)

    async def stream(k: int) -> None:
        nonlocal tokens
        async with limit:
            t0 = time.perf_counter()
            got: list[int] = []
            async for v in getattr(stub, method)(k * 1000, TOKENS):
                if not got:
                    ttft.append(time.perf_counter() - t0)
                got.append(v)
            if got != list(range(k * 1000, k * 1000 + TOKENS)):
                raise AssertionError(f"{method}: stream {k} got another stream's tokens")
            tokens += len(got)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(STREAMS):
            tg.start_soon(stream, k)
    out = _summary(ttft, time.perf_counter() - start, tokens)
    out["ttft_median_ms"] = out.pop("median_ms")
    out["ttft_p99_ms"] = out.pop("p99_ms")
    return out


async def _late(stub: Any) -> dict[str, Any]:
    """``LATE_STREAMS`` streams arrive, one after the other, each at a random point of a
    step, while a batch of ``STREAMS // 2`` streams runs; each reads its first token and
    closes. Their figures from `_late_figures`."""
    calls: list[tuple[int, float, float]] = []  # seed, call, first token (monotonic)
    async with anyio.create_task_group() as tg:
        started = anyio.Event()

        async def running(k: int) -> None:
            async for v in stub.generate_batched(k * 1000, 1_000_000):  # until cancelled
                if v == k * 1000:
                    started.set()

        for k in range(STREAMS // 2):
            tg.start_soon(running, k)
        await started.wait()
        await stub.step_log()  # from now on
        for i in range(LATE_STREAMS):
            await anyio.sleep(random.uniform(0.0, 2 * TOKEN_STEP_S))
            t0 = time.monotonic()
            stream = stub.generate_batched(LATE_SEED + i, 2)
            await stream.__anext__()
            calls.append((LATE_SEED + i, t0, time.monotonic()))
            await stream.aclose()
        steps, joins = await stub.step_log()
        tg.cancel_scope.cancel()  # the running streams
    return _late_figures(calls, steps, {j[0]: j[1:] for j in joins})


def _late_figures(
    calls: list[tuple[int, float, float]],
    steps: list[tuple[float, float]],
    joins: dict[int, tuple[float, float, float]],
) -> dict[str, Any]:
    """Where a late stream's first token goes, from the client's call (``t0``) and first
    token (``t1``) and the engine's steps (one monotonic clock: the same machine):

    * ``in``: the call's way to the batcher (client send, engine receive, dispatch):
      arrival - t0, the arrival being the first step's start - the item's queue wait;
    * ``residual``: the rest of the step that was running at its arrival (0 at a
      boundary);
    * ``boundary``: from the end of that step to the start of its own first step: the
      runner's work at the boundary, plus ``max_delay`` and any step it missed if the
      runner made it wait (the rules say it joins at the first boundary, without waiting);
    * ``own``: its first step; ``out``: from the end of that step to its first token at
      the client (the worker's send, the client's receive).

    ``t1 - t0 = in + residual + boundary + own + out``. The running step is the median
    time from one step's start to the next (the handler's step and the boundary)."""
    starts = [s for s, _ in steps]
    parts: dict[str, list[float]] = {
        k: [] for k in ("in", "residual", "boundary", "own", "out", "first_output", "ttft")
    }
    for seed, t0, t1 in calls:
        if seed not in joins:
            continue
        arrival, start, end = joins[seed]
        running = bisect.bisect_right(starts, arrival) - 1
        residual = max(0.0, steps[running][1] - arrival) if running >= 0 else 0.0
        for key, value in (
            ("in", arrival - t0),
            ("residual", residual),
            ("boundary", start - arrival - residual),
            ("own", end - start),
            ("out", t1 - end),
            ("first_output", end - arrival),
            ("ttft", t1 - t0),
        ):
            parts[key].append(value)
    periods = [b - a for a, b in itertools.pairwise(starts)]
    step = statistics.median(periods) if periods else math.nan
    ttft = parts["ttft"]
    in_steps = sorted(t / step for t in ttft) if step > 0 else []
    return {
        "late_ttft_ms": statistics.median(ttft) * 1e3 if ttft else None,
        "late_ttft_max_ms": max(ttft) * 1e3 if ttft else None,
        "late_ttft_steps": {
            "min": in_steps[0] if in_steps else None,
            "median": statistics.median(in_steps) if in_steps else None,
            "max": in_steps[-1] if in_steps else None,
            "n": len(in_steps),
        },
        "late_parts_ms": {
            k: {"median": statistics.median(v) * 1e3, "max": max(v) * 1e3}
            for k, v in parts.items()
            if v
        },
        # The bound of the rules: its first step starts after the rest of the running
        # step and max_delay; what exceeds it (slowest late stream).
        "late_join_extra_ms": (max(parts["boundary"]) - STREAM_DELAY_S) * 1e3
        if parts["boundary"]
        else None,
        "running_step_ms": step * 1e3,
        "stream_delay_ms": STREAM_DELAY_S * 1e3,
        "late_batch": STREAMS // 2,
    }


async def _batches(client: tensorrpc.Client[Model], method: str) -> tuple[int, int]:
    """The engine's batches and items of a batched method (``peer``: the peer) so far."""
    return await client.stub().counts(method)


async def _engine_batching(client: tensorrpc.Client[Model], method: str) -> dict[str, Any]:
    """The engine's own histograms of a batched method (its ``statistics()``)."""
    return dict(await client.stub().batch_stats(method))


def _engine_split(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Where a batched call's time goes on the engine: its mean wait in the queue and
    the mean handler run (the rest of its latency is outside the batcher)."""
    items = after["items"] - before["items"]
    runs = after["batches"] - before["batches"]
    return {
        "engine_queue_wait_ms": (after["queue_wait_sum_s"] - before["queue_wait_sum_s"])
        / items
        * 1e3
        if items
        else None,
        "engine_run_ms": (after["run_time_sum_s"] - before["run_time_sum_s"]) / runs * 1e3
        if runs
        else None,
    }


def _due_starts(log: list[tuple[float, float, float, int]], delay: float) -> dict[str, Any]:
    """Whether a batch waits longer than the rules say: for each batch that was due when
    the one before it ended (its oldest item had waited ``max_delay``), the time from that
    end to its start, which the rules make 0; and the share of the time the device ran a
    batch. (A batch that filled to ``max_size`` is due too, from when it filled, which
    the log does not hold: it counts only if it was due by its delay.)"""
    due = sorted(b[1] - a[2] for a, b in itertools.pairwise(log) if b[0] + delay <= a[2])
    span = log[-1][2] - log[0][1] if log else 0.0
    return {
        "due_start_ms": {
            "median": statistics.median(due) * 1e3,
            "p90": due[int(0.9 * (len(due) - 1))] * 1e3,
            "n": len(due),
        }
        if due
        else None,
        "device_busy": sum(e - s for _, s, e, _ in log) / span if span > 0 else None,
    }


async def _measure(cfg: Config, address: str, progress: Progress) -> dict[str, Any]:
    async with tensorrpc.Client(Model, bind=address) as client:
        await client.wait_for_engines(1, timeout=cfg.ready_timeout)
        stub = client.stub()
        out: dict[str, Any] = {}
        for name, method in (
            ("unbatched", "one"),
            ("tensorrpc", "batched"),
            (MID_CASE, "batched_mid"),
            (WIDE_CASE, "batched_wide"),
            ("asyncio batcher", "peer"),
            (SMALL_CASE, "echo"),
        ):
            progress(f"batching: {name}")
            await unary(stub, method, cfg.seconds / 4)  # warm-up, not recorded
            batched = method.startswith("batched")
            counted = batched or method == "peer"
            if counted:
                before = await _batches(client, method)
            if batched:
                engine_before = await _engine_batching(client, method)
                await stub.batch_log(method)  # from now on
            engine_cpu, _, _ = await stub.engine_figures()
            cpu = time.process_time()
            out[name] = await unary(stub, method, cfg.seconds)
            cpu = time.process_time() - cpu
            engine_after, collections, longest = await stub.engine_figures()
            calls = out[name]["n"]
            out[name].update(
                {
                    "client_cpu_us": cpu / calls * 1e6 if calls else None,
                    "engine_cpu_us": (engine_after - engine_cpu) / calls * 1e6 if calls else None,
                    "engine_full_gc": collections,
                    "engine_full_gc_longest_ms": longest * 1e3,
                }
            )
            if counted:
                after = await _batches(client, method)
                runs = after[0] - before[0]
                out[name]["mean_batch"] = (after[1] - before[1]) / runs if runs else None
            if batched:
                after_stats = await _engine_batching(client, method)
                out[name].update(_engine_split(engine_before, after_stats))
                out[name].update(_due_starts(await stub.batch_log(method), DELAYS[method]))
        progress("batching: streams")
        await _streams(stub, "generate_batched", STREAMS)  # warm-up, not recorded
        out["streams one at a time"] = await _streams(stub, "generate", 1)
        out["streams continuous"] = await _streams(stub, "generate_batched", STREAMS)
        out.update(await _late(stub))
        return out


def run(quick: bool, *, workdir: Path, progress: Progress) -> dict[str, Any]:
    """The section's figures (or why they are unavailable)."""
    cfg = config(quick)
    address = f"ipc://{workdir}/batching.sock"

    def serve_case(mode: str) -> dict[str, Any]:
        if importlib.util.find_spec("ray") is None:
            raise RuntimeError(
                "ray is not installed (optional: pip install 'tensorrpc[bench-ray]')"
            )
        try:
            importlib.import_module("ray.serve")
        except ImportError as exc:
            raise RuntimeError(
                f"ray.serve cannot be imported ({exc}; pip install 'tensorrpc[bench-ray]')"
            ) from None
        temp = str(workdir / "ray-serve")
        args = ["--seconds", str(cfg.seconds), "--temp-dir", temp, "--mode", mode]
        bound = 2 * cfg.ready_timeout + 20 * cfg.seconds + 120  # two starts of Ray at most
        return run_json_child("bench.peers.ray_serve_batch", args, timeout=bound)

    def case() -> dict[str, Any]:
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.batching", "--engine", address],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.DEVNULL,
        )

        async def bounded() -> dict[str, Any]:
            with anyio.fail_after(cfg.ready_timeout + 20 * cfg.seconds + 60):
                return await _measure(cfg, address, progress)

        try:
            result: dict[str, Any] = anyio.run(bounded)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        return result

    result = guarded(progress, "batching", case)
    if "unavailable" not in result:
        for name, mode in SERVE_CASES.items():
            result[name] = guarded(progress, f"batching: {name}", partial(serve_case, mode))
    result.update(
        {
            "step_ms": STEP_S * 1e3,
            "token_step_ms": TOKEN_STEP_S * 1e3,
            "max_delay_ms": MAX_DELAY_S * 1e3,
            "mid_delay_ms": MID_DELAY_S * 1e3,
            "wide_delay_ms": WIDE_DELAY_S * 1e3,
            "callers": CALLERS,
            "streams": STREAMS,
            "tokens": TOKENS,
            "peer": "Ray Serve's @serve.batch in one replica, called through its "
            "DeploymentHandle (await handle.batched.remote(x)) from an asyncio loop, with "
            "Serve's defaults and with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (its documented "
            "high-throughput mode); the asyncio batcher is the floor: @serve.batch as its "
            "docs describe it, hand-written in a tensorrpc method",
        }
    )
    return result


def _engine_main(address: str) -> None:
    async def main() -> None:
        model = Model()
        async with tensorrpc.Server(
            model, connect=address, engine_id="batching", max_concurrency=256
        ) as server:
            model.server = server
            # What docs/batching.md advises for an engine, once its model is loaded: what
            # is alive now is never scanned again, so a full collection (one every few
            # seconds under a batched load) scans what the calls allocate, not the heap.
            gc.collect()
            gc.freeze()
            await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", metavar="ADDRESS")
    args = parser.parse_args()
    if args.engine:
        _engine_main(args.engine)
