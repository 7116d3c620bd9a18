"""Shared memory an engine still holds after a client sent it tensors and freed them (issue 20).

Run: ``python -m bench.shm_held [--count 100] [--mib 64]``. Starts the transfer
benchmark's engine (``bench.peers.tensorrpc_peer``) in its own process and a client here
that, ``count`` times, makes a ``tensorrpc.share()`` tensor of ``mib`` MiB, sends it
(``torch_shm``: by alias, the engine maps the client's memfd) and frees it. Then it reads
the engine's ``/proc/<pid>/maps``: the bytes of tensorrpc memfds the engine has mapped,
right after the last call and again once the engine's periodic sweep has run (polled,
at most ``--wait`` seconds). The client has freed every tensor, so whatever the engine
still maps is memory held for nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from typing import Any

import torch

import tensorrpc
from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

MIB = 1 << 20


def mapped_memfd_bytes(pid: int, prefix: str = "/memfd:tensorrpc") -> tuple[int, int]:
    """``(mappings, bytes)`` of the tensorrpc memfds process ``pid`` maps now."""
    n = total = 0
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                n += 1
                total += hi - lo
    return n, total


async def _until_aliased(client: Any, stub: Any) -> tuple[int, int]:
    """Send a small shared tensor until one goes by alias (the engine has joined, but the
    torch_shm handshake may still be under way); return the counters then."""
    for _ in range(200):
        await stub.consume(tensorrpc.share(torch.zeros(1024)))
        detail = client.statistics().transports.torch_shm_detail
        if detail is not None and detail.tensors_aliased:
            return detail.tensors_aliased, detail.tensors_sent
        await asyncio.sleep(0.05)  # (bounded: 200 tries)
    raise RuntimeError("torch_shm never carried a tensor to the engine")


async def _run(peer: PeerProcess, addr: str, count: int, mib: int, wait: float) -> None:
    client_cls, _ = runtime()
    assert peer.proc is not None
    pid = peer.proc.pid
    async with client_cls(BenchService, bind=addr) as client:
        await wait_engine(client, peer, 120)
        stub = client.with_options(engine=ENGINE_ID, transport="torch_shm").stub()
        numel = mib * MIB // 4
        first = await _until_aliased(client, stub)
        base = mapped_memfd_bytes(pid)
        peak = base
        for i in range(count):
            t = tensorrpc.share(torch.full((numel,), float(i)))
            got = await stub.consume(t)
            if tuple(got) != (numel, float(i), float(i)):
                raise RuntimeError(f"wrong reply {got!r}")
            del t  # the client frees it (its lease ended with the reply)
            now = mapped_memfd_bytes(pid)
            peak = max(peak, now, key=lambda x: x[1])
        after = mapped_memfd_bytes(pid)
        deadline = time.monotonic() + wait
        swept = after
        while swept[0] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the engine's sweep runs once per heartbeat interval
            swept = mapped_memfd_bytes(pid)
        detail = client.statistics().transports.torch_shm_detail
        assert detail is not None
        print(
            f"{count} share() tensors of {mib} MiB sent and freed; aliased "
            f"{detail.tensors_aliased - first[0]} of {detail.tensors_sent - first[1]}"
        )
        print(
            f"engine maps of tensorrpc memfds before: {base[0]} mappings, {base[1] / MIB:.0f} MiB"
        )
        print(f"engine, most during the run: {peak[0]} mappings, {peak[1] / MIB:.0f} MiB")
        print(f"engine right after the last call: {after[0]} mappings, {after[1] / MIB:.0f} MiB")
        print(
            f"engine after its sweep (waited up to {wait:.0f} s): {swept[0]} mappings, "
            f"{swept[1] / MIB:.0f} MiB"
        )


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--wait", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trpc-held-") as tmp:
        addr = f"ipc://{tmp}/engine.sock"
        with PeerProcess("bench.peers.tensorrpc_peer", [addr], ready_timeout=120) as peer:
            asyncio.run(_run(peer, addr, args.count, args.mib, args.wait))


if __name__ == "__main__":
    main()
