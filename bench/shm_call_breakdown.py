"""Where the time of one 64 MiB torch_shm call goes, through the runtime (issue 12).

Run: ``python -m bench.shm_call_breakdown [N] [--trace]``. Starts the transfer benchmark's
engine (``bench.peers.tensorrpc_peer``) in its own process and a client here, sends a
fresh 64 MiB ``float32`` tensor N times with ``transport="torch_shm"`` (a small result
back), alternating with a small call, and prints the medians of the call, of the client's
one copy into its pool (``_Fill.run``, timed in place) and of the small call. With
``--trace`` it also counts, on the engine, page faults (``perf stat``) and the system
calls that a per-call mapping or a privatized argument would make (``strace -c``: mmap,
munmap, mremap, openat); both slow the engine down, so the times are then not comparable.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import tensorrpc.transports.torch_shm as torch_shm
from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

_copies: list[float] = []
_fill = torch_shm._Fill.run


def _timed_copy(job: torch_shm._Fill, warmer: Any) -> None:
    t0 = time.perf_counter()
    _fill(job, warmer)
    _copies.append(time.perf_counter() - t0)


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _tracers(pid: int) -> list[subprocess.Popen[str]]:
    out = []
    if shutil.which("perf"):
        cmd = ["perf", "stat", "-e", "page-faults", "-p", str(pid)]
        out.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    if shutil.which("strace"):
        calls = "trace=mmap,munmap,mremap,openat"
        cmd = ["strace", "-c", "-f", "-e", calls, "-p", str(pid)]
        out.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    return out


async def _run(peer: PeerProcess, addr: str, n: int, trace: bool) -> None:
    client_cls, _ = runtime()
    async with client_cls(BenchService, bind=addr) as client:
        await wait_engine(client, peer, 60)
        shm = client.with_options(engine=ENGINE_ID, transport="torch_shm").stub()
        small = client.with_options(engine=ENGINE_ID, transport="frames").stub()
        t = torch.arange((64 << 20) // 4, dtype=torch.float32)
        for _ in range(5):  # warm up: segments made, pages faulted in, mappings cached
            await shm.consume(t)
        _copies.clear()
        proc = peer.proc
        tracers = _tracers(proc.pid) if trace and proc is not None else []
        if tracers:
            await asyncio.sleep(1.0)  # let them attach
        calls: list[float] = []
        smalls: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            await shm.consume(t)
            calls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await small.add(1, 2)
            smalls.append(time.perf_counter() - t0)
        print(
            f"64 MiB fresh torch_shm call {_ms(calls):.2f} ms; client copy {_ms(_copies):.2f} ms;"
            f" small call {_ms(smalls):.3f} ms (medians of {n})"
        )
        for tracer in tracers:
            tracer.send_signal(2)
            print(tracer.communicate(timeout=30)[1].strip())
        detail: Any = client.statistics().transports.torch_shm_detail
        print(f"client torch_shm: {detail}")


def main() -> None:
    """Entry point."""
    args = [a for a in sys.argv[1:] if a != "--trace"]
    n = int(args[0]) if args else 40
    torch_shm._Fill.run = _timed_copy  # type: ignore[method-assign,assignment]
    with tempfile.TemporaryDirectory(prefix="trpc-shm-") as tmp:
        addr = f"ipc://{tmp}/engine.sock"
        with PeerProcess("bench.peers.tensorrpc_peer", [addr], ready_timeout=60) as peer:
            asyncio.run(_run(peer, addr, n, "--trace" in sys.argv))


if __name__ == "__main__":
    main()
