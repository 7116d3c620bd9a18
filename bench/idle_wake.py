"""What idle costs the next call: a small call after the client and engine slept.

Run: ``python -m bench.idle_wake [--calls 15]``. One engine (the transfer benchmark's,
``bench.peers.tensorrpc_peer``) in its own process and a client here; for each idle
time the client sleeps, then makes two ``add(1, 2)`` calls back to back and reports the
median of each. On a virtual machine the first call after tens of milliseconds of idle
pays for waking the vCPUs (and caches gone cold) on both ends: here about 1 ms after
50 ms idle, against 0.2-0.3 ms back to back. A benchmark that leaves the processes idle
between timed calls (the transfer benchmark's ``DataLoader`` line fetches its batches
untimed) must keep that out, or time its reference the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

IDLE_MS = (0, 10, 50, 100, 200)


async def _run(peer: PeerProcess, addr: str, calls: int) -> None:
    client_cls, _ = runtime()
    async with client_cls(BenchService, bind=addr) as client:
        await wait_engine(client, peer, 60)
        small = client.with_options(engine=ENGINE_ID, transport="frames").stub()
        for _ in range(50):
            await small.add(1, 2)
        for idle in IDLE_MS:
            first: list[float] = []
            second: list[float] = []
            for _ in range(calls):
                if idle:
                    await asyncio.sleep(idle / 1000)
                t0 = time.perf_counter()
                await small.add(1, 2)
                t1 = time.perf_counter()
                await small.add(1, 2)
                t2 = time.perf_counter()
                first.append(t1 - t0)
                second.append(t2 - t1)
            print(
                f"idle {idle:4d} ms: first call {statistics.median(first) * 1e3:.3f} ms, "
                f"second {statistics.median(second) * 1e3:.3f} ms (medians of {calls})"
            )


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=15)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trpc-idle-") as tmp:
        addr = f"ipc://{tmp}/engine.sock"
        with PeerProcess("bench.peers.tensorrpc_peer", [addr], ready_timeout=60) as peer:
            asyncio.run(_run(peer, addr, ns.calls))


if __name__ == "__main__":
    main()
