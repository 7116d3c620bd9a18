"""CPU per call that pass-through interceptors add (one on the client, one on the engine).

    python -m bench.interceptor_cpu [--calls 20000] [--inflight 16] [--rounds 6]
    python -m bench.interceptor_cpu --micro [--calls 200000] [--rounds 6]

Two engines and two clients run in this process, on one asyncio loop, over ``ipc://``:
one pair plain, the other with a pass-through interceptor on the client and one on the
engine (``return await proceed()``). Each round makes ``--calls`` small calls (two ints
→ int, ``--inflight`` outstanding) through the plain pair and through the intercepted
pair, in alternating order, and records the process CPU time per call (client and engine
together: both are in this process). The difference of the medians is the cost of the
two interceptors per call. CPU time moves much less than wall time on a loaded host, and
alternating the two cases spreads drifts (other work, frequency changes) over both.

On a loaded host the end-to-end figures move by tens of microseconds from round to
round, more than the interceptors cost. ``--micro`` measures only what interceptors add,
without sockets: the client's `ClientInterception.call` around a runner that answers at
once (the runner's own per-call metadata step included), against that runner alone; and
the engine's interceptor chain around its handler step (`tensorrpc._dispatch._handler`), against
awaiting the handler directly, as the engine does without interceptors.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import tensorrpc
from bench.peers.tensorrpc_peer import BenchService
from tensorrpc import _context, _dispatch
from tensorrpc._interceptors import ClientCall, ClientInterception, intercept
from tensorrpc._views import CallOptions

#: Calls through each pair before the rounds start.
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


async def measure(
    calls: int, inflight: int, rounds: int, warmup: int = WARMUP
) -> dict[str, list[float]]:
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
                await _calls(stub, warmup, inflight)
            for i in range(rounds):
                order = ["plain", "intercepted"] if i % 2 == 0 else ["intercepted", "plain"]
                for name in order:
                    out[name].append(await _cpu_per_call_us(stubs[name], calls, inflight))
    return out


class _InstantRunner:
    """A client's runner that answers at once (it still builds the CALL's metadata)."""

    def __init__(self) -> None:
        self.call_object = SimpleNamespace(engine=SimpleNamespace(engine_id="e"))

    async def call(
        self,
        spec: Any,
        args: Any,
        kwargs: Any,
        options: CallOptions,
        encoded: Any = None,
        details: ClientCall | None = None,
    ) -> int:
        _ = options._block if details is None else details.block()
        if details is not None:
            details.sent(self.call_object)  # type: ignore[arg-type]
        return 3


async def _no_stream(*args: Any) -> Any:
    raise NotImplementedError("streams are not measured here")


async def _micro(calls: int, rounds: int) -> dict[str, list[float]]:
    """CPU ns per call that the interceptor steps add, client and engine (module docs)."""
    spec = tensorrpc.describe(BenchService).methods["add"]
    options = CallOptions()
    runner = _InstantRunner()
    chain = ClientInterception(
        runner.call,
        _no_stream,
        _no_stream,
        lambda call: None,
        "BenchService",
        (passthrough,),
    )
    service = BenchService()
    handler_call = SimpleNamespace(spec=spec, fn=service.add, deadline=math.inf)

    async def client_plain() -> None:
        for _ in range(calls):
            await runner.call(spec, (1, 2), {}, options)

    async def client_intercepted() -> None:
        for _ in range(calls):
            await chain.call(spec, (1, 2), {}, options)

    async def engine_plain() -> None:
        fn = handler_call.fn
        for _ in range(calls):
            await fn(1, 2)

    async def engine_context() -> None:  # what every call pays, interceptors or not
        fn = handler_call.fn
        for _ in range(calls):
            token = _context.enter(handler_call, "e")  # type: ignore[arg-type]
            await fn(1, 2)
            _context.leave(token)

    async def engine_intercepted() -> None:
        for _ in range(calls):
            step = functools.partial(_dispatch._handler, None, handler_call, [1, 2], math.inf)  # type: ignore[arg-type]
            context = _context.CallContext(handler_call, "e", math.inf)  # type: ignore[arg-type]
            await intercept((passthrough,), context, step)

    cases = {
        "client plain": client_plain,
        "client intercepted": client_intercepted,
        "engine plain": engine_plain,
        "engine context": engine_context,
        "engine intercepted": engine_intercepted,
    }
    out: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(rounds):
        names = list(cases) if i % 2 == 0 else list(reversed(cases))
        for name in names:
            start = time.process_time()
            await cases[name]()
            out[name].append((time.process_time() - start) / calls * 1e9)
    return out


def _print_micro(args: argparse.Namespace) -> None:
    rows = asyncio.run(_micro(args.calls, args.rounds))
    print(
        f"{args.calls} calls x {args.rounds} rounds; load {os.getloadavg()[0]:.2f}; CPU ns per call"
    )
    medians = {name: statistics.median(values) for name, values in rows.items()}
    for name, values in rows.items():
        print(f"  {name:<20} " + " ".join(f"{v:7.0f}" for v in values))
    client = medians["client intercepted"] - medians["client plain"]
    engine = medians["engine intercepted"] - medians["engine plain"]
    context = medians["engine context"] - medians["engine plain"]
    print(
        f"median added by a pass-through interceptor: client {client / 1000:.2f} us, "
        f"engine {engine / 1000:.2f} us, both {(client + engine) / 1000:.2f} us per call; "
        f"the engine's call context (every call) {context / 1000:.2f} us"
    )


def main() -> None:
    """Print one line per round, the medians and their difference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--micro", action="store_true", help="the added steps only (docs)")
    args = parser.parse_args()
    if args.micro:
        _print_micro(args)
        return
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
