"""The processes of the namespace test: ``engine`` (one host) and ``client`` (another).

Run as ``python -m tests.netns.host_peer engine ADDRESS ENGINE_ID`` or
``python -m tests.netns.host_peer client BIND_HOST``; keys come in the environment (z85).
The client talks to the test over stdin/stdout, one JSON object per line, so that the test
can cut and restore links between its steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import torch

import tensorrpc
from tensorrpc import rpc, service

HEARTBEAT = 0.2
DEAD_AFTER = 1.5


@service
class Host:
    def __init__(self, name: str) -> None:
        self.name = name

    @rpc
    async def whoami(self) -> str:
        return self.name

    @rpc
    async def sleep(self, seconds: float) -> str:
        await anyio.sleep(seconds)
        return self.name

    @rpc
    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


def _keys(prefix: str) -> tensorrpc.CurveKeyPair:
    env = os.environ
    return tensorrpc.CurveKeyPair(env[f"{prefix}_PUB"].encode(), env[f"{prefix}_SEC"].encode())


def _say(**what: Any) -> None:
    print(json.dumps(what), flush=True)


async def _hear(expected: str) -> None:
    line = await anyio.to_thread.run_sync(sys.stdin.readline)
    if line.strip() != expected:
        raise SystemExit(f"expected {expected!r} from the test, got {line!r}")


async def engine(address: str, engine_id: str) -> None:
    curve = tensorrpc.CurveClientConfig(
        _keys(f"TRPC_{engine_id.upper()}"), os.environ["TRPC_CLIENT_PUB"].encode()
    )
    await tensorrpc.serve(
        Host(engine_id),
        connect=address,
        engine_id=engine_id,
        curve=curve,
        heartbeat_interval=HEARTBEAT,
        dead_after=DEAD_AFTER,
        grace_period=0.2,
    )


async def client(bind_host: str) -> None:
    allowed = {os.environ["TRPC_A_PUB"].encode(), os.environ["TRPC_B_PUB"].encode()}
    curve = tensorrpc.CurveServerConfig(_keys("TRPC_CLIENT"), allowed)
    async with tensorrpc.Client(
        Host,
        bind=f"tcp://{bind_host}:0",
        curve=curve,
        heartbeat_interval=HEARTBEAT,
        dead_after=DEAD_AFTER,
    ) as c:
        _say(address=c.addresses[0])
        engines = await c.wait_for_engines(2, timeout=60)
        stub = c.stub()
        who = {k: await c.with_options(engine=k).stub().whoami() for k in ("a", "b")}
        x = torch.arange(256 * 1024, dtype=torch.float32)  # 1 MiB: torch_shm-sized
        out = await c.with_options(engine="a").stub().scale(x, 2.0)
        stream = [i async for i in c.with_options(engine="b").stub().count(5)]
        stats = c.statistics().transports
        _say(
            step="calls",
            who=who,
            offered={k: list(v.transports) for k, v in engines.items()},
            hosts={k: v.host_id for k, v in engines.items()},
            tensor_ok=bool(torch.equal(out, x * 2)),
            stream=stream,
            frames_sent=stats.frames.tensors_sent,
            shm_sent=stats.torch_shm.tensors_sent,
            shm_fallbacks=stats.torch_shm.fallbacks,
        )
        # A host vanishes while a call is in flight to it.
        outcome: dict[str, Any] = {}

        async def long_call() -> None:
            started = time.monotonic()
            try:
                await c.with_options(engine="a").stub().sleep(60)
                outcome["a"] = "returned"
            except tensorrpc.EngineDeadError as exc:
                outcome["a"] = type(exc).__name__
            outcome["a_after_s"] = time.monotonic() - started

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_call)
            with anyio.fail_after(30):
                while c.statistics().calls_in_flight < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            _say(step="in_flight")
            await _hear("cut")
            cut_at = time.monotonic()
        outcome["b"] = await c.with_options(engine="b").stub().whoami()
        outcome["dead_after"] = DEAD_AFTER
        outcome["failed_after_cut_s"] = time.monotonic() - cut_at
        outcome["live"] = sorted(c.engines)
        _say(step="cut", **outcome)
        await _hear("restored")
        started = time.monotonic()
        while "a" not in c.engines:
            await c.wait_for_engines(len(c.engines) + 1, timeout=60)
        _say(
            step="rejoined",
            after_s=time.monotonic() - started,
            who=await c.with_options(engine="a").stub().whoami(),
            live=sorted(c.engines),
        )
        await _hear("bye")
        del stub


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "engine":
        anyio.run(engine, sys.argv[2], sys.argv[3])
    else:
        anyio.run(client, sys.argv[2])
