"""Where the time of one 64 MiB torch_shm call goes, through the runtime (issues 12, 20).

Run: ``python -m bench.shm_call_breakdown [N] [--trace]``. Starts the transfer benchmark's
engine (``bench.peers.tensorrpc_peer``) in its own process and a client here, and sends N
times a new 64 MiB ``float32`` tensor (ten pre-made ones, cycled, all held: their
allocation and free stay out of the timing) with ``transport="torch_shm"``, a small
result back. Beside each call, in turn: a small call, a call with a ``tensorrpc.share()``
tensor (only a handle travels: the call without the copy), an empty hop to a worker
thread and back, and one ``Tensor.copy_`` (one thread) of a source into a preallocated
tensor in shared memory. Prints the medians of each, and of the call's stages, stamped in
place on the client:

* ``to place``: from the call to its tensor's placement (engine choice, encoding);
* ``place``: taking a region and writing the handle;
* ``to copy``: from the placement to the first byte copied (the hop to a worker thread);
* ``copy``: the copy into the pool (``_Fill.run``; split over the copier's threads);
* ``to send``: from the copy's end to the CALL's send (the hop back to the event loop);
* ``round trip``: from the send to the reply (the engine's work and both wake-ups).

With ``--trace`` it also counts, on the engine, page faults (``perf stat``) and the system
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

import anyio.to_thread
import torch

import tensorrpc
import tensorrpc._client_calls as client_calls
import tensorrpc.transports.torch_shm as torch_shm
from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

NBYTES = 64 << 20
SOURCES = 10
_marks: dict[str, float] = {}


def _stamp(name: str, fn: Any) -> Any:
    """``fn`` with ``_marks[name]`` set to the clock as it starts."""

    def stamped(*args: Any) -> Any:
        _marks[name] = time.perf_counter()
        return fn(*args)

    return stamped


def _stamp_end(name: str, fn: Any) -> Any:
    """``fn`` with ``_marks[name]`` set to the clock as it ends."""

    def stamped(*args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            _marks[name] = time.perf_counter()

    return stamped


def _instrument() -> None:
    place = torch_shm.TorchShmTransport._place
    run = torch_shm._Fill.run
    torch_shm.TorchShmTransport._place = _stamp("place0", _stamp_end("place1", place))  # type: ignore[method-assign]
    torch_shm._Fill.run = _stamp("copy0", _stamp_end("copy1", run))  # type: ignore[method-assign]
    send = client_calls.CallRunner._send_call
    client_calls.CallRunner._send_call = _stamp("send", send)  # type: ignore[method-assign]


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f}"


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


def _stages(t0: float, t1: float) -> dict[str, float]:
    m = _marks
    return {
        "to place": m["place0"] - t0,
        "place": m["place1"] - m["place0"],
        "to copy": m["copy0"] - m["place1"],
        "copy": m["copy1"] - m["copy0"],
        "to send": m["send"] - m["copy1"],
        "round trip": t1 - m["send"],
    }


async def _run(peer: PeerProcess, addr: str, n: int, trace: bool) -> None:
    client_cls, _ = runtime()
    async with client_cls(BenchService, bind=addr) as client:
        await wait_engine(client, peer, 60)
        shm = client.with_options(engine=ENGINE_ID, transport="torch_shm").stub()
        small = client.with_options(engine=ENGINE_ID, transport="frames").stub()
        sources = [torch.arange(NBYTES // 4, dtype=torch.float32) for _ in range(SOURCES)]
        shared = tensorrpc.share(sources[0].clone())
        dst = tensorrpc.share(torch.zeros_like(sources[0]))
        for t in sources:  # warm up: segment made, pages faulted in, mapping cached
            await shm.consume(t)
        await shm.consume(shared)
        proc = peer.proc
        tracers = _tracers(proc.pid) if trace and proc is not None else []
        if tracers:
            await asyncio.sleep(1.0)  # let them attach
        rows: dict[str, list[float]] = {}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i in range(n):
                t0 = time.perf_counter()
                await shm.consume(sources[i % SOURCES])
                t1 = time.perf_counter()
                row = {"call": t1 - t0, **_stages(t0, t1)}
                t0 = time.perf_counter()
                await small.add(1, 2)
                row["small call"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                await shm.consume(shared)
                row["share() call"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                await anyio.to_thread.run_sync(int)
                row["thread hop"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                dst.copy_(sources[(i + SOURCES // 2) % SOURCES])
                row["one copy_"] = time.perf_counter() - t0
                for key, value in row.items():
                    rows.setdefault(key, []).append(value)
        finally:
            torch.set_num_threads(threads)
        print(f"64 MiB, a new tensor each call, torch_shm: medians of {n}, ms")
        for key, values in rows.items():
            print(f"  {key:>13} {_ms(values)}")
        ratio = statistics.median(rows["call"]) / statistics.median(rows["one copy_"])
        print(f"  call ÷ one copy_: {ratio:.2f}")
        for tracer in tracers:
            tracer.send_signal(2)
            print(tracer.communicate(timeout=30)[1].strip())
        detail: Any = client.statistics().transports.torch_shm_detail
        print(f"client torch_shm: {detail}")


def main() -> None:
    """Entry point."""
    args = [a for a in sys.argv[1:] if a != "--trace"]
    n = int(args[0]) if args else 40
    _instrument()
    with tempfile.TemporaryDirectory(prefix="trpc-shm-") as tmp:
        addr = f"ipc://{tmp}/engine.sock"
        with PeerProcess("bench.peers.tensorrpc_peer", [addr], ready_timeout=60) as peer:
            asyncio.run(_run(peer, addr, n, "--trace" in sys.argv))


if __name__ == "__main__":
    main()
