"""CPU per call that pass-through interceptors add (one on the client, one on the engine).

    python -m bench.interceptor_cpu [--calls 20000] [--inflight 16] [--rounds 6]

Two engines and two clients run in this process, on one asyncio loop, over ``ipc://``:
one pair plain, the other with a pass-through interceptor on the client and one on the
engine (``return await proceed()``). Each round makes ``--calls`` small calls (two ints
→ int, ``--inflight`` outstanding) through the plain pair and through the intercepted
pair, in alternating order, and records the process CPU time per call (client and engine
together: both are in this process). The difference of the medians is the cost of the
two interceptors per call. CPU time moves much less than wall time on a loaded host, and
alternating the two cases spreads drifts (other work, frequency changes) over both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import tensorrpc
from bench.peers.tensorrpc_peer import BenchService

WARMUP = 2_000


async def passthrough(call: object, proceed: Callable[[], Awaitable[Any]]) -> Any:
    """The interceptor measured: does nothing but go on."""
    return await proceed()


async def _calls(stub: Any, calls: int, inflight: int) -> None:
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if await stub.add(1, 2) != 3:
                raise RuntimeError("wrong reply")

    await asyncio.gather(*(worker() for _ in range(inflight)))


async def _cpu_per_call_us(stub: Any, calls: int, inflight: int) -> float:
    start = time.process_time()
    await _calls(stub, calls, inflight)
    return (time.process_time() - start) / calls * 1e6


async def measure(calls: int, inflight: int, rounds: int) -> dict[str, list[float]]:
    """CPU µs per call, per round, for ``"plain"`` and ``"intercepted"``."""
    out: dict[str, list[float]] = {"plain": [], "intercepted": []}
    with tempfile.TemporaryDirectory(prefix="trpc-icpt-") as tmp:
        plain_addr, icpt_addr = f"ipc://{tmp}/plain.sock", f"ipc://{tmp}/icpt.sock"
        async with (
            tensorrpc.Server(BenchService(), bind=plain_addr, engine_id="plain"),
            tensorrpc.Server(
                BenchService(), bind=icpt_addr, engine_id="icpt", interceptors=[passthrough]
            ),
            tensorrpc.Client(BenchService, connect=plain_addr) as plain_client,
            tensorrpc.Client(
                BenchService, connect=icpt_addr, interceptors=[passthrough]
            ) as icpt_client,
        ):
            await plain_client.wait_for_engines(1, timeout=30)
            await icpt_client.wait_for_engines(1, timeout=30)
            stubs = {"plain": plain_client.stub(), "intercepted": icpt_client.stub()}
            for stub in stubs.values():
                await _calls(stub, WARMUP, inflight)
            for i in range(rounds):
                order = ["plain", "intercepted"] if i % 2 == 0 else ["intercepted", "plain"]
                for name in order:
                    out[name].append(await _cpu_per_call_us(stubs[name], calls, inflight))
    return out


def main() -> None:
    """Print one line per round, the medians and their difference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    rows = asyncio.run(measure(args.calls, args.inflight, args.rounds))
    print(
        f"{args.calls} calls x {args.rounds} rounds, {args.inflight} in flight; "
        f"load {os.getloadavg()[0]:.2f}; CPU us per call (client + engine)"
    )
    for plain, icpt in zip(rows["plain"], rows["intercepted"], strict=True):
        print(f"  plain {plain:.1f}  intercepted {icpt:.1f}  difference {icpt - plain:+.1f}")
    plain_median = statistics.median(rows["plain"])
    icpt_median = statistics.median(rows["intercepted"])
    print(
        f"median plain {plain_median:.1f}  intercepted {icpt_median:.1f}  "
        f"interceptors (client + engine) {icpt_median - plain_median:+.2f} us per call"
    )


if __name__ == "__main__":
    main()
