"""Batched methods end to end: a stub per item, batches on the engine (docs/batching.md)."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest

from tensorrpc import (
    Batching,
    CallTimeoutError,
    Client,
    Continuous,
    EngineDeadError,
    InvalidArgumentError,
    OverloadedError,
    RemoteError,
    Server,
    current_batch,
    describe,
    rpc,
    service,
)

ROOT = Path(__file__).resolve().parents[2]


@service
class Batched:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate: anyio.Event | None = None
        self.entered: anyio.Event | None = None
        self.seen_cancelled: list[frozenset[int]] = []
        self.threads: set[str] = set()
        self.steps = 0
        #: Set once `count` has run ``stepped[0]`` steps (a test waits on it).
        self.stepped: tuple[int, anyio.Event] | None = None

    @rpc(batch=Batching(max_size=8, max_delay=0.02))
    async def square(self, x: list[int], tag: list[str]) -> list[str]:
        self.batches.append(list(x))
        return [f"{t}:{v * v}" for v, t in zip(x, tag, strict=True)]

    @rpc(batch=Batching(max_size=4, max_delay=0.0))
    async def picky(self, x: list[int]) -> list[int]:
        batch = current_batch()
        for i, v in enumerate(x):
            if v < 0:
                batch.fail(i, ValueError(f"negative: {v}"))
        if 13 in x:
            raise RuntimeError("unlucky batch")
        return [v + 1 for v in x]

    @rpc(batch=Batching(max_size=4, max_delay=0.0))
    async def miscount(self, x: list[int]) -> list[int]:
        return x[:-1] if len(x) > 1 or x[0] == 0 else x

    @rpc(batch=Batching(max_size=2, max_delay=0.0, max_queue=2))
    async def gated(self, x: list[int]) -> list[int]:
        self.batches.append(list(x))
        if self.entered is not None:
            self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        self.seen_cancelled.append(current_batch().cancelled())
        return x

    @rpc(batch=Batching(max_size=2, max_delay=30.0))
    async def watch(self, x: list[int]) -> list[int]:
        batch = current_batch()
        while not batch.cancelled():  # noqa: ASYNC110 - the feature under test is a poll
            await anyio.sleep(0.01)  # the test's deadline bounds this
        self.seen_cancelled.append(batch.cancelled())
        return x

    @rpc(batch=Batching(max_size=4, max_delay=30.0))
    async def wide(self, x: list[int]) -> list[int]:
        self.batches.append(list(x))
        if self.gate is not None:
            await self.gate.wait()
        return [v + 1 for v in x]

    @rpc
    async def plain(self, x: int) -> int:
        return -x

    @rpc(batch=Batching(max_size=8, max_delay=0.01))
    def sync_double(self, x: list[float]) -> list[float]:
        self.threads.add(threading.current_thread().name)
        assert current_batch().size == len(x)
        return [2 * v for v in x]

    @rpc(batch=Continuous(max_size=4, max_delay=0.0))
    async def count(self, start: list[int], n: list[int]) -> list[int]:
        self.steps += 1
        if self.stepped is not None and self.steps >= self.stepped[0]:
            self.stepped[1].set()
        batch = current_batch()
        out = []
        for i, item in enumerate(batch.items):
            if item.first:
                item.state = start[i]
            out.append(item.state)
            item.state += 1
            if item.steps + 1 >= n[i]:
                batch.end(i)
        await anyio.lowlevel.checkpoint()
        return out


@contextlib.asynccontextmanager
async def _running(
    tmp_path: Path, svc: Batched | None = None
) -> AsyncIterator[tuple[Batched, Server, Client[Batched]]]:
    """An engine serving ``svc`` (a new one by default) and a client that sees it, within
    20 s from the start to the end of the block."""
    svc = Batched() if svc is None else svc
    address = _address(tmp_path)
    async with (
        Server(svc, bind=address, engine_id="e1") as server,
        Client(Batched, connect=address) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            yield svc, server, client


def _address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/b.sock"


async def _serve(tmp_path: Path) -> tuple[Batched, str]:
    return Batched(), _address(tmp_path)


async def test_describe_shows_the_item_and_the_batch_signature() -> None:
    spec = describe(Batched).methods
    assert spec["square"].signature == "square(x: int, tag: str) -> str"
    assert spec["square"].batch is not None
    assert spec["square"].batch.signature == "square(x: list[int], tag: list[str]) -> list[str]"
    assert spec["count"].streaming
    assert spec["count"].signature == "count(start: int, n: int) -> AsyncIterator[int]"


async def test_concurrent_callers_share_batches_and_each_gets_its_own_result(
    tmp_path: Path,
) -> None:
    svc, address = await _serve(tmp_path)
    results: dict[tuple[int, int], str] = {}
    async with (
        Server(svc, bind=address, engine_id="e1", max_concurrency=128),
        Client(Batched, connect=address) as c1,
        Client(Batched, connect=address) as c2,
    ):
        with anyio.fail_after(30):
            await c1.wait_for_engines(1)
            await c2.wait_for_engines(1)

            async def one(k: int, client: Client[Batched], i: int) -> None:
                results[(k, i)] = await client.stub().square(i, f"c{k}-{i}")

            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(one, 1, c1, i)
                    tg.start_soon(one, 2, c2, i)
            assert await c1.call(Batched.square, 3, "t") == "t:9"
    assert len(results) == 200
    for (k, i), value in results.items():
        assert value == f"c{k}-{i}:{i * i}", "a caller got another caller's result"
    assert max(len(b) for b in svc.batches) > 1
    assert all(len(b) <= 8 for b in svc.batches)
    assert sum(len(b) for b in svc.batches) == 201


async def test_bad_item_is_refused_alone_and_failures_are_per_item(tmp_path: Path) -> None:
    svc, address = await _serve(tmp_path)
    async with (
        Server(svc, bind=address, engine_id="e1"),
        Client(Batched, connect=address) as c,
        Client.dynamic(connect=address) as tool,
    ):
        with anyio.fail_after(20):
            await c.wait_for_engines(1)
            await tool.wait_for_engines(1)
            stub = c.stub()
            with pytest.raises(InvalidArgumentError, match=r"req\.x"):
                await tool.call_by_name("picky", {"x": "nope"})
            outcomes: dict[int, object] = {}

            async def one(v: int) -> None:
                try:
                    outcomes[v] = await stub.picky(v)
                except RemoteError as exc:
                    outcomes[v] = exc

            async with anyio.create_task_group() as tg:
                for v in (1, -2, 3):
                    tg.start_soon(one, v)
            assert outcomes[1] == 2
            assert outcomes[3] == 4
            err = outcomes[-2]
            assert isinstance(err, RemoteError)
            assert err.remote_type == "builtins.ValueError"
            assert "negative: -2" in str(err)
            assert "ValueError" in err.remote_traceback
            with pytest.raises(RemoteError, match="unlucky batch") as info:
                await stub.picky(13)
            assert info.value.remote_type == "builtins.RuntimeError"


async def test_a_result_count_mismatch_fails_every_item_and_the_engine_serves_on(
    tmp_path: Path,
) -> None:
    async with _running(tmp_path) as (_svc, _, c):
        with pytest.raises(RemoteError, match=r"returned 0 results for a batch of 1"):
            await c.stub().miscount(0)
        assert await c.stub().miscount(5) == 5
        assert await c.stub().square(2, "a") == "a:4"


async def test_sync_handlers_run_each_batch_in_a_worker_thread(tmp_path: Path) -> None:
    async with _running(tmp_path) as (svc, _, c):
        got: list[float] = []

        async def one(v: float) -> None:
            got.append(await c.stub().sync_double(v))

        async with anyio.create_task_group() as tg:
            for v in range(10):
                tg.start_soon(one, float(v))
    assert sorted(got) == [2.0 * v for v in range(10)]
    assert svc.threads
    assert threading.main_thread().name not in svc.threads


async def test_full_queue_is_overloaded_and_queued_timeouts_never_run(tmp_path: Path) -> None:
    svc = Batched()
    svc.gate = anyio.Event()
    svc.entered = anyio.Event()
    async with _running(tmp_path, svc) as (_, server, c):
        stub = c.stub()
        results: list[int] = []

        async def one(v: int) -> None:
            results.append(await stub.gated(v))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 1)
            await svc.entered.wait()  # batch [1] runs and holds the only slot
            with pytest.raises(CallTimeoutError):
                await c.with_options(timeout=0.2).stub().gated(99)  # queued, then late
            tg.start_soon(one, 2)
            tg.start_soon(one, 3)
            while server.statistics().batching["gated"]["queued"] < 2:  # noqa: ASYNC110
                await anyio.sleep(0.01)  # bounded by fail_after: the two are queued
            with pytest.raises(OverloadedError, match="max_queue"):
                await c.with_options(wait=False).stub().gated(4)
            svc.gate.set()
    assert sorted(results) == [1, 2, 3]
    assert svc.batches[0] == [1]
    assert sorted(svc.batches[1]) == [2, 3]  # trio starts tasks in any order
    assert 99 not in [v for b in svc.batches for v in b]


async def test_queued_and_running_items_hold_no_worker_and_leave_at_their_deadline(
    tmp_path: Path,
) -> None:
    # One worker: four items must reach the batcher (it closes at four; its delay is 30 s),
    # the batch runs while the worker serves a plain call, and a late item leaves the
    # queue (its deadline is the batcher's: the worker's scope has none).
    svc, address = await _serve(tmp_path)
    svc.gate = anyio.Event()
    async with (
        Server(svc, bind=address, engine_id="e1", max_concurrency=1) as server,
        Client(Batched, connect=address) as c,
    ):
        with anyio.fail_after(20):
            await c.wait_for_engines(1)
            stub = c.stub()
            results: list[int] = []

            async def one(v: int) -> None:
                results.append(await stub.wide(v))

            async with anyio.create_task_group() as tg:
                for v in range(4):
                    tg.start_soon(one, v)
                while len(svc.batches) < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)  # bounded by fail_after: the batch of 4 runs
                assert await stub.plain(5) == -5  # the running batch holds no worker
                with pytest.raises(CallTimeoutError):
                    await (
                        c.with_options(timeout=0.3).stub().wide(99)
                    )  # queued behind the running batch
                while server.statistics().batching["wide"]["queued"]:  # noqa: ASYNC110
                    await anyio.sleep(0.01)  # bounded by fail_after: 99 leaves the queue
                assert server.statistics().batching["wide"]["running"] == 1
                svc.gate.set()
    assert sorted(results) == [1, 2, 3, 4]
    assert [sorted(b) for b in svc.batches] == [[0, 1, 2, 3]]


async def test_a_running_batch_learns_which_callers_cancelled(tmp_path: Path) -> None:
    async with _running(tmp_path) as (svc, _, c):
        got: list[int] = []

        async def stays() -> None:
            got.append(await c.stub().watch(1))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stays)
            with pytest.raises(CallTimeoutError):
                await c.with_options(timeout=0.5).stub().watch(2)
    assert got == [1]
    assert len(svc.seen_cancelled) == 1
    assert len(svc.seen_cancelled[0]) == 1  # the item of the caller that gave up


async def test_a_batch_whose_callers_all_left_is_stopped(tmp_path: Path) -> None:
    svc = Batched()
    svc.gate = anyio.Event()
    svc.entered = anyio.Event()
    async with _running(tmp_path, svc) as (_, server, c):
        with pytest.raises(CallTimeoutError):
            await c.with_options(timeout=0.3).stub().gated(7)
        assert svc.batches == [[7]]
        while server.statistics().batching["gated"]["running"]:  # noqa: ASYNC110
            await anyio.sleep(0.01)  # bounded by fail_after: the batch is stopped
        svc.gate.set()
        assert await c.stub().gated(8) == 8
    assert svc.batches == [[7], [8]]
    assert svc.seen_cancelled == [frozenset()]  # the first batch's handler was cancelled


async def test_continuous_streams_join_at_step_boundaries(tmp_path: Path) -> None:
    async with _running(tmp_path) as (_svc, _, c):
        got: dict[int, list[int]] = {}

        async def run(start: int, n: int) -> None:
            got[start] = [v async for v in c.stub().count(start, n)]

        async with anyio.create_task_group() as tg:
            for k in range(6):
                tg.start_soon(run, 1000 * k, 20 + k)
        assert await c.call(Batched.square, 2, "x") == "x:4"
    assert got == {1000 * k: list(range(1000 * k, 1000 * k + 20 + k)) for k in range(6)}


async def test_a_stalled_reader_does_not_stall_the_other_streams(tmp_path: Path) -> None:
    svc, address = await _serve(tmp_path)
    async with (
        Server(svc, bind=address, engine_id="e1"),
        Client(Batched, connect=address, stream_window=2) as c,
    ):
        with anyio.fail_after(20):
            await c.wait_for_engines(1)
            stalled = c.stub().count(0, 100)
            first = await stalled.__anext__()  # started, then nobody reads
            assert first == 0
            fast = [v async for v in c.stub().count(500, 200)]
            assert fast == list(range(500, 700))
            rest = [v async for v in stalled]
            assert rest == list(range(1, 100))


async def test_the_next_step_runs_while_the_last_outputs_go_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step starts without waiting for the last step's outputs to be taken by workers
    that are waiting for them (they take them while it runs); an item whose worker is
    away (sending, or waiting for credit) holds at most one output and sits out; none
    holds more than two."""
    from tensorrpc._batch_runner import _Item, _Run, _Runner

    pending: list[int] = []  # outputs still buffered per item, as each step starts
    held: list[int] = []  # after each step: the most an item whose worker is away holds
    most: list[int] = []  # after each step: the most any item holds
    original = _Runner._step

    async def step(self: _Runner, run: _Run, items: list[_Item]) -> None:
        pending.extend(len(it.outputs or ()) for it in items)
        await original(self, run, items)
        away = [len(it.outputs or ()) for it in run.items if it.event is None]
        held.append(max(away, default=0))
        most.append(max((len(it.outputs or ()) for it in run.items), default=0))

    monkeypatch.setattr(_Runner, "_step", step)
    svc, address = await _serve(tmp_path)
    async with (
        Server(svc, bind=address, engine_id="e1"),
        Client(Batched, connect=address, stream_window=2) as c,
    ):
        with anyio.fail_after(20):
            await c.wait_for_engines(1)
            stalled = c.stub().count(0, 100)
            assert await stalled.__anext__() == 0  # then nobody reads it for a while
            async with anyio.create_task_group() as tg:
                for start in (1000, 2000, 3000):
                    tg.start_soon(_read_all, c, start, 60)
            assert [v async for v in stalled] == list(range(1, 100))
    assert 1 in pending, "every step waited for the last outputs to be taken"
    assert max(held) <= 1, held
    assert max(most) <= 2, most


async def _read_all(c: Client[Batched], start: int, n: int) -> None:
    assert [v async for v in c.stub().count(start, n)] == list(range(start, start + n))


async def test_items_that_leave_a_continuous_batch_early_free_their_place(tmp_path: Path) -> None:
    async with _running(tmp_path) as (_svc, _, c):
        for _ in range(6):  # more than max_size streams, each closed early
            stream = c.stub().count(0, 10_000)
            assert await stream.__anext__() == 0
            await stream.aclose()
        assert [v async for v in c.stub().count(7, 3)] == [7, 8, 9]


async def test_a_client_that_leaves_has_its_queued_items_dropped(tmp_path: Path) -> None:
    svc = Batched()
    svc.gate = anyio.Event()
    svc.entered = anyio.Event()
    async with _running(tmp_path, svc) as (_, server, stays):
        results: list[int] = []

        async def one(v: int) -> None:
            results.append(await stays.stub().gated(v))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 1)
            await svc.entered.wait()  # batch [1] holds the only slot
            async with Client(Batched, connect=_address(tmp_path)) as leaves:
                await leaves.wait_for_engines(1)
                async with anyio.create_task_group() as doomed:
                    doomed.start_soon(leaves.stub().gated, 50)
                    doomed.start_soon(leaves.stub().gated, 51)
                    while server.statistics().batching["gated"]["queued"] < 2:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                    doomed.cancel_scope.cancel()
            # The client is gone: the engine drops what it had queued.
            while server.statistics().batching["gated"]["queued"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            svc.gate.set()
        assert await stays.stub().gated(2) == 2
    assert results == [1]
    assert svc.batches == [[1], [2]]


async def test_an_engine_killed_mid_batch_fails_every_item_of_it(tmp_path: Path) -> None:
    from tests import _forkserver

    from .batch_engine import Hang

    address = f"ipc://{tmp_path}/c.sock"
    async with Client(Hang, bind=address, heartbeat_interval=0.1, dead_after=1.0) as client:
        proc = _forkserver.popen(
            [sys.executable, "-m", "tests.integration.batch_engine", address],
            cwd=ROOT,
        )
        try:
            with anyio.fail_after(30):
                await client.wait_for_engines(1)
            failed: list[EngineDeadError] = []
            all_failed = anyio.Event()

            async def one(v: int) -> None:
                try:
                    await client.stub().hang(v)
                except EngineDeadError as exc:
                    failed.append(exc)
                    if len(failed) == 3:
                        all_failed.set()

            async with anyio.create_task_group() as tg:
                for v in range(3):
                    tg.start_soon(one, v)
                with anyio.fail_after(10):
                    while await client.stub().batch_size() < 3:  # noqa: ASYNC110 - other process
                        await anyio.sleep(0.02)
                proc.kill()
                with anyio.fail_after(1.0 + 2.5):  # dead_after, and room for a loaded machine
                    await all_failed.wait()
        finally:
            proc.kill()
            proc.wait()
    assert len(failed) == 3
    assert all(e.engine_id == "hang" for e in failed)


def _alive(*types: type) -> int:
    import gc

    return sum(1 for o in gc.get_objects() if type(o) in types)


async def test_batches_and_steps_leave_no_reference_cycles(tmp_path: Path) -> None:
    """A batch's items and runs are freed by reference counting when it ends: a cycle
    would leave them (and each item's call) to the cycle collector, whose full passes
    were the batched calls' p99 (docs/benchmarks.md, the batching section)."""
    import gc

    from tensorrpc._batch_runner import _Item

    async with _running(tmp_path) as (_svc, server, c):
        assert await c.stub().square(1, "warm") == "warm:1"
        gc.collect()
        before = _alive(_Item)
        enabled = gc.isenabled()
        gc.disable()
        try:
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(c.stub().square, i, "t")
            streams = [[v async for v in c.stub().count(10 * k, 5)] for k in range(3)]
            assert streams == [list(range(10 * k, 10 * k + 5)) for k in range(3)]
            stats = server.statistics
            while any(m["running"] for m in stats().batching.values()):  # noqa: ASYNC110
                await anyio.sleep(0.01)  # the last run's task ends after its last output
            # Items, not runs: the last run's task may not have returned yet (an item
            # is in every cycle a run is in).
            left = _alive(_Item) - before
        finally:
            if enabled:
                gc.enable()
        assert left == 0, f"{left} batch items left to the cycle collector"


async def test_an_item_that_joins_gets_its_first_output_before_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first output of a stream that joins a running batch goes out first in its step
    (its worker is woken first), not behind every other item's output."""
    from tensorrpc._batch_runner import _Item

    woken: list[tuple[int, int, int]] = []  # (step, the item's start, its outputs so far)
    svc = Batched()
    three_steps = anyio.Event()
    svc.stepped = (3, three_steps)
    original = _Item.wake

    def wake(self: _Item) -> None:
        woken.append((svc.steps, self.args[0], self.handle.steps))
        original(self)

    monkeypatch.setattr(_Item, "wake", wake)
    async with _running(tmp_path, svc) as (_svc, _, c), anyio.create_task_group() as tg:

        async def read(start: int) -> None:
            async for _ in c.stub().count(start, 100_000):
                pass

        for start in (100, 200, 300):
            tg.start_soon(read, start)
        with anyio.fail_after(10):
            await three_steps.wait()  # the batch of three runs steps
        # A joiner may find the others paused for credit in its step (then it runs alone
        # and shows no order): join several times, check every step that had company.
        joiners = (1, 3, 5, 7, 9, 11)
        for start in joiners:
            assert [v async for v in c.stub().count(start, 2)] == [start, start + 1]
        tg.cancel_scope.cancel()
    orders = {}
    for joiner in joiners:
        step = next(s for s, start, n in woken if start == joiner and n == 1)
        orders[joiner] = [start for s, start, n in woken if s == step and n > 0]
    shared = {joiner: order for joiner, order in orders.items() if len(order) > 1}
    assert shared, f"every joiner ran alone: no order to check ({orders})"
    assert all(order[0] == joiner for joiner, order in shared.items()), shared


async def test_tensor_results_of_a_batch_reach_their_callers(tmp_path: Path) -> None:
    """A batch's tensor results, views of one batch tensor, each reach their caller."""
    import torch

    from tensorrpc.batching import split, stack

    @service
    class Rows:
        @rpc(batch=Batching(max_size=8, max_delay=0.02))
        async def double(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
            return split(stack(x) * 2)

    address = _address(tmp_path)
    async with (
        Server(Rows(), bind=address, engine_id="e1"),
        Client(Rows, connect=address, torch_shm=False) as c,
    ):
        with anyio.fail_after(20):
            await c.wait_for_engines(1)
            got: dict[int, torch.Tensor] = {}

            async def one(i: int) -> None:
                got[i] = await c.stub().double(torch.full((1024,), float(i)))

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)
    for i, t in got.items():
        assert torch.equal(t, torch.full((1024,), 2.0 * i))
    assert len(got) == 6


@service
class Pairs:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.waited: list[list[float]] = []
        self.may_return: Callable[[int], bool] = lambda batch: True

    @rpc(batch=Batching(max_size=2, max_delay=60.0))
    async def echo(self, x: list[int]) -> list[int]:
        self.batches.append(list(x))
        self.waited.append([item.waited for item in current_batch().items])
        # The test says when each batch may return, whatever order the backend runs the
        # callers in (bounded by the test's fail_after).
        batch = len(self.batches)
        while not self.may_return(batch):
            await anyio.lowlevel.checkpoint()
        return x


async def test_the_next_batch_starts_before_the_last_one_is_answered() -> None:
    """A batch that is queued when the running one's handler returns takes the free slot
    before that batch's items are answered: the device does not wait for their replies
    (the runners alone, in one process: no engine, no socket)."""
    from tensorrpc._batch_runner import BatchRunners

    svc = Pairs()
    runners = BatchRunners(describe(Pairs), svc, "e1", lambda: None)
    entry = runners.entry("echo", svc.echo)
    seen: dict[int, tuple[int, int]] = {}  # item: (queued, running) as its result came

    def may_return(batch: int) -> bool:
        # The first batch ends once the second is full (so it is due then); the second
        # once the first one's callers have looked.
        if batch == 1:
            return bool(runners.statistics()["echo"]["queued"] >= 2)
        return len(seen) >= 2

    svc.may_return = may_return

    async def call(x: int) -> None:
        assert await entry(math.inf, x) == x
        stats = runners.statistics()["echo"]
        seen[x] = (stats["queued"], stats["running"])

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            runners.start(tg)
            async with anyio.create_task_group() as calls:
                for x in range(4):  # two batches of two: one runs, one waits
                    calls.start_soon(call, x)
            tg.cancel_scope.cancel()
    assert len(svc.batches) == 2, svc.batches
    # The first batch's items were answered with the second batch running, none queued.
    assert [seen[x] for x in svc.batches[0]] == [(0, 1), (0, 1)], seen
    # Each item knows its wait: the second batch's items waited for the first to end.
    assert min(svc.waited[0]) >= 0
    assert min(svc.waited[1]) > 0, svc.waited
