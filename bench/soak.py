"""Soak test: many calls across 3 engines and 2 clients; nothing lost, duplicated or misrouted.

``make soak`` (``python -m bench.soak``) runs, by default, 1,000,000 small calls and 10,000
tensor calls with 1,000 in flight, spread over two ``Client`` objects that each dial the
same three engine processes, bounded by ``--time-limit`` seconds (the run stops issuing
calls when it is spent and reports how far it got). ``--quick`` is a short version
(20,000 small and 500 tensor calls, 200 in flight), the one the test suite runs.

Every call carries a unique id that the engine echoes: a reply whose value is not the
caller's own id is **mis-delivered**; a call that never completes is **lost** (the run
would time out); an id completed twice, or an engine that handled more calls than were
issued, is a **duplicate**. The engines count what they handled, and the sum must equal
what the clients issued. Resident memory of the driver and of each engine is sampled
every 0.25 s; after warm-up (the first 20% of the calls) its peak must not grow by more
than ``rss_slack_mib`` (64 MiB) over the warm-up peak; the driver's file descriptors and
the ``/dev/shm`` entries of the driver and the engines must not grow. Figures are printed
and written as JSON (``--out``, default ``bench/results/soak.json``); the exit status is 1
if any check failed.

The engines are ``python -m bench.soak --serve ...`` processes, reaped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio
import torch

from bench._measure import shm_files_of
from tensorrpc._client import Client
from tensorrpc._exceptions import TensorRPCError
from tensorrpc._server import Server
from tensorrpc._service import rpc, service
from tensorrpc._stub import Stub

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "soak.json"
ENGINES = ("s1", "s2", "s3")
TENSOR_ELEMENTS = 64 * 1024  # 512 KiB of int64: travels out of band
#: RSS sampling period, seconds.
SAMPLE_S = 0.25


@service
class Soak:
    """Echoes ids; counts what it handled so that the driver can check for duplicates."""

    def __init__(self) -> None:
        self.handled = 0

    @rpc
    async def echo(self, uid: int) -> int:
        self.handled += 1
        return uid

    @rpc
    async def tensor(self, uid: int, x: torch.Tensor) -> torch.Tensor:
        self.handled += 1
        return x + uid

    @rpc
    async def handled_count(self) -> int:
        return self.handled

    @rpc
    async def rss(self) -> int:
        return _rss()


def _rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _shm_entries(pids: list[int]) -> int:
    """Entries of these processes in ``/dev/shm`` (not other programs': see `shm_files_of`)."""
    return len(shm_files_of(pids))


@dataclass
class Config:
    """What one soak run does."""

    calls: int = 1_000_000
    tensor_calls: int = 10_000
    in_flight: int = 1_000
    time_limit: float = 1800.0
    rss_slack_mib: float = 64.0
    transport: str = "frames"


@dataclass
class Figures:
    """What one soak run measured."""

    config: dict[str, Any]
    issued: int = 0
    completed: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    duplicated: int = 0
    misdelivered: int = 0
    engine_handled: int = 0
    elapsed_s: float = 0.0
    calls_per_s: float = 0.0
    time_limited: bool = False
    rss_driver_mib: list[float] = field(default_factory=list)
    rss_engines_mib: dict[str, list[float]] = field(default_factory=dict)
    rss_growth_after_warmup_mib: dict[str, float] = field(default_factory=dict)
    fds_after_warmup: int = 0
    fds_end: int = 0
    shm_before: int = 0
    shm_end: int = 0
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


# -- engines --------------------------------------------------------------------------------


def _write_address(address_file: str, endpoint: str) -> None:
    tmp = Path(address_file + ".tmp")
    tmp.write_text(endpoint + "\n")
    tmp.rename(address_file)


async def _serve(engine_id: str, bind: str, address_file: str) -> None:
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        async with Server(
            Soak(), bind=bind, engine_id=engine_id, max_concurrency=64, max_queued=4096
        ) as server:
            assert server.endpoint is not None
            _write_address(address_file, server.endpoint)
            await server.serve_forever()


class _Engines:
    def __init__(self, workdir: Path) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[IO[bytes]] = []
        self.addresses: dict[str, str] = {}
        self.workdir = workdir

    def start(self) -> None:
        for engine_id in ENGINES:
            addr_file = self.workdir / f"{engine_id}.addr"
            log = (self.workdir / f"{engine_id}.log").open("wb")
            self.logs.append(log)
            self.procs[engine_id] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.soak",
                    "--serve",
                    engine_id,
                    "--bind",
                    f"ipc://{self.workdir}/{engine_id}.sock",
                    "--address-file",
                    str(addr_file),
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        for engine_id, proc in self.procs.items():
            addr_file = self.workdir / f"{engine_id}.addr"
            while not addr_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"engine {engine_id} did not start")
                time.sleep(0.05)
            self.addresses[engine_id] = addr_file.read_text().strip()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for log in self.logs:
            log.close()


# -- driver ---------------------------------------------------------------------------------


async def _drive(config: Config, engines: _Engines, figures: Figures) -> None:
    total = config.calls + config.tensor_calls
    seen = bytearray(total)
    next_uid = 0
    warmup_at = max(1, total // 5)
    warm = anyio.Event()
    done = anyio.Event()
    start = time.monotonic()
    deadline = start + config.time_limit
    clients = [
        Client(Soak, connect=list(engines.addresses.values()), max_in_flight=config.in_flight)
        for _ in range(2)
    ]
    # every 1 in `stride` calls is a tensor call, spread evenly over the run
    stride = max(1, total // config.tensor_calls) if config.tensor_calls else 0

    async def tensor_call(stub: Stub[Soak], uid: int) -> bool:
        # In a function of its own, so that no worker keeps its last tensors alive while
        # it makes small calls (1,000 workers would hold a gigabyte).
        x = torch.full((TENSOR_ELEMENTS,), uid & 0xFFFF, dtype=torch.int64)
        y = await stub.tensor(uid, x)
        return bool(torch.equal(y, x + uid))

    async def worker(client: Client[Soak]) -> None:
        nonlocal next_uid
        stub = client.with_options(transport=config.transport).stub()  # type: ignore[arg-type]
        while next_uid < total and time.monotonic() < deadline:
            uid = next_uid
            next_uid += 1
            figures.issued += 1
            try:
                if stride and uid % stride == 0:
                    good = await tensor_call(stub, uid)
                else:
                    good = await stub.echo(uid) == uid
            except TensorRPCError as exc:
                figures.failed += 1
                name = type(exc).__name__
                figures.errors[name] = figures.errors.get(name, 0) + 1
                continue
            if seen[uid]:
                figures.duplicated += 1
            seen[uid] = 1
            figures.completed += 1
            if not good:
                figures.misdelivered += 1
            if figures.completed == warmup_at:
                warm.set()

    async def sampler() -> None:
        # the engines' RSS is read from /proc: no extra calls during the run
        while not done.is_set():
            figures.rss_driver_mib.append(round(_rss() / 2**20, 1))
            for engine_id, proc in engines.procs.items():
                with contextlib.suppress(OSError, ValueError):
                    figures.rss_engines_mib.setdefault(engine_id, []).append(
                        round(_rss(proc.pid) / 2**20, 1)
                    )
            with anyio.move_on_after(SAMPLE_S):
                await done.wait()

    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        with anyio.fail_after(60):
            for client in clients:
                await client.wait_for_engines(len(ENGINES))
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)

            async def mark_warm() -> None:
                await warm.wait()
                figures.fds_after_warmup = _fds()
                figures.config["warmup_samples"] = len(figures.rss_driver_mib)

            tg.start_soon(mark_warm)
            async with anyio.create_task_group() as workers:
                for i in range(config.in_flight):
                    workers.start_soon(worker, clients[i % 2])
            warm.set()
            done.set()
        figures.elapsed_s = round(time.monotonic() - start, 2)
        figures.time_limited = figures.issued < total
        handled = 0
        for engine_id in ENGINES:
            handled += await clients[0].with_options(engine=engine_id).stub().handled_count()
        figures.engine_handled = handled
    figures.fds_end = _fds()


def run(config: Config) -> Figures:
    """Run one soak (engines started and reaped here) and return its figures."""
    figures = Figures(config=asdict(config))
    figures.shm_before = _shm_entries([os.getpid()])
    with tempfile.TemporaryDirectory(prefix="tensorrpc-soak-") as tmp:
        engines = _Engines(Path(tmp))
        try:
            t0 = time.monotonic()
            engines.start()
            figures.config["engine_start_s"] = round(time.monotonic() - t0, 2)
            anyio.run(_drive, config, engines, figures)
        finally:
            t0 = time.monotonic()
            engines.stop()
            figures.config["engine_stop_s"] = round(time.monotonic() - t0, 2)
    figures.shm_end = _shm_entries([os.getpid(), *(p.pid for p in engines.procs.values())])
    figures.lost = figures.issued - figures.completed - figures.failed
    figures.calls_per_s = round(figures.completed / max(figures.elapsed_s, 1e-9), 1)
    warm_index = int(figures.config.get("warmup_samples", 0))
    series = {"driver": figures.rss_driver_mib, **figures.rss_engines_mib}
    for name, samples in series.items():
        if len(samples) > warm_index + 1:
            figures.rss_growth_after_warmup_mib[name] = round(
                max(samples[warm_index:]) - max(samples[: warm_index + 1]), 1
            )
    figures.checks = {
        "zero_lost": figures.lost == 0,
        "zero_failed": figures.failed == 0,
        "zero_duplicated": figures.duplicated == 0 and figures.engine_handled == figures.completed,
        "zero_misdelivered": figures.misdelivered == 0,
        "rss_flat_after_warmup": all(
            g <= config.rss_slack_mib for g in figures.rss_growth_after_warmup_mib.values()
        ),
        "no_fd_growth": figures.fds_end <= figures.fds_after_warmup,
        "no_shm_growth": figures.shm_end <= figures.shm_before,
    }
    return figures


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (``python -m bench.soak``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=None, help="small calls (1,000,000)")
    parser.add_argument("--tensor-calls", type=int, default=None, help="tensor calls (10,000)")
    parser.add_argument("--in-flight", type=int, default=None, help="calls in flight (1,000)")
    parser.add_argument("--time-limit", type=float, default=1800.0, help="seconds")
    parser.add_argument("--transport", choices=("frames", "auto"), default="frames")
    parser.add_argument("--quick", action="store_true", help="20,000 + 500 calls, 200 in flight")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--serve", metavar="ENGINE_ID", help=argparse.SUPPRESS)
    parser.add_argument("--bind", help=argparse.SUPPRESS)
    parser.add_argument("--address-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # One intra-op thread per process: 3 engines and the driver share the cores, and
    # torch's OpenMP pool would add milliseconds of wake-up to every small tensor op.
    torch.set_num_threads(1)
    if args.serve:
        anyio.run(_serve, args.serve, args.bind, args.address_file)
        return 0
    base = Config(calls=20_000, tensor_calls=500, in_flight=200) if args.quick else Config()
    config = Config(
        calls=args.calls if args.calls is not None else base.calls,
        tensor_calls=args.tensor_calls if args.tensor_calls is not None else base.tensor_calls,
        in_flight=args.in_flight if args.in_flight is not None else base.in_flight,
        time_limit=args.time_limit,
        transport=args.transport,
    )
    figures = run(config)
    report = asdict(figures)
    report["ok"] = figures.ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: v for k, v in report.items() if not k.startswith("rss_") or "growth" in k}
    print(json.dumps(summary, indent=2))
    print(f"figures written to {args.out}")
    return 0 if figures.ok else 1


if __name__ == "__main__":
    sys.exit(main())
