"""CPU per call of the torch_shm alias paths, each end, through the runtime (issue 20).

Run: ``python -m bench.shm_alias_cpu [--calls 400] [--rounds 3] [--only KIND ...]``.
Starts the transfer benchmark's engine (``bench.peers.tensorrpc_peer``) in its own
process and a client here, then for each kind makes ``--calls`` sequential calls and
reads the CPU time both processes (all their threads) spent on each: the client's
from ``getrusage``, the engine's from the scheduler's counters
(``/proc/<pid>/task/*/schedstat``), read around each call. CPU, unlike wall time, moves
little when other work shares the machine; a figure is the minimum over ``--rounds``
of the mean per call, in µs (and the minimum of the rounds' median wall time). Kinds:

* ``small``: ``add(1, 2)``, frames (the reference);
* ``tiny``: the alias kinds' handler (``consume``) on a 64-byte tensor, inline in the
  payload (frames): what any tensor argument costs both ends beside ``small``, no
  transport involved;
* ``torch_shared``: one 64 MiB ``share_memory_()`` tensor, sent again each call;
* ``torch_new``: a 64 MiB ``share_memory_()`` tensor not sent before each call (what a
  ``DataLoader`` batch is to the transport; ``--new-calls`` of them), made and freed
  outside the timed CPU;
* ``share``: one 64 MiB `tensorrpc.share` tensor, sent again each call.

Every 64 MiB tensor goes by alias (the run fails otherwise: the counters are checked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

import tensorrpc
from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

SIZE = 64 << 20
#: New shared tensors alive at once (``torch_new``).
WINDOW = 4


def _own_cpu() -> float:
    """Seconds on a CPU of every thread of this process (one system call)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _Threads:
    """Seconds on a CPU of every thread of another process, from the scheduler's ns
    counters (``/proc/<pid>/task/*/schedstat``); the files stay open, so a reading is a
    ``pread`` per thread. `refresh` (untimed) picks up threads started since."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fds: dict[str, int] = {}
        self.refresh()

    def refresh(self) -> None:
        for task in os.listdir(f"/proc/{self.pid}/task"):
            if task not in self._fds:
                with contextlib.suppress(OSError):
                    self._fds[task] = os.open(f"/proc/{self.pid}/task/{task}/schedstat", 0)

    def cpu(self) -> float:
        total = 0
        for fd in self._fds.values():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(os.pread(fd, 100, 0).split()[0])
        return total / 1e9

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _tensor() -> torch.Tensor:
    return torch.arange(SIZE // 4, dtype=torch.float32)


def _new_shared() -> torch.Tensor:
    # (one thread: torch's OpenMP workers spin for a while after a parallel op, and
    # that CPU would land in the next call's figure)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = _tensor()
        t.share_memory_()  # type: ignore[no-untyped-call]
        return t
    finally:
        torch.set_num_threads(threads)


async def _timed(call: Awaitable[Any], engine: _Threads, acc: list[Any]) -> None:
    """Await ``call``; add the CPU both processes spent meanwhile to ``acc[0:2]`` and
    append its wall time to ``acc[2]``."""
    c0, e0 = _own_cpu(), engine.cpu()
    w0 = time.perf_counter()
    await call
    w1 = time.perf_counter()
    c1, e1 = _own_cpu(), engine.cpu()
    acc[0] += c1 - c0
    acc[1] += e1 - e0
    acc[2].append(w1 - w0)


async def _measure(
    call: Callable[[int], Awaitable[Any]], calls: int, engine: _Threads
) -> tuple[float, float, float]:
    """CPU per call in µs ``(client, engine)``, counted around each call (so that every
    kind pays the same for reading the counters: compare kinds, not absolute figures)."""
    acc: list[Any] = [0.0, 0.0, []]
    for i in range(calls):
        await _timed(call(i), engine, acc)
    return acc[0] / calls * 1e6, acc[1] / calls * 1e6, statistics.median(acc[2]) * 1e6


async def _measure_new(
    call: Callable[[torch.Tensor], Awaitable[Any]], calls: int, engine: _Threads
) -> tuple[float, float, float]:
    """As `_measure`, each call a new ``share_memory_()`` tensor: made and freed
    (``WINDOW`` at a time, like a loader's batches) between the timed calls."""
    acc: list[Any] = [0.0, 0.0, []]
    done = 0
    while done < calls:
        batch = [_new_shared() for _ in range(min(WINDOW, calls - done))]
        for t in batch:
            await _timed(call(t), engine, acc)
        done += len(batch)
        del batch, t
    return acc[0] / calls * 1e6, acc[1] / calls * 1e6, statistics.median(acc[2]) * 1e6


def _signal_and_wait(folder: str, name: str, text: str, wait_for: str) -> None:
    """Write ``folder/name`` (atomically), then wait (at most 10 min) for
    ``folder/wait_for`` to exist: the hand-shake of ``--pause`` with a tracer."""
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(folder, wait_for)) and time.monotonic() < deadline:
        time.sleep(0.1)


async def _run(peer: PeerProcess, addr: str, ns: argparse.Namespace) -> None:
    client_cls, _ = runtime()
    assert peer.proc is not None
    pid = peer.proc.pid
    async with client_cls(BenchService, bind=addr) as client:
        await wait_engine(client, peer, 60)
        shm = client.with_options(engine=ENGINE_ID, transport="torch_shm").stub()
        small = client.with_options(engine=ENGINE_ID, transport="frames").stub()
        torch_shared = _tensor().share_memory_()  # type: ignore[no-untyped-call]
        shared = tensorrpc.share(_tensor())
        tiny = torch.arange(16, dtype=torch.float32)
        kinds: dict[str, Callable[[int], Awaitable[Any]]] = {
            "small": lambda i: small.add(1, 2),
            "tiny": lambda i: small.consume(tiny),
            "torch_shared": lambda i: shm.consume(torch_shared),
            "share": lambda i: shm.consume(shared),
        }
        best: dict[str, tuple[float, float, float]] = {}
        engine = _Threads(pid)
        if ns.pause:  # (for tracers: DIR/pause names the engine's pid; wait for DIR/go)
            await asyncio.to_thread(_signal_and_wait, ns.pause, "pause", str(pid), "go")
        for _ in range(ns.rounds):
            for kind, call in kinds.items():
                if ns.only and kind not in ns.only:
                    continue
                n = ns.calls
                for i in range(10):  # warm up
                    await call(n + i)
                engine.refresh()
                got = await _measure(call, n, engine)
                old = best.get(kind, got)
                best[kind] = (min(old[0], got[0]), min(old[1], got[1]), min(old[2], got[2]))
            if not ns.only or "torch_new" in ns.only:
                engine.refresh()
                got = await _measure_new(shm.consume, ns.new_calls, engine)
                old = best.get("torch_new", got)
                best["torch_new"] = (min(old[0], got[0]), min(old[1], got[1]), min(old[2], got[2]))
        engine.close()
        if ns.pause:  # (DIR/done: the calls are over; wait for DIR/end to exit)
            await asyncio.to_thread(_signal_and_wait, ns.pause, "done", "", "end")
        detail: Any = client.statistics().transports.torch_shm_detail
        if detail.tensors_aliased != detail.tensors_sent:
            raise RuntimeError(f"not every tensor went by alias: {detail}")
    for kind, (cli, eng, wall) in best.items():
        print(
            f"{kind:13s} client {cli:8.1f} µs  engine {eng:8.1f} µs  (CPU per call)"
            f"  wall {wall:8.1f} µs (median)"
        )


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--new-calls", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument(
        "--pause",
        metavar="DIR",
        default="",
        help="for tracers: write the engine's pid to DIR/pause, start once DIR/go exists, "
        "write DIR/done after the calls and exit once DIR/end exists",
    )
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trpc-alias-") as tmp:
        addr = f"ipc://{tmp}/engine.sock"
        with PeerProcess("bench.peers.tensorrpc_peer", [addr], ready_timeout=60) as peer:
            asyncio.run(_run(peer, addr, ns))


if __name__ == "__main__":
    main()
