"""Faults: peers killed, frozen, restarted, shut down with calls in flight.

Complements ``tests/integration/test_client_engines.py`` (kill -9 mid-call and mid-stream,
restart under the same id, SIGSTOP/SIGCONT): here a kill in the middle of large frame
transfers, a client killed mid-call, a frozen engine with calls and a stream in flight,
and graceful shutdown of either side with 1,000 calls in flight. In every case each call
ends with exactly one outcome, within a bound, and the test process's file descriptors
return to their baseline.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch

from bench._measure import shm_files_of
from tensorrpc._client import Client
from tensorrpc._exceptions import (
    ClosedError,
    DrainingError,
    EngineDeadError,
    TensorRPCError,
    TensorTransportError,
)
from tensorrpc._server import Server
from tests import _forkserver
from tests.engine_proc import ENGINE_DEAD_AFTER, ROOT, EngineProcess
from tests.integration.services import Calculator

from ._live import fd_count

HEARTBEAT = 0.1
DEAD_AFTER = 1.0
#: Bound on how long a call may take to fail once its engine died (dead_after + slack
#: for a loaded 2-core machine).
# The engine forgets a dead client after ENGINE_DEAD_AFTER; the client, a dead engine after
# DEAD_AFTER. Either way an outcome must come within this bound.
FAIL_WITHIN = max(DEAD_AFTER, ENGINE_DEAD_AFTER) + 4.0
WAIT = 30.0
#: The subprocess tests run on one backend: the engines run their own event loop (the
#: in-process tests below cover both), and each costs seconds of process start-up.
ONE_BACKEND = pytest.mark.parametrize("anyio_backend", ["asyncio"])


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    procs: list[EngineProcess] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
            p.kill()
            p.stop()


def _client(**kw: object) -> Client[Calculator]:
    return Client(Calculator, heartbeat_interval=HEARTBEAT, dead_after=DEAD_AFTER, **kw)  # type: ignore[arg-type]


async def until(check: Callable[[], bool | Awaitable[bool]], within: float, what: str) -> None:
    """Poll ``check`` until true, at most ``within`` seconds.

    For state that lives in another process or thread (an engine subprocess, libzmq's
    reaper closing descriptors), where there is no event to wait on.
    """
    with anyio.move_on_after(within):
        while True:
            result = check()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            await anyio.sleep(0.02)
    raise AssertionError(f"not within {within} s: {what}")


async def _fds_back_to(baseline: int) -> None:
    def settled() -> bool:
        gc.collect()
        return fd_count() <= baseline

    # libzmq closes a socket's descriptors in its reaper thread, shortly after close()
    await until(settled, 10.0, f"fd count back to {baseline} (now {fd_count()})")


@ONE_BACKEND
@pytest.mark.parametrize("transport", ["frames", "torch_shm"])
async def test_kill_9_mid_transfer_of_large_tensors(
    tmp_path: Path, engines: list[EngineProcess], transport: str
) -> None:
    # Warm up what is created once per process (the zmq context and its I/O threads'
    # epoll/eventfd descriptors; the pipes to the zygote that forks engines, see
    # tests/_forkserver.py), so that the baseline counts only per-connection ones.
    _forkserver.zygote()
    async with Server(Calculator("w"), bind=f"ipc://{tmp_path}/w.sock") as warm:
        assert warm.endpoint is not None
        async with _client(connect=warm.endpoint) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
                await client.with_options(transport="frames").stub().scale(torch.ones(1 << 20), 2.0)
    gc.collect()
    baseline = fd_count()
    shm_before = shm_files_of([os.getpid()])  # ours only: other tests may run beside this one
    async with _client(bind=f"ipc://{tmp_path}/c.sock") as client:
        victim = EngineProcess("big", workdir=tmp_path, connect=client.addresses)
        engines.append(victim)
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
        calc = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        outcomes: dict[int, object] = {}
        first = anyio.Event()
        x = torch.ones(8 * 1024 * 1024)  # 32 MiB per call, a frame or a shared segment

        async def one(i: int) -> None:
            try:
                outcomes[i] = await calc.scale(x, 2.0)
            except TensorRPCError as exc:
                outcomes[i] = exc
            first.set()

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
            with anyio.fail_after(WAIT):
                await first.wait()  # the engine is busy receiving and answering
            victim.kill()
            await until(lambda: len(outcomes) == 8, FAIL_WITHIN, "every call ended")
        assert sorted(outcomes) == list(range(8))
        for value in outcomes.values():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, x * 2)
            elif transport == "torch_shm":
                # a result whose engine died before this process attached to its memory
                assert isinstance(value, EngineDeadError | TensorTransportError), value
            else:
                assert isinstance(value, EngineDeadError), value
        assert client.statistics().calls_in_flight == 0
        assert "big" not in client.engines
    victim.stop()  # closes its log file, which this process holds
    await _fds_back_to(baseline)
    assert shm_files_of([os.getpid(), victim.pid]) <= shm_before


@ONE_BACKEND
async def test_frozen_engine_fails_calls_and_streams_then_serves_again(
    tmp_path: Path, engines: list[EngineProcess]
) -> None:
    engine = EngineProcess("ice", workdir=tmp_path, bind=f"ipc://{tmp_path}/ice.sock")
    engines.append(engine)
    async with _client(connect=engine.address()) as client:
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
        calc = client.stub()
        outcomes: list[object] = []

        async def unary(i: int) -> None:
            try:
                outcomes.append(await calc.sleep(30.0, f"ice-{i}"))
            except TensorRPCError as exc:
                outcomes.append(exc)

        async def stream() -> None:
            try:
                async for _ in calc.forever("ice-stream"):
                    await anyio.sleep(0.01)
            except TensorRPCError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(unary, i)
            tg.start_soon(stream)
            await until(
                lambda: client.statistics().calls_in_flight == 21, WAIT, "21 calls in flight"
            )
            engine.proc.send_signal(signal.SIGSTOP)
            try:
                await until(lambda: len(outcomes) == 21, FAIL_WITHIN, "every call ended")
            finally:
                engine.proc.send_signal(signal.SIGCONT)
        assert len(outcomes) == 21
        assert all(isinstance(o, EngineDeadError) for o in outcomes), outcomes
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            assert await calc.add(1, 1) == 2


@ONE_BACKEND
async def test_client_killed_mid_call_cancels_the_handler(
    tmp_path: Path, engines: list[EngineProcess]
) -> None:
    engine = EngineProcess("host", workdir=tmp_path, bind=f"ipc://{tmp_path}/host.sock")
    engines.append(engine)
    address = engine.address()
    token = f"orphan-{os.getpid()}-{id(tmp_path)}"
    log = (tmp_path / "client.log").open("wb")
    # Forked from the zygote (tests/_forkserver.py): a process of its own to kill -9,
    # without a fresh interpreter's seconds of imports.
    proc = _forkserver.popen(
        [sys.executable, "-m", "tests.hardening.client_proc", address, token],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        async with _client(connect=address) as observer:
            with anyio.fail_after(WAIT):
                await observer.wait_for_engines(1)
            calc = observer.stub()

            async def state_is(expected: str) -> bool:
                return await calc.event(token) == expected

            await until(lambda: state_is("started"), WAIT, "the client's call is running")
            proc.kill()
            await anyio.to_thread.run_sync(proc.wait, 10)
            # the engine forgets the silent client after its dead_after and cancels its call
            await until(lambda: state_is("cancelled"), FAIL_WITHIN, "the handler cancelled")
            assert await calc.add(2, 2) == 4
    finally:
        proc.kill()  # a no-op once reaped
        proc.wait(10)
        log.close()


SHUTDOWN_CALLS = 1000
STORM_DEAD_AFTER = 10.0


async def _storm(client: Client[Calculator], outcomes: list[object], started: anyio.Event) -> None:
    calc = client.stub()

    async def one(i: int) -> None:
        try:
            outcomes.append(await calc.sleep(0.001 * (i % 50), ""))
        except TensorRPCError as exc:
            outcomes.append(exc)
        if len(outcomes) == 1:
            started.set()

    async with anyio.create_task_group() as tg:
        for i in range(SHUTDOWN_CALLS):
            tg.start_soon(one, i)


@pytest.mark.parametrize("side", ["engine", "client"])
async def test_graceful_shutdown_with_1000_calls_in_flight(tmp_path: Path, side: str) -> None:
    outcomes: list[object] = []
    started = anyio.Event()
    server = Server(
        Calculator("s"),
        bind=f"ipc://{tmp_path}/s.sock",
        engine_id="s",
        max_concurrency=32,
        max_queued=SHUTDOWN_CALLS,
        grace_period=0.2,
        heartbeat_interval=HEARTBEAT,
        # Both ends share this process's loop: starting 1,000 calls on a loaded 2-core
        # machine can hold it past a 1 s bound, and then each end rightly declares the
        # other dead before the shutdown under test happens.
        dead_after=STORM_DEAD_AFTER,
    )
    async with server:
        assert server.endpoint is not None
        client = Client(
            Calculator,
            connect=server.endpoint,
            heartbeat_interval=HEARTBEAT,
            dead_after=STORM_DEAD_AFTER,
        )
        async with client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_storm, client, outcomes, started)
                    await started.wait()
                    assert client.statistics().calls_in_flight > 100
                    if side == "engine":
                        await server.aclose()
                    else:
                        await client.aclose()
    assert len(outcomes) == SHUTDOWN_CALLS
    allowed = (DrainingError, EngineDeadError) if side == "engine" else (ClosedError,)
    failed = [o for o in outcomes if not isinstance(o, str)]
    assert failed, "the shutdown came after every call had finished"
    assert all(isinstance(o, allowed) for o in failed), {type(o) for o in failed}
