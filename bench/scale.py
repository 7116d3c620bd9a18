"""Scale: one client with 1, 8 and 64 engines (``python -m bench --only scale``).

The engines run in up to 8 processes (64 engines: 8 processes x 8 engines, each engine its
own ``serve()`` with its own socket), dialling the client over ``ipc://``. For each engine
count the section measures, on the client:

* ``join_ms``: every engine process is started and has imported everything, then all are
  told to serve at once; the time until the client has them all live (handshakes of all
  engines joining together);
* ``rss_per_engine_kib``: the client's resident memory after the join minus before, per
  engine (ZMQ connection buffers, the registry, statistics);
* ``call``: sequential balanced calls, one at a time: median and p99 latency, and the
  client's CPU time per call (``time.process_time`` of the client process);
* ``busy``: 128 calls kept in flight, so that every engine has calls in flight and a
  balanced pick cannot stop at the first idle engine: calls per second and client CPU
  per call;
* ``broadcast``: one broadcast to every engine: median latency;
* ``select_us``: the balancing decision alone (``EngineRegistry.select`` with every
  engine busy), a pure function timed in a loop: it shows how the pick grows with the
  engine count, free of the noise of the rest.

Every loop is bounded by a count and a time budget; every engine process is reaped.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

import tensorrpc
from bench._common import Progress, guarded
from tensorrpc import rpc, service

COUNTS = (1, 8, 64)
MAX_PROCS = 8
BUSY_INFLIGHT = 128
ROOT = Path(__file__).resolve().parents[1]


@service
class Echo:
    """The engine of this section: answers at once."""

    @rpc
    async def ping(self, x: int) -> int:
        return x


@dataclass(frozen=True, slots=True)
class Config:
    """Budgets of the scale section."""

    calls: int
    seconds: float
    busy_calls: int
    broadcasts: int
    select_loops: int
    ready_timeout: float


def config(quick: bool) -> Config:
    """The full or the reduced (``--quick``) budgets."""
    if quick:
        return Config(300, 0.6, 1000, 10, 2000, 120.0)
    return Config(3000, 3.0, 10_000, 50, 20_000, 180.0)


def _rss_kib() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def select_cost_us(n: int, loops: int) -> float:
    """Microseconds per ``EngineTable.select(None)`` with ``n`` engines, all busy."""
    from tensorrpc._engines import Engine, EngineInfo, EngineTable

    registry = EngineTable(max_in_flight=1024)
    for i in range(n):
        info = EngineInfo(engine_id=f"e{i}", service="Echo", fingerprint="f", protocol_version=1)
        engine = Engine(info=info, peer=f"p{i}".encode())
        registry.add(engine)
        engine.calls.add(i)  # one call in flight on every engine
    started = time.perf_counter()
    for _ in range(loops):
        registry.select(None)
    return (time.perf_counter() - started) / loops * 1e6


class _Engines:
    """Engine processes, started prepared and told to serve at once."""

    def __init__(self, address: str, n: int) -> None:
        procs = min(MAX_PROCS, n)
        per = n // procs
        self.procs: list[subprocess.Popen[str]] = []
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        for p in range(procs):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench.scale", "--engine", address, f"p{p}", str(per)],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )

    def wait_ready(self) -> None:
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "ready" once everything is imported
            if line.strip() != "ready":
                raise RuntimeError(f"engine process {proc.pid} did not get ready: {line!r}")

    def go(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


async def _measure(n: int, cfg: Config, workdir: Path) -> dict[str, Any]:
    address = f"ipc://{workdir}/scale-{n}.sock"
    async with tensorrpc.Client(Echo, bind=address, max_in_flight=1024) as client:
        engines = _Engines(address, n)
        try:
            with anyio.fail_after(cfg.ready_timeout):
                await anyio.to_thread.run_sync(engines.wait_ready, abandon_on_cancel=True)
            rss_before = _rss_kib()
            started = time.perf_counter()
            engines.go()
            await client.wait_for_engines(n, timeout=cfg.ready_timeout)
            join_ms = (time.perf_counter() - started) * 1e3
            rss_after = _rss_kib()
            stub = client.stub()
            for i in range(min(200, cfg.calls)):  # warm-up
                await stub.ping(i)
            latencies: list[float] = []
            cpu0, t0 = time.process_time(), time.perf_counter()
            for i in range(cfg.calls):
                c = time.perf_counter()
                await stub.ping(i)
                latencies.append(time.perf_counter() - c)
                if c - t0 > cfg.seconds:
                    break
            cpu_call = (time.process_time() - cpu0) / len(latencies)
            latencies.sort()
            used = {k for k, s in client.statistics().engines.items() if s.calls}

            done = 0
            cpu0, t0 = time.process_time(), time.perf_counter()

            async def worker() -> None:
                nonlocal done
                while done < cfg.busy_calls and time.perf_counter() - t0 < cfg.seconds:
                    done += 1
                    await stub.ping(done)

            async with anyio.create_task_group() as tg:
                for _ in range(BUSY_INFLIGHT):
                    tg.start_soon(worker)
            busy_s = time.perf_counter() - t0
            busy_cpu = (time.process_time() - cpu0) / max(done, 1)

            bcast: list[float] = []
            for _ in range(cfg.broadcasts):
                c = time.perf_counter()
                results = await client.broadcast("ping", 1)
                bcast.append(time.perf_counter() - c)
                assert len(results) == n
            return {
                "engines": n,
                "processes": len(engines.procs),
                "join_ms": join_ms,
                "rss_per_engine_kib": (rss_after - rss_before) / n,
                "call": {
                    "n": len(latencies),
                    "median_us": statistics.median(latencies) * 1e6,
                    "p99_us": latencies[int(len(latencies) * 0.99) - 1] * 1e6,
                    "client_cpu_us": cpu_call * 1e6,
                    "engines_used": len(used),
                },
                "busy": {
                    "calls": done,
                    "calls_per_s": done / busy_s,
                    "client_cpu_us": busy_cpu * 1e6,
                },
                "broadcast": {"n": len(bcast), "median_us": statistics.median(bcast) * 1e6},
                "select_us": select_cost_us(n, cfg.select_loops),
            }
        finally:
            engines.close()


def run(quick: bool, *, workdir: Path, progress: Progress) -> dict[str, Any]:
    """Measure every engine count; a failing count is recorded as unavailable."""
    cfg = config(quick)
    out: dict[str, Any] = {}
    for n in COUNTS:
        out[str(n)] = guarded(
            progress,
            f"scale {n} engines",
            lambda n=n: anyio.run(  # type: ignore[misc]
                functools.partial(_bounded, n, cfg, workdir)
            ),
        )
    return {"engines": out, "busy_inflight": BUSY_INFLIGHT}


async def _bounded(n: int, cfg: Config, workdir: Path) -> dict[str, Any]:
    with anyio.fail_after(cfg.ready_timeout * 2):
        return await _measure(n, cfg, workdir)


def _engine_main(address: str, prefix: str, count: int) -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(
                    functools.partial(
                        tensorrpc.serve, Echo(), connect=address, engine_id=f"{prefix}-{i}"
                    )
                )

    anyio.run(main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", nargs=3, metavar=("ADDRESS", "PREFIX", "COUNT"))
    args = parser.parse_args()
    if args.engine:
        _engine_main(args.engine[0], args.engine[1], int(args.engine[2]))
