"""A careless client: start N small calls at once, without awaiting each (issue 9 item 9).

Run from a checkout::

    python -m bench.careless --calls 100000            # asyncio
    python -m bench.careless --calls 100000 --backend trio
    python -m bench.careless --calls 1000 12000 50000  # several sizes, one engine each

The engine runs in its own process (``tensorrpc serve --bind ipc://<tmp>/e.sock
--engine-id e bench.careless:Echo``); the client dials it and starts every call in one
task group, each ``await stub.echo(i)`` in its own task. One line per size: calls done
and failed, wall seconds, the per-call rate, and the client's CPU seconds. ``--profile``
writes a cProfile of the client (``--profile out.prof``) for the largest size.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio

from tensorrpc import Client, rpc, service
from tensorrpc._exceptions import TensorRPCError

__all__ = ["Echo", "engine_process", "main", "run_one"]


@service
class Echo:
    """The trivial service every call of the benchmark goes to."""

    @rpc
    async def echo(self, x: int) -> int:
        """Return ``x``."""
        return x


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


@contextlib.contextmanager
def engine_process(address: str, engine_id: str = "e") -> Iterator[subprocess.Popen[bytes]]:
    """``tensorrpc serve --bind ADDRESS bench.careless:Echo`` in a subprocess (reaped)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), *sys.path])
    cmd = [sys.executable, "-m", "tensorrpc.cli", "serve", "--bind", address]
    cmd += ["--engine-id", engine_id, "--log-level", "warning", "bench.careless:Echo"]
    proc = subprocess.Popen(cmd, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def run_one(address: str, calls: int, limit_s: float) -> dict[str, float]:
    """Start ``calls`` calls at once against the engine at ``address``; what it took."""
    done = failed = 0
    errors: dict[str, int] = {}
    async with Client(Echo, connect=address) as client:
        await client.wait_for_engines(1, timeout=30)
        stub = client.stub()
        assert await stub.echo(1) == 1  # warm up

        async def one(i: int) -> None:
            nonlocal done, failed
            try:
                if await stub.echo(i) == i:
                    done += 1
                    return
            except TensorRPCError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            failed += 1

        cpu0 = _cpu()
        start = time.perf_counter()
        with anyio.move_on_after(limit_s):
            async with anyio.create_task_group() as tg:
                for i in range(calls):
                    tg.start_soon(one, i)
        wall = time.perf_counter() - start
        cpu = _cpu() - cpu0
    result = {"calls": calls, "done": done, "failed": failed, "wall_s": wall, "cpu_s": cpu}
    result["us_per_call"] = wall / calls * 1e6
    for name, count in errors.items():
        result[f"error {name}"] = count
    return result


def _line(result: dict[str, float]) -> str:
    extra = "".join(f", {k}: {v}" for k, v in result.items() if k.startswith("error "))
    return (
        f"{result['calls']:>7,} calls: {result['done']:,} done, {result['failed']:,} failed "
        f"in {result['wall_s']:.2f} s ({result['us_per_call']:.0f} µs per call), "
        f"client CPU {result['cpu_s']:.2f} s{extra}"
    )


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[100_000])
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per size")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the largest size")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/e.sock"
        with engine_process(address):
            _measure(address, args)


def _measure(address: str, args: argparse.Namespace) -> None:
    biggest = max(args.calls)
    for calls in args.calls:
        profiler = cProfile.Profile() if args.profile and calls == biggest else None
        if profiler is not None:
            profiler.enable()
        result = anyio.run(run_one, address, calls, args.timeout, backend=args.backend)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        print(f"[{args.backend}] {_line(result)}", flush=True)


if __name__ == "__main__":
    main()
