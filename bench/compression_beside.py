"""Small calls beside compressed large calls: does zstd stall the client's event loop?

``python -m bench.compression_beside [--seconds S]``: an engine in its own process
(``bench.peers.tensorrpc_peer``, listening on tcp loopback); one task of the client calls
``add(1, 2)`` every 2 ms, first alone, then while another task echoes a 4 MiB float32
ReLU activation tensor with ``Compression(level=1)`` back to back. It prints the small
calls' p50/p99/max latency in both phases and how many echoes ran. Compression and
decompression of a large frame run on a worker thread (docs/compression.md): the small
calls should not wait for them. Every loop is bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import anyio
import torch

from bench._common import run_async
from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine


def _q(sorted_s: list[float], p: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(p * len(sorted_s)))] * 1e3


async def _smalls(stub: Any, lat: list[float], stop: anyio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        if await stub.add(1, 2) != 3:
            raise RuntimeError("wrong reply to add(1, 2)")
        lat.append(time.perf_counter() - start)
        await anyio.sleep(0.002)


def run(seconds: float) -> str:
    """One measurement; the line to print."""
    from tensorrpc import Compression

    client_cls, _ = runtime()
    addr = f"tcp://127.0.0.1:{20000 + os.getpid() % 20000}"
    x = torch.relu(torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)))

    async def case(peer: PeerProcess) -> dict[str, Any]:
        async with client_cls(BenchService, connect=addr) as client:
            await wait_engine(client, peer, 60)
            plain = client.with_options(engine=ENGINE_ID).stub()
            packed = client.with_options(engine=ENGINE_ID, compression=Compression(level=1))
            packed_stub = packed.stub()
            for _ in range(50):
                await plain.add(1, 2)
            alone: list[float] = []
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_smalls, plain, alone, stop)
                await anyio.sleep(seconds / 2)
                stop.set()
            under: list[float] = []
            stop, echoes = anyio.Event(), 0
            async with anyio.create_task_group() as tg:
                tg.start_soon(_smalls, plain, under, stop)
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    await packed_stub.echo(x)
                    echoes += 1
                stop.set()
            alone.sort()
            under.sort()
            return {
                "line": f"small calls alone: p50 {_q(alone, 0.5):.2f} "
                f"p99 {_q(alone, 0.99):.2f} ms; "
                f"beside zstd echoes of 4 MiB: p50 {_q(under, 0.5):.2f} "
                f"p99 {_q(under, 0.99):.2f} max {under[-1] * 1e3:.1f} ms; "
                f"{echoes} echoes in {seconds:g} s"
            }

    with PeerProcess("bench.peers.tensorrpc_peer", [addr, "--listen"], ready_timeout=60) as peer:
        result = run_async(lambda: case(peer), 300)
    return str(result["line"])


def main() -> None:
    """Entry point: ``python -m bench.compression_beside [--seconds S]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="each phase (default 4)")
    print(run(parser.parse_args().seconds), flush=True)


if __name__ == "__main__":
    main()
