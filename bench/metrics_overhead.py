"""Observability overhead: the small-call round trip with metrics (and tracing) off and on.

``python -m bench.metrics_overhead [--rounds N] [--calls N] [--quick] [--json PATH]``

Three engine processes serve the same tiny service over ``ipc://``: one without an
observer, one with a [`PrometheusObserver`][tensorrpc.metrics.PrometheusObserver], one
with a ``TracingObserver`` and no OpenTelemetry SDK configured; three clients in this
process are set up the same way. The configurations are measured in interleaved rounds
(off, metrics, tracing, off, ...) of sequential calls, so that a busy machine slows all of
them alike; the figures are the median of the per-round medians and the median of the
per-round ratios to "off" (each round's configurations ran back to back). On a busy
machine round trips swing by more than the overhead, so the run also counts the CPU time
per call of the client (``time.process_time`` during its rounds) and of its engine
(``/proc/PID/stat``), summed over all rounds: the CPU cost is what an observer adds, and
it depends far less on the load than the wall clock does. It also times the hooks
themselves in a tight loop (client and engine side of one call, no I/O).
Every engine is started and reaped by the run; every loop is bounded by a count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from tensorrpc import Client, rpc, serve, service

CONFIGS = ("off", "metrics", "tracing (no SDK)")


@service
class Small:
    """The round-trip service: two ints in, one int out."""

    @rpc
    async def add(self, a: int, b: int) -> int:
        return a + b


def _observer(config: str) -> Any:
    if config == "metrics":
        from prometheus_client import CollectorRegistry

        from tensorrpc.metrics import PrometheusObserver

        return PrometheusObserver(CollectorRegistry())
    if config.startswith("tracing"):
        from tensorrpc.tracing import TracingObserver

        return TracingObserver()
    return None


async def _engine(address: str, config: str) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve(Small(), bind=address, engine_id=config, observer=_observer(config))
            )
            async for _ in signals:
                tg.cancel_scope.cancel()
                break


async def _round(client: Client[Small], calls: int) -> float:
    """Median round trip of ``calls`` sequential calls, in microseconds."""
    add = client.stub().add
    samples = []
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        await add(i, 1)
        samples.append(clock() - t0)
    return statistics.median(samples) / 1e3


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(
    addresses: dict[str, str], pids: dict[str, int], rounds: int, calls: int
) -> dict[str, Any]:
    medians: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu = {c: [0.0, 0.0] for c in CONFIGS}  # client, engine CPU seconds over the rounds
    clients = {c: Client(Small, connect=addresses[c], observer=_observer(c)) for c in CONFIGS}
    async with clients["off"], clients["metrics"], clients["tracing (no SDK)"]:
        with anyio.fail_after(60):
            for client in clients.values():
                await client.wait_for_engines(1)
        with anyio.fail_after(max(120.0, rounds * calls * len(CONFIGS) * 0.01)):
            for client in clients.values():
                await _round(client, min(calls, 500))  # warm-up
            for _ in range(rounds):
                for config in CONFIGS:
                    engine0, client0 = _cpu_seconds(pids[config]), time.process_time()
                    medians[config].append(await _round(clients[config], calls))
                    cpu[config][0] += time.process_time() - client0
                    cpu[config][1] += _cpu_seconds(pids[config]) - engine0
    out: dict[str, Any] = {"rounds": rounds, "calls_per_round": calls, "configs": {}}
    total = rounds * calls
    cpu_off = (cpu["off"][0] + cpu["off"][1]) / total * 1e6
    for config in CONFIGS:
        ratios = [m / o for m, o in zip(medians[config], medians["off"], strict=True)]
        cpu_us = (cpu[config][0] + cpu[config][1]) / total * 1e6
        out["configs"][config] = {
            "median_us": round(statistics.median(medians[config]), 2),
            "ratio_to_off": round(statistics.median(ratios), 4),
            "client_cpu_us_per_call": round(cpu[config][0] / total * 1e6, 2),
            "engine_cpu_us_per_call": round(cpu[config][1] / total * 1e6, 2),
            "cpu_ratio_to_off": round(cpu_us / cpu_off, 4),
            "round_medians_us": [round(m, 2) for m in medians[config]],
            "hook_us_per_call": round(_hook_cost(config), 3),
        }
    return out


def _hook_cost(config: str, n: int = 20_000) -> float:
    """CPU microseconds the observer hooks of one call take (client side + engine side)."""
    observer = _observer(config)
    if observer is None:
        return 0.0
    clock = time.perf_counter_ns
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(n):
            call = observer.client_call("S", "add", "e", False, 12, "inline")
            if call is not None:
                call.trace_context()
                call.finished("ok", 10)
            served = observer.engine_call("S", "add", "e", "c", False, b"", 12)
            if served is not None:
                served.started()
                served.finished("ok", 0)
        best = min(best, (clock() - t0) / n / 1e3)
    return best


def run(rounds: int, calls: int) -> dict[str, Any]:
    """Start the engines, measure, reap them; return the figures."""
    with tempfile.TemporaryDirectory(prefix="trpc-obs-") as tmp:
        addresses = {c: f"ipc://{tmp}/{i}.sock" for i, c in enumerate(CONFIGS)}
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.metrics_overhead", "--engine", addresses[c], c],
                env=env,
            )
            for c in CONFIGS
        ]
        try:
            pids = {c: p.pid for c, p in zip(CONFIGS, procs, strict=True)}
            return anyio.run(_measure, addresses, pids, rounds, calls)
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=15)


def main(argv: list[str] | None = None) -> int:
    """The command line; prints a markdown table (and writes JSON with ``--json``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_overhead")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 200 calls")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--engine", nargs=2, metavar=("ADDRESS", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        anyio.run(_engine, *args.engine)
        return 0
    rounds, calls = (3, 200) if args.quick else (args.rounds, args.calls)
    result = run(rounds, calls)
    result["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"small-call round trip, {rounds} interleaved rounds x {calls} sequential calls")
    print(f"load average at the end: {result['loadavg']}")
    print(
        "| configuration | median round trip | vs off (median of round ratios) "
        "| CPU per call: client + engine | CPU vs off | hooks alone (tight loop) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for config, r in result["configs"].items():
        print(
            f"| {config} | {r['median_us']:.1f} µs | {100 * (r['ratio_to_off'] - 1):+.1f}% "
            f"| {r['client_cpu_us_per_call']:.1f} + {r['engine_cpu_us_per_call']:.1f} µs "
            f"| {100 * (r['cpu_ratio_to_off'] - 1):+.1f}% | {r['hook_us_per_call']:.2f} µs |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
