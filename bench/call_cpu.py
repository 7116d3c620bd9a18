"""CPU per call, client and engine, for the small call (two ints → int).

    python -m bench.call_cpu [--calls 20000] [--inflight 64] [--runs 3] [--system pyzmq]

One engine process (``bench.peers.tensorrpc_peer``, dialling in over ``ipc://``) and a
client here. After a warm-up of 2,000 calls, each run makes ``--calls`` calls with
``--inflight`` of them outstanding (``--inflight 1``: one at a time) and reports, per call,
the wall time, the client's CPU time (this process, every thread) and the engine's (its
``/proc/PID/stat``). CPU time per call moves much less than wall time when other work
shares the machine, so two versions of tensorrpc can be compared on a busy host. To
compare an older checkout, run this file with that checkout on ``PYTHONPATH``::

    cd OLD && PYTHONPATH=$PWD python /path/to/bench/call_cpu.py

``--system pyzmq`` measures the floor the same way: the raw pyzmq server
(``bench.peers.zmq_peer``) with a ping-pong client for ``--inflight 1`` (the ``pyzmq``
row of ``python -m bench --only roundtrip``) and the call-id → future client for more
(``pyzmq (futures)``), so both ratios come from one tool in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

WARMUP = 2_000


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _calls(stub: Any, calls: int, inflight: int) -> None:
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if await stub.add(1, 2) != 3:
                raise RuntimeError("wrong reply")

    await asyncio.gather(*(worker() for _ in range(inflight)))


async def _runs(stub: Any, pid: int, args: argparse.Namespace) -> list[dict[str, float]]:
    await _calls(stub, WARMUP, args.inflight)
    rows = []
    for _ in range(args.runs):
        engine0, client0, wall0 = process_cpu_s(pid), time.process_time(), time.perf_counter()
        await _calls(stub, args.calls, args.inflight)
        wall = time.perf_counter() - wall0
        n = args.calls
        rows.append(
            {
                "wall_us": wall / n * 1e6,
                "calls_per_s": n / wall,
                "client_cpu_us": (time.process_time() - client0) / n * 1e6,
                "engine_cpu_us": (process_cpu_s(pid) - engine0) / n * 1e6,
            }
        )
    return rows


async def _measure(
    peer: PeerProcess, addr: str, args: argparse.Namespace
) -> list[dict[str, float]]:
    assert peer.proc is not None
    if args.system == "pyzmq":
        from bench.peers.zmq_peer import ZmqClient, ZmqFutureClient

        if args.inflight == 1:
            ping = ZmqClient(addr)
            try:
                return await _runs(ping, peer.proc.pid, args)
            finally:
                ping.close()
        async with ZmqFutureClient(addr) as futures:
            return await _runs(futures, peer.proc.pid, args)
    client_cls, _ = runtime()
    async with client_cls(BenchService, bind=addr) as client:
        await wait_engine(client, peer, 60.0)
        return await _runs(client.with_options(engine=ENGINE_ID).stub(), peer.proc.pid, args)


def main() -> None:
    """Print one line per run and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--inflight", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--system", choices=("tensorrpc", "pyzmq"), default="tensorrpc")
    args = parser.parse_args()
    peer_module = {"tensorrpc": "bench.peers.tensorrpc_peer", "pyzmq": "bench.peers.zmq_peer"}
    with tempfile.TemporaryDirectory(prefix="trpc-cpu-") as tmp:
        addr = f"ipc://{tmp}/e.sock"
        with PeerProcess(peer_module[args.system], [addr], ready_timeout=60.0) as peer:
            rows = asyncio.run(_measure(peer, addr, args))
    keys = ("wall_us", "calls_per_s", "client_cpu_us", "engine_cpu_us")
    load = os.getloadavg()[0]
    print(f"{args.calls} calls, {args.inflight} in flight; load {load:.2f}; {args.system}")
    for row in rows:
        print("  ".join(f"{k} {row[k]:.1f}" for k in keys))
    print("median  " + "  ".join(f"{k} {statistics.median(r[k] for r in rows):.1f}" for k in keys))


if __name__ == "__main__":
    main()
