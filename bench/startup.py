"""Start-up of the command line: wall time of whole ``tensorrpc`` processes.

    python -m bench.startup [--runs 10]

Each line runs one command ``--runs`` times, each time a fresh process
(``python -m tensorrpc.cli ...``, what the ``tensorrpc`` script runs), and reports the
median and fastest wall time, the median CPU time of the process (user + system, which
moves much less than wall time when other work shares the machine) and whether the
command imported torch (one more run under ``-X importtime``):

* ``--version``: target under 0.3 s;
* ``call ADDR add a=2 b=5`` to a live engine (one ``BenchService`` engine process, bound
  on ``ipc://``, started here): target under 0.6 s;
* the same call to an address where nothing serves, with ``--timeout 1``: it fails after
  the timeout (1 s here; 10 s by default), which the error states;
* ``python -c "import torch"``, for scale: what every command paid before torch was
  imported only when a tensor is involved.

Bytecode is written on the first run (``PYTHONDONTWRITEBYTECODE`` is cleared), as an
installed package has it; the first run is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers._proc import PeerProcess, child_env

CLI = [sys.executable, "-m", "tensorrpc.cli"]
TARGETS = {"--version": 0.3, "call (live engine)": 0.6}


def _env() -> dict[str, str]:
    env = child_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run_once(argv: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and exit status of one process running ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        argv, env=_env(), capture_output=True, timeout=120, check=False, cwd=Path.cwd()
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def _imports_torch(argv: list[str]) -> bool:
    done = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # "import time: self | cumulative | <indent>torch", indented by its depth
    return any(line.split("|")[-1].strip() == "torch" for line in done.stderr.splitlines())


def measure(name: str, argv: list[str], runs: int, expect_status: int = 0) -> dict[str, object]:
    """One line of the report: ``argv`` run ``runs`` times after a warm-up run."""
    _run_once(argv)
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(runs):
        wall, cpu, status = _run_once(argv)
        if status != expect_status:
            raise RuntimeError(f"{name}: exit status {status}, expected {expect_status}")
        walls.append(wall)
        cpus.append(cpu)
    return {
        "name": name,
        "wall_median_s": statistics.median(walls),
        "wall_min_s": min(walls),
        "cpu_median_s": statistics.median(cpus),
        "imports_torch": _imports_torch(argv),
        "target_s": TARGETS.get(name),
    }


def _line(row: dict[str, object]) -> str:
    target = row["target_s"]
    verdict = ""
    if isinstance(target, float):
        met = float(row["wall_median_s"]) < target  # type: ignore[arg-type]
        verdict = f"  target < {target:g} s: {'met' if met else 'MISSED'}"
    return (
        f"{row['name']:<28} wall median {row['wall_median_s']:.3f} s "
        f"(fastest {row['wall_min_s']:.3f} s), cpu {row['cpu_median_s']:.3f} s, "
        f"imports torch: {'yes' if row['imports_torch'] else 'no'}{verdict}"
    )


async def _engine(address: str) -> None:
    """The engine process of this benchmark: serve BenchService on ``address``."""
    import anyio

    import tensorrpc
    from bench.peers._child import ready, wait_stdin_eof
    from bench.peers.tensorrpc_peer import BenchService

    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: tensorrpc.serve(
                BenchService(), bind=address, engine_id="startup", task_status=task_status
            )
        )
        ready(address)
        await wait_stdin_eof()
        tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__)
    parser.add_argument("--runs", type=int, default=10, help="timed runs per line")
    parser.add_argument(
        "--no-torch-line", action="store_true", help="skip the 'import torch' line (seconds)"
    )
    parser.add_argument("--engine", metavar="ADDR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        asyncio.run(_engine(args.engine))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="trpc-startup-") as tmp:
        address = f"ipc://{tmp}/engine.sock"
        rows.append(measure("--version", [*CLI, "--version"], args.runs))
        with PeerProcess("bench.startup", ["--engine", address]):
            call = [*CLI, "call", address, "add", "a=2", "b=5"]
            rows.append(measure("call (live engine)", call, args.runs))
        nobody = [*CLI, "call", f"ipc://{tmp}/nobody.sock", "add", "a=2", "b=5", "--timeout", "1"]
        rows.append(measure("call (nobody, --timeout 1)", nobody, args.runs, expect_status=1))
    if not args.no_torch_line:
        torch = [sys.executable, "-c", "import torch"]
        rows.append(measure("import torch (for scale)", torch, args.runs))
    print(f"{args.runs} runs each, {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}")
    for row in rows:
        print(_line(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
