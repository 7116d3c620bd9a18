"""Large calls alone: 64 MiB in / out / echo over frames (or torch_shm), both topologies.

``python -m bench.large_calls [--calls N] [--topology T] [--transport torch_shm]
[--background-nice N]``: an engine in its own process
(``bench.peers.tensorrpc_peer``, ``ipc://`` in a temporary directory); after two warm-up
calls, ``N`` sequential calls per direction (``in``: the client sends the tensor; ``out``:
the engine sends one; ``echo``: both ways). Prints the throughput (tensor bytes carried
per second) and the CPU per call of the client (``time.process_time``) and of the engine
(its ``/proc/<pid>/stat`` user + system time): the large-throughput side of the
mixed-load benchmark, without the small calls beside it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from bench._common import background_nice_arg, run_async
from bench.peers._proc import PeerProcess
from bench.peers.tensorrpc_peer import (
    ENGINE_ID,
    BenchService,
    apply_background_nice,
    runtime,
    wait_engine,
)

SIZE = 64 << 20
TOPOLOGIES = ("client dials", "engine dials in")


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(workdir: str, topology: str, calls: int, transport: str = "frames") -> dict[str, Any]:
    """``{direction: (MiB/s, client CPU ms/call, engine CPU ms/call)}`` for one topology."""
    import tensorrpc

    client_cls, _ = runtime()
    listen = topology == "client dials"
    addr = f"ipc://{workdir}/large-{'listen' if listen else 'dialin'}.sock"
    release: Callable[[Any], None] = getattr(tensorrpc, "release_later", lambda _: None)

    async def case(peer: PeerProcess) -> dict[str, Any]:
        assert peer.proc is not None
        where = {"connect": addr} if listen else {"bind": addr}
        async with client_cls(BenchService, **where) as client:
            await wait_engine(client, peer, 60)
            stub = client.with_options(engine=ENGINE_ID, transport=transport).stub()
            t = torch.ones(SIZE // 4)

            async def send_in() -> None:
                await stub.consume(t)

            async def get_out() -> None:
                release(await stub.produce(SIZE, False))

            async def echo() -> None:
                release(await stub.echo(t))

            ops: dict[str, Callable[[], Awaitable[None]]] = {
                "in": send_in,
                "out": get_out,
                "echo": echo,
            }
            out: dict[str, Any] = {}
            for name, op in ops.items():
                for _ in range(2):
                    await op()
                cpu0, eng0 = time.process_time(), _cpu_of(peer.proc.pid)
                wall0 = time.perf_counter()
                for _ in range(calls):
                    await op()
                wall = time.perf_counter() - wall0
                cpu = time.process_time() - cpu0
                eng = _cpu_of(peer.proc.pid) - eng0
                moved = SIZE * calls * (2 if name == "echo" else 1)
                out[name] = (moved / wall / (1 << 20), cpu / calls * 1e3, eng / calls * 1e3)
            return out

    args = [addr, "--listen"] if listen else [addr]
    with PeerProcess("bench.peers.tensorrpc_peer", args, ready_timeout=60) as peer:
        result: dict[str, Any] = run_async(lambda: case(peer), 600)
    return result


def main() -> None:
    """Entry point: ``python -m bench.large_calls [--calls N] [--topology T] [--transport]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=8, help="calls per direction (default 8)")
    parser.add_argument("--topology", choices=TOPOLOGIES, action="append")
    parser.add_argument("--transport", choices=("frames", "torch_shm"), default="frames")
    parser.add_argument(
        "--background-nice",
        type=background_nice_arg,
        default=None,
        help="tensorrpc.set_background_nice(N or idle) in the client and the engine",
    )
    args = parser.parse_args()
    if args.background_nice is not None:
        apply_background_nice(args.background_nice)
    with tempfile.TemporaryDirectory() as workdir:
        for topology in args.topology or TOPOLOGIES:
            for name, (mib, client, engine) in measure(
                workdir, topology, args.calls, args.transport
            ).items():
                print(
                    f"{topology:16s} {name:5s} {mib:8.0f} MiB/s  client CPU {client:6.1f} "
                    f"ms/call  engine CPU {engine:6.1f} ms/call",
                    flush=True,
                )


if __name__ == "__main__":
    main()
