"""Faults on the wire between a client and an engine, through a TCP chaos proxy.

Under each fault (delay, a bandwidth cap, a cut connection, a blackhole) every call has
exactly one outcome within a bound (its result, or one error) and no handler runs twice;
the pair recovers when the fault ends. The proxy also plays a passive relay: with CURVE it
sees only ciphertext.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
import torch

import tensorrpc
from tensorrpc import rpc, service

from .chaos import ChaosProxy

HEARTBEAT = 0.1
DEAD_AFTER = 1.0
MARKER = "tensorrpc-plaintext-marker-8d1f"


@service
class Tokens:
    def __init__(self) -> None:
        self.runs: collections.Counter[int] = collections.Counter()

    @rpc
    async def echo(self, token: int, pause: float = 0.0) -> int:
        self.runs[token] += 1
        await anyio.sleep(pause)
        return token

    @rpc
    async def say(self, text: str) -> str:
        return text.upper()

    @rpc
    def size(self, x: torch.Tensor) -> int:
        return int(x.numel())

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


async def _calls(
    client: tensorrpc.Client[Tokens], tokens: range, *, pause: float, limit: float
) -> dict[int, object]:
    """Run one call per token concurrently; each token's outcome, recorded once."""
    outcomes: dict[int, object] = {}

    async def one(token: int) -> None:
        try:
            result: object = await client.with_options(timeout=limit).stub().echo(token, pause)
        except tensorrpc.TensorRPCError as exc:
            result = exc
        assert token not in outcomes, "two outcomes for one call"
        outcomes[token] = result

    with anyio.fail_after(limit + 10):
        async with anyio.create_task_group() as tg:
            for token in tokens:
                tg.start_soon(one, token)
    return outcomes


def _pair(
    curve: bool,
) -> tuple[tensorrpc.CurveServerConfig | None, tensorrpc.CurveClientConfig | None]:
    engine_keys = tensorrpc.generate_keypair()
    client_keys = tensorrpc.generate_keypair()
    server_curve = tensorrpc.CurveServerConfig(engine_keys, {client_keys.public_key})
    client_curve = tensorrpc.CurveClientConfig(client_keys, engine_keys.public_key)
    return (server_curve if curve else None), (client_curve if curve else None)


async def _with_proxy(test: Callable[..., Awaitable[None]], *, curve: bool = False) -> None:
    server_curve, client_curve = _pair(curve)
    engine = Tokens()
    async with anyio.create_task_group() as tg:
        server = await tg.start(
            functools.partial(
                tensorrpc.serve,
                engine,
                bind="tcp://127.0.0.1:0",
                engine_id="e1",
                curve=server_curve,
                grace_period=0.1,
                heartbeat_interval=HEARTBEAT,
                dead_after=DEAD_AFTER,
            )
        )
        port = int(server.endpoint.rpartition(":")[2])
        async with (
            ChaosProxy("127.0.0.1", port).running() as proxy,
            tensorrpc.Client(
                Tokens,
                connect=f"tcp://127.0.0.1:{proxy.port}",
                curve=client_curve,
                heartbeat_interval=HEARTBEAT,
                dead_after=DEAD_AFTER,
            ) as client,
        ):
            await client.wait_for_engines(1, timeout=10)
            await test(client, proxy, engine)
        tg.cancel_scope.cancel()


async def test_delay_and_bandwidth_cap_every_call_once() -> None:
    async def test(client, proxy: ChaosProxy, engine: Tokens) -> None:
        proxy.delay = 0.05
        outcomes = await _calls(client, range(8), pause=0.0, limit=10)
        assert outcomes == {t: t for t in range(8)}
        proxy.delay, proxy.rate = 0.0, 4e6  # 4 MB/s: a 1 MiB tensor takes about 0.25 s
        x = torch.ones(256 * 1024)
        assert await client.with_options(timeout=20, transport="frames").stub().size(x) == x.numel()
        assert [i async for i in client.with_options(timeout=20).stub().count(20)] == list(
            range(20)
        )
        assert set(engine.runs.values()) == {1}

    with anyio.fail_after(60):
        await _with_proxy(test)


async def test_cut_connection_one_outcome_per_call_and_recovery() -> None:
    async def test(client, proxy: ChaosProxy, engine: Tokens) -> None:
        async with anyio.create_task_group() as tg:
            results: dict[int, object] = {}

            async def run() -> None:
                results.update(await _calls(client, range(6), pause=0.3, limit=3))

            tg.start_soon(run)
            with anyio.fail_after(10):
                while sum(engine.runs.values()) < 6:  # noqa: ASYNC110 - engine-side state
                    await anyio.sleep(0.01)
            proxy.cut()
        assert set(results) == set(range(6))
        for token, outcome in results.items():
            assert outcome == token or isinstance(
                outcome, (tensorrpc.EngineDeadError, tensorrpc.CallTimeoutError)
            ), outcome
            assert engine.runs[token] == 1  # never run twice
        # ZMQ reconnects through the proxy; the pair serves again
        await client.wait_for_engines(1, timeout=10)
        assert (await _calls(client, range(100, 104), pause=0.0, limit=10)) == {
            t: t for t in range(100, 104)
        }

    with anyio.fail_after(60):
        await _with_proxy(test)


async def test_blackhole_fails_calls_within_dead_after_then_recovers() -> None:
    async def test(client, proxy: ChaosProxy, engine: Tokens) -> None:
        proxy.blackhole = True
        started = anyio.current_time()
        outcomes = await _calls(client, range(4), pause=0.0, limit=30)
        waited = anyio.current_time() - started
        assert all(isinstance(o, tensorrpc.EngineDeadError) for o in outcomes.values()), outcomes
        assert waited < 30  # failed by liveness (dead_after), not by the call timeout
        assert engine.runs == {}  # nothing reached the engine
        proxy.blackhole = False
        proxy.cut()  # the old connection lost bytes mid-stream: start clean
        await client.wait_for_engines(1, timeout=15)
        assert (await _calls(client, range(10, 12), pause=0.0, limit=10)) == {10: 10, 11: 11}

    with anyio.fail_after(90):
        await _with_proxy(test)


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
async def test_passive_relay_sees_only_ciphertext_with_curve(curve: bool) -> None:
    async def test(client, proxy: ChaosProxy, engine: Tokens) -> None:
        assert await client.stub().say(MARKER) == MARKER.upper()
        seen = bytes(proxy.seen)
        assert len(seen) > 0
        assert (MARKER.encode() in seen) is (not curve)
        assert (MARKER.upper().encode() in seen) is (not curve)
        assert (b"Tokens" in seen) is (not curve)  # the HELLO's service name

    with anyio.fail_after(60):
        await _with_proxy(test, curve=curve)
