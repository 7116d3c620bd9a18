"""The client against real engines in separate processes, over ipc:// and tcp://127.0.0.1.

A pool of listening engines (client dials engines) is shared by the module; the kill -9
test starts its own engine (the dial-in topology test runs its engines in this process).
Every engine process is reaped, every wait is bounded. Refusals, duplicate ids and
frozen engines are protocol behaviour: tests/unit/test_pair.py (and, with real processes,
tests/hardening/test_faults.py).
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest
import torch

from tensorrpc._client import Client
from tensorrpc._exceptions import (
    BroadcastError,
    CallTimeoutError,
    EngineDeadError,
    EngineNotFoundError,
    RemoteError,
)
from tensorrpc._server import Server
from tests.engine_proc import EngineProcess

from .services import Calculator

#: Fast liveness for tests: an engine silent for 1 s is dead.
HEARTBEAT = 0.1
DEAD_AFTER = 1.0
POOL_IDS = ("e1", "e2", "e3")
POOL_DEAD_AFTER = 30.0

Spawn = Callable[..., EngineProcess]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Three engines listening on ipc:// and one on tcp://127.0.0.1 (ephemeral port)."""
    workdir = tmp_path_factory.mktemp("pool")
    # The pool's engines never need to forget a client: a long bound, so that a test
    # process starved of CPU on a loaded machine does not lose its session mid-test.
    procs = [
        EngineProcess(
            engine_id,
            workdir=workdir,
            bind=f"ipc://{workdir}/{engine_id}.sock",
            dead_after=POOL_DEAD_AFTER,
        )
        for engine_id in POOL_IDS
    ]
    procs.append(
        EngineProcess(
            "t1",
            workdir=workdir,
            bind="tcp://127.0.0.1:0",
            backend="trio",
            dead_after=POOL_DEAD_AFTER,
        )
    )
    try:
        yield {p.engine_id: p.address() for p in procs}
    finally:
        for p in procs:
            p.kill()
            p.stop()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start engines for one test; all are killed and reaped at the end."""
    procs: list[EngineProcess] = []

    def start(engine_id: str, **kw: object) -> EngineProcess:
        proc = EngineProcess(engine_id, workdir=tmp_path, **kw)  # type: ignore[arg-type]
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for p in procs:
            p.kill()
            p.stop()


def pool_client(
    pool: dict[str, str], ids: tuple[str, ...] = POOL_IDS, **kw: object
) -> Client[Calculator]:
    options: dict[str, object] = {"heartbeat_interval": HEARTBEAT, "dead_after": DEAD_AFTER}
    options.update(kw)
    return Client(Calculator, connect=[pool[i] for i in ids], **options)  # type: ignore[arg-type]


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll a condition inside an engine process until it holds (bounded: 10 s).

    The engine's state lives in another process, so there is no event to wait on; each
    probe is itself an RPC.
    """
    with anyio.fail_after(10):
        for _ in range(100_000):
            if await check():
                return
            await anyio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


# -- client dials engines (shared pool) -----------------------------------------------------


async def test_targeted_and_balanced_calls(pool: dict[str, str]) -> None:
    async with pool_client(pool) as client:
        with anyio.fail_after(20):
            engines = await client.wait_for_engines(3)
        assert set(engines) == set(POOL_IDS)
        assert engines["e2"].address == pool["e2"]
        for engine_id in POOL_IDS:
            assert await client.with_options(engine=engine_id).stub().whoami() == engine_id
        calc = client.stub()
        assert await calc.add(1, 2) == 3
        assert await calc.add(5) == 6
        assert await client.call(Calculator.mul, 6, 7) == 42
        seen = {await calc.whoami() for _ in range(12)}
        assert seen == set(POOL_IDS)
        x = torch.randn(128, 64)[:, ::2]
        assert torch.equal(await client.call(Calculator.scale, x, 3.0), x * 3.0)
        stats = client.statistics()
        assert sum(s.calls for s in stats.engines.values()) >= 3 + 2 + 1 + 12 + 1
        assert all(s.in_flight == 0 for s in stats.engines.values())
        assert all(s.bytes_received > 0 for s in stats.engines.values())


async def test_zero_copy_tensor_args_survive_memory_churn(pool: dict[str, str]) -> None:
    """Large non-contiguous arguments go as contiguous temporaries sent without copying;
    the client must keep them alive until ZMQ is done, even while memory is reused."""
    async with pool_client(pool, ids=("e2",)) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
        calc = client.stub()
        expected: dict[int, torch.Tensor] = {}
        received: dict[int, torch.Tensor] = {}

        async def one(i: int) -> None:
            base = torch.arange(2 * 128 * 1024, dtype=torch.float32).reshape(-1, 2) + i
            x = base[:, 0]  # strided view: the codec sends a contiguous temporary
            expected[i] = x.clone()
            received[i] = await calc.scale(x, 1.0)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(one, i)
                    # churn: freed memory is reused and overwritten at once
                    for _ in range(4):
                        torch.full((128 * 1024,), -1.0).add_(1.0)
        assert sorted(received) == list(range(24))
        for i, tensor in received.items():
            assert torch.equal(tensor, expected[i]), i


async def test_tcp_engine_on_ephemeral_port(pool: dict[str, str]) -> None:
    assert pool["t1"].startswith("tcp://127.0.0.1:")
    async with pool_client(pool, ids=("t1",)) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
        assert await client.stub().whoami() == "t1"
        assert [i async for i in client.stub().count(5)] == [0, 1, 2, 3, 4]
        x = torch.arange(100_000, dtype=torch.float64)
        assert torch.equal(await client.stub().scale(x, 0.5), x * 0.5)


async def test_broadcast(pool: dict[str, str]) -> None:
    async with pool_client(pool) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(3)
        assert await client.broadcast("whoami") == {e: e for e in POOL_IDS}
        assert await client.broadcast("add", 2, b=3) == dict.fromkeys(POOL_IDS, 5)
        with pytest.raises(BroadcastError) as info:
            await client.broadcast("fail", "nope")
        assert set(info.value.errors) == set(POOL_IDS)
        assert all(isinstance(e, RemoteError) for e in info.value.errors.values())


async def test_three_engines_two_clients_every_reply_reaches_its_caller(
    pool: dict[str, str],
) -> None:
    async with pool_client(pool) as first, pool_client(pool) as second:
        with anyio.fail_after(20):
            await first.wait_for_engines(3)
            await second.wait_for_engines(3)
        replies: dict[str, str] = {}

        async def worker(client: Client[Calculator], name: str, n: int) -> None:
            calc = client.stub()
            for i in range(n):
                tag = f"{name}-{i}"
                replies[tag] = await calc.echo(tag)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for w in range(16):
                    tg.start_soon(worker, first, f"a{w}", 25)
                    tg.start_soon(worker, second, f"b{w}", 25)
        assert len(replies) == 2 * 16 * 25
        for tag, reply in replies.items():
            engine_id, _, echoed = reply.partition(":")
            assert echoed == tag
            assert engine_id in POOL_IDS
        assert {r.partition(":")[0] for r in replies.values()} == set(POOL_IDS)


async def test_remote_error_and_engine_keeps_serving(pool: dict[str, str]) -> None:
    async with pool_client(pool, ids=("e1",)) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
        with pytest.raises(RemoteError) as info:
            await client.stub().fail("boom")
        assert "ValueError" in info.value.remote_type
        assert info.value.message == "boom"
        assert "fail" in info.value.remote_traceback
        assert await client.stub().add(1, 1) == 2
        assert client.statistics().engines["e1"].errors == 1


async def test_unknown_engine_fails_at_once(pool: dict[str, str]) -> None:
    async with pool_client(pool, ids=("e1", "e2")) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(2)
        with pytest.raises(EngineNotFoundError) as info:
            await client.with_options(engine="e9").stub().add(1)
        assert info.value.live == ("e1", "e2")


async def test_deadline_stops_the_handler(pool: dict[str, str]) -> None:
    async with pool_client(pool, ids=("e2",)) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
        token = f"deadline-{id(client)}"
        with anyio.fail_after(5), pytest.raises(CallTimeoutError):
            await client.with_options(timeout=0.3).stub().sleep(30.0, token)
        calc = client.stub()

        async def cancelled() -> bool:
            return await calc.event(token) == "cancelled"

        await eventually(cancelled, "the engine cancelled the late handler")


async def test_cancelling_the_caller_cancels_the_handler(pool: dict[str, str]) -> None:
    async with pool_client(pool, ids=("e3",)) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
        calc = client.stub()
        token = f"cancel-{id(client)}"

        async def started() -> bool:
            return await calc.event(token) == "started"

        async def cancelled() -> bool:
            return await calc.event(token) == "cancelled"

        async with anyio.create_task_group() as tg:
            tg.start_soon(calc.sleep, 30.0, token)
            await eventually(started, "the handler started")
            tg.cancel_scope.cancel()
        await eventually(cancelled, "the engine cancelled the handler")
        assert client.statistics().calls_in_flight == 0
        assert await calc.add(2, 2) == 4


async def test_stream_early_break_stops_the_generator(pool: dict[str, str]) -> None:
    async with pool_client(pool, ids=("e1",), stream_window=4) as client:
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
        calc = client.stub()
        assert [i async for i in calc.count(10)] == list(range(10))

        # aclose(): CANCEL at once
        token = f"aclose-{id(client)}"
        async with client.stream(Calculator.forever, token) as stream:
            async for i in stream:
                if i == 2:
                    break

        async def stopped(t: str = token) -> bool:
            return await calc.event(t) in ("cancelled", "closed")

        await eventually(stopped, "aclose stopped the generator")

        # flow control: a consumer that stops taking items bounds the engine's buffering
        token = f"slow-{id(client)}"
        stream = client.stream(Calculator.forever, token)
        assert await stream.__anext__() == 0
        with anyio.fail_after(5):
            produced = [await calc.produced_count(token) for _ in range(20)]
        assert max(produced) <= 4 + 2, produced
        await stream.aclose()

        # an abandoned iterator: cancelled soon after it is garbage-collected
        token = f"gc-{id(client)}"
        stream = client.stream(Calculator.forever, token)
        assert await stream.__anext__() == 0
        del stream
        gc.collect()

        async def gc_stopped(t: str = token) -> bool:
            return await calc.event(t) in ("cancelled", "closed")

        await eventually(gc_stopped, "the GC'd stream stopped the generator")
        assert client.statistics().calls_in_flight == 0


# -- engines dial in ------------------------------------------------------------------------


async def test_engines_dial_in_over_ipc_and_tcp_beside_a_dialled_engine(
    tmp_path: Path, pool: dict[str, str]
) -> None:
    # The dialling-in engines run in this process (the topology is what is tested here;
    # engines in their own processes are the pool's): no torch import per engine.
    async with Client(
        Calculator,
        bind=[f"ipc://{tmp_path}/c.sock", "tcp://127.0.0.1:0"],
        connect=pool["e3"],
        heartbeat_interval=HEARTBEAT,
        dead_after=DEAD_AFTER,
    ) as client:
        ipc, tcp = client.addresses
        assert tcp.startswith("tcp://127.0.0.1:")
        async with (
            Server(Calculator("d1"), engine_id="d1", connect=ipc, heartbeat_interval=HEARTBEAT),
            Server(Calculator("d2"), engine_id="d2", connect=tcp, heartbeat_interval=HEARTBEAT),
        ):
            with anyio.fail_after(30):
                await client.wait_for_engines(3)
            assert client.engines["d1"].address is None
            assert client.engines["e3"].address == pool["e3"]
            for engine_id in ("d1", "d2", "e3"):
                assert await client.with_options(engine=engine_id).stub().whoami() == engine_id
            assert await client.broadcast("add", 1, 2) == {"d1": 3, "d2": 3, "e3": 3}


async def test_kill_9_mid_call_and_mid_stream(
    tmp_path: Path, spawn: Spawn, pool: dict[str, str]
) -> None:
    async with Client(
        Calculator,
        bind=f"ipc://{tmp_path}/c.sock",
        connect=pool["e2"],
        heartbeat_interval=HEARTBEAT,
        dead_after=DEAD_AFTER,
    ) as client:
        victim = spawn("k1", connect=client.addresses)
        with anyio.fail_after(30):
            await client.wait_for_engines(2)
        calc = client.with_options(engine="k1").stub()
        outcomes: dict[str, EngineDeadError] = {}
        both_failed = anyio.Event()
        token = f"kill-{id(client)}"

        def record(what: str, exc: EngineDeadError) -> None:
            outcomes[what] = exc
            if len(outcomes) == 2:
                both_failed.set()

        async def call() -> None:
            try:
                await calc.sleep(60.0, token)
            except EngineDeadError as exc:
                record("call", exc)

        async def stream() -> None:
            try:
                async for _ in calc.forever(token + "-s"):
                    await anyio.sleep(0.01)
            except EngineDeadError as exc:
                record("stream", exc)

        async def started() -> bool:
            return await calc.event(token) == "started"

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            tg.start_soon(stream)
            await eventually(started, "the call is running")
            victim.kill()
            # dead_after is 1 s; allow for scheduling on a loaded machine
            with anyio.fail_after(1.0 + 2.5):
                await both_failed.wait()
        assert set(outcomes) == {"call", "stream"}
        assert all(e.engine_id == "k1" for e in outcomes.values())
        assert "k1" not in client.engines
        assert (
            await client.with_options(engine="e2").stub().whoami() == "e2"
        )  # the other engine serves on
        assert client.statistics().engines["k1"].in_flight == 0
