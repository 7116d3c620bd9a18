"""Compression across hosts: the same calls with and without zstd, over tcp loopback.

Run: ``python -m bench.compression [--quick] [--calls N]`` (or ``python -m bench --only
compression``). An engine in its own process (``tensorrpc serve``, listening on
``tcp://127.0.0.1``) echoes a tensor; the client sends it and gets it back, both ways
compressed (``compression=Compression(level=...)``) or not. Payloads, made once from a
fixed seed:

* ``activations``: float32 ReLU activations, 1024 x 1024 (4 MiB): about half zeros, the
  rest noise, so partly compressible;
* ``token ids``: int64 ids below 50,000, 262,144 of them (2 MiB): the high bytes are zero;
* ``embeddings``: float32 unit vectors, 512 x 1024 (2 MiB), noise: nearly incompressible
  (compression then declines to send the larger frame and costs only the attempt).

Per case: the median round trip, the throughput (tensor bytes carried each way per
second), the bytes on the wire per call (both ways, all frames, from the client's
counters), and the CPU per call of the client (``time.process_time``) and of the engine
(its ``/proc/<pid>/stat`` user + system time), each over the same timed calls. Loopback
moves bytes at memory speed, so compression loses on time there; the ``break-even``
column is the link speed below which it wins: bytes saved per call ÷ extra CPU per call
(client + engine, the two ends of the link).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

import tensorrpc
from tensorrpc import Compression, rpc, service
from tensorrpc.testing import engine_processes

_TICKS = os.sysconf("SC_CLK_TCK")
LEVELS = (None, 1, 3)


@service
class Echo:
    """Returns what it gets (the engine side of the benchmark)."""

    @rpc
    async def echo(self, x: torch.Tensor) -> torch.Tensor:
        return x


def payloads() -> dict[str, torch.Tensor]:
    """The tensors sent, from a fixed seed."""
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(512, 1024, generator=gen)
    return {
        "activations": torch.relu(torch.randn(1024, 1024, generator=gen)),
        "token ids": torch.randint(0, 50_000, (262_144,), generator=gen),
        "embeddings": emb / emb.norm(dim=1, keepdim=True),
    }


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def _case(
    client: tensorrpc.Client[Echo], pid: int, x: torch.Tensor, level: int | None, calls: int
) -> dict[str, Any]:
    compression = None if level is None else Compression(level=level)
    stub = client.with_options(compression=compression, timeout=60).stub()
    for _ in range(3):  # warm up
        assert torch.equal(await stub.echo(x), x)
    engine_id = next(iter(client.engines))
    before = client.statistics().engines[engine_id]
    cpu, engine_cpu = time.process_time(), _cpu_s(pid)
    times = []
    started = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        await stub.echo(x)
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - started
    cpu, engine_cpu = time.process_time() - cpu, _cpu_s(pid) - engine_cpu
    after = client.statistics().engines[engine_id]
    wire = (after.bytes_sent - before.bytes_sent) + (after.bytes_received - before.bytes_received)
    return {
        "median_ms": statistics.median(times) * 1e3,
        "mb_per_s": x.nbytes * calls / wall / 1e6,
        "wire_bytes_per_call": wire / calls,
        "tensor_bytes": x.nbytes,
        "client_cpu_ms": cpu / calls * 1e3,
        "engine_cpu_ms": engine_cpu / calls * 1e3,
    }


async def _measure(workdir: Path, calls: int, progress: Callable[[str], None]) -> dict[str, Any]:
    del workdir  # the engine listens on tcp; nothing is written
    cases: dict[str, dict[str, Any]] = {}
    # Over tcp (loopback) the engine shares no memory with the client: frames, as across
    # hosts. The client binds, the engine dials it.
    async with tensorrpc.Client(Echo, bind="tcp://127.0.0.1:0") as client:
        address = client.addresses[0]
        with engine_processes(Echo, address, 1) as engines:
            await client.wait_for_engines(1, timeout=60)
            pid = engines[0].process.pid
            for name, x in payloads().items():
                row: dict[str, Any] = {}
                for level in LEVELS:
                    label = "none" if level is None else f"zstd {level}"
                    progress(f"compression: {name}, {label}")
                    row[label] = await _case(client, pid, x, level, calls)
                cases[name] = row
    return {"calls": calls, "cases": cases}


def run(quick: bool, *, workdir: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """Measure every payload at every level (``quick``: a few calls each)."""
    calls = 5 if quick else 40
    result: dict[str, Any] = anyio.run(_measure, workdir, calls, progress)
    return result


def report(results: dict[str, Any]) -> list[str]:
    """The markdown section of one run."""
    lines = ["## Compression over tcp loopback (zstd against none)", ""]
    if "unavailable" in results:
        return [*lines, f"unavailable: {results['unavailable']}"]
    lines += [
        f"{results['calls']} sequential echo calls per case (the tensor there and back); CPU "
        "per call; wire: bytes both ways per call. Break-even: the link speed below which "
        "compression is faster (bytes saved ÷ extra CPU of both ends).",
        "",
        "| payload | codec | median | throughput | wire / call | client CPU | engine CPU "
        "| break-even |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in results["cases"].items():
        base = row["none"]
        for label, f in row.items():
            even = "—"
            if label != "none":
                saved = (base["wire_bytes_per_call"] - f["wire_bytes_per_call"]) * 8
                extra = (
                    f["client_cpu_ms"]
                    + f["engine_cpu_ms"]
                    - base["client_cpu_ms"]
                    - base["engine_cpu_ms"]
                ) / 1e3
                if saved <= 0:
                    even = "never"
                elif extra > 0:
                    even = f"{saved / extra / 1e9:.2f} Gbit/s"
                else:
                    even = "always"
            lines.append(
                f"| {name} ({f['tensor_bytes'] / 2**20:.0f} MiB) | {label} "
                f"| {f['median_ms']:.2f} ms | {f['mb_per_s']:.0f} MB/s "
                f"| {f['wire_bytes_per_call'] / 2**20:.2f} MiB | {f['client_cpu_ms']:.2f} ms "
                f"| {f['engine_cpu_ms']:.2f} ms | {even} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.compression``: measure and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.compression", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few calls per case")
    parser.add_argument("--calls", type=int, help="calls per case (default 40)")
    args = parser.parse_args(argv)
    calls = args.calls or (5 if args.quick else 40)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        results = anyio.run(_measure, Path(tmp), calls, progress)
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
