"""``python -m bench``: measure tensorrpc beside the systems people use today.

Sections (all by default, in one run): ``roundtrip`` (small call, 64 in flight),
``transfer`` (tensors of 4 KiB, 1 MiB, 64 MiB), ``codec`` (``bench.codec_bench``),
``scale`` (one client with 1, 8 and 64 engines, ``bench.scale``), ``batching`` (batched
against unbatched calls and continuous batching of streams, ``bench.batching``), ``mixed``
(small calls' tail latency while large tensors go through the same client and engine,
``bench.mixed``), ``compression`` (zstd against none over tcp loopback, ``bench.compression``).
Every server runs in its own process, is started and reaped by this run, and every
loop is bounded by a count and a time budget; the whole run is also bounded, and a case
that would start past that bound is recorded as skipped. Results go to ``--out``
(default ``bench/results``): ``bench.json``, ``bench.md`` and ``latency_vs_size.png``;
the markdown is printed at the end.

Options: ``--quick`` (reduced budgets, for smoke tests), ``--only SECTION`` (repeatable),
``--out DIR``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import _common, _report

SECTIONS = ("roundtrip", "transfer", "codec", "scale", "batching", "mixed", "compression")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: the whole run must finish within 10 minutes on 2 cores; cases past this are skipped
RUN_BUDGET_S = 540.0
QUICK_BUDGET_S = 240.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError):
        pass
    return None


def _version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return "not installed"
    return str(getattr(mod, "__version__", "?"))


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """What this run ran on, recorded beside the figures."""
    import torch
    import zmq

    return {
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_total_gib": _mem_total_gib(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "grpcio": _version("grpc"),
        "ormsgpack": _version("ormsgpack"),
        "numpy": _version("numpy"),
        "anyio": _version("anyio"),
        "git_commit": _git_commit(),
    }


def _codec(quick: bool) -> dict[str, Any]:
    if importlib.util.find_spec("bench.codec_bench") is None:
        raise RuntimeError("bench.codec_bench is not there")
    mod = importlib.import_module("bench.codec_bench")
    result: dict[str, Any] = mod.run(quick=quick)
    return result


def _progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced budgets (smoke test)")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="run only this section (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--system",
        action="append",
        help="run only this system's case (repeatable; names as in the tables)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    sections = args.only or list(SECTIONS)
    started = time.monotonic()
    _common.set_deadline(started + (QUICK_BUDGET_S if args.quick else RUN_BUDGET_S))
    results: dict[str, Any] = {"quick": args.quick, "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="trpc-bench-") as tmp:
        workdir = Path(tmp)
        if "roundtrip" in sections:
            from bench import roundtrip

            results["roundtrip"] = roundtrip.run(
                args.quick, workdir=workdir, progress=_progress, systems=args.system
            )
        if "transfer" in sections:
            from bench import transfer

            results["transfer"] = transfer.run(
                args.quick, workdir=workdir, progress=_progress, systems=args.system
            )
        if "scale" in sections:
            from bench import scale

            results["scale"] = scale.run(args.quick, workdir=workdir, progress=_progress)
        if "batching" in sections:
            from bench import batching

            results["batching"] = batching.run(args.quick, workdir=workdir, progress=_progress)

        if "mixed" in sections:
            from bench import mixed

            results["mixed"] = mixed.run(
                args.quick, workdir=workdir, progress=_progress, systems=args.system
            )
        if "codec" in sections:
            results["codec"] = _common.guarded(_progress, "codec", lambda: _codec(args.quick))
        if "compression" in sections:
            from bench import compression

            results["compression"] = _common.guarded(
                _progress,
                "compression",
                lambda: compression.run(args.quick, workdir=workdir, progress=_progress),
            )
    results["machine"]["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results["duration_s"] = time.monotonic() - started
    paths = _report.write(results, args.out)
    print(paths["markdown"].read_text(encoding="utf-8"))
    for kind, path in paths.items():
        _progress(f"wrote {kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
