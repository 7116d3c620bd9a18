"""gRPC's wait-for-ready (issue 24 item 2): a call with a deadline waits for a live engine
within it, over an engine restart; when it gives up, the error says why there was none.
The decision is the protocol's (`ClientProtocol.select`, `EngineTable.absence`,
tests/unit/test_engines.py); these run the shell over real sockets on both backends.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.abc
import pytest

from tensorrpc._client import Client
from tensorrpc._exceptions import EngineNotFoundError
from tensorrpc._protocol import Reject
from tensorrpc._server import Server, serve
from tests.integration.fake_engine import FakeEngine

from .services import Calculator, CalculatorV2

WAIT_S = 60.0  # bounds every wait; far above what any step takes


async def _engine(
    address: str, engine_id: str, *, task_status: anyio.abc.TaskStatus[Server]
) -> None:
    await serve(Calculator(engine_id), connect=address, engine_id=engine_id,
                task_status=task_status)  # fmt: skip


async def test_a_call_rides_out_an_engine_restart(tmp_path: Path) -> None:
    async with Client(Calculator, bind=f"ipc://{tmp_path}/c.sock") as client:
        address = client.addresses[0]
        calc = client.with_options(timeout=WAIT_S).stub()
        async with anyio.create_task_group() as tg:

            async def first_life(*, task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
                async with anyio.create_task_group() as life:
                    await life.start(_engine, address, "e1")
                    task_status.started(life.cancel_scope)

            with anyio.fail_after(WAIT_S):
                first = await tg.start(first_life)
                await client.wait_for_engines(1)
                assert await calc.whoami() == "e1"
            first.cancel()  # the engine stops (drains, says BYE)...
            with anyio.fail_after(WAIT_S):
                while client.engines:
                    await anyio.wait_all_tasks_blocked()
            results: list[str] = []

            async def call() -> None:
                results.append(await calc.whoami())

            tg.start_soon(call)
            await anyio.wait_all_tasks_blocked()
            assert results == []  # waiting for an engine, not failed at once
            assert client.statistics().waiting_for_capacity == 1
            with anyio.fail_after(WAIT_S):
                await tg.start(_engine, address, "e1")  # ...and comes back
                while not results:
                    await anyio.wait_all_tasks_blocked()
            assert results == ["e1"]
            tg.cancel_scope.cancel()


async def test_giving_up_says_none_ever_joined(tmp_path: Path) -> None:
    async with Client(Calculator, bind=f"ipc://{tmp_path}/c.sock") as client:
        started = anyio.current_time()
        with pytest.raises(EngineNotFoundError) as info:
            await client.with_options(timeout=0.3).stub().add(1)
        assert anyio.current_time() - started >= 0.29  # it waited its deadline
        assert str(info.value) == (
            "Calculator.add: no live engine within 0.3 s: no engine has joined yet"
        )


async def test_giving_up_names_the_refusal(tmp_path: Path) -> None:
    async with Client(Calculator, bind=f"ipc://{tmp_path}/c.sock") as client:
        async with FakeEngine(client.addresses[0], "old", service=CalculatorV2) as engine:
            assert isinstance(await engine.join(), Reject)
        with pytest.raises(EngineNotFoundError) as info:
            await client.with_options(timeout=0.3).stub().add(1)
        text = str(info.value)
        assert text.startswith("Calculator.add: no live engine within 0.3 s: every engine ")
        assert "refused: old: fingerprint: engine 'old' has a different schema: " in text


async def test_giving_up_says_the_engine_left(tmp_path: Path) -> None:
    async with Client(Calculator, bind=f"ipc://{tmp_path}/c.sock") as client:
        async with Server(Calculator("e1"), connect=client.addresses[0], engine_id="e1"):
            with anyio.fail_after(WAIT_S):
                await client.wait_for_engines(1)
        with anyio.fail_after(WAIT_S):
            while client.engines:
                await anyio.wait_all_tasks_blocked()
        with pytest.raises(EngineNotFoundError, match="restarting\\? \\('e1'\\)"):
            await client.with_options(timeout=0.3).stub().add(1)
        with pytest.raises(EngineNotFoundError, match=r"'e1' within 0\.3 s: it left"):
            await client.with_options(timeout=0.3, engine="e1").stub().add(1)


async def test_without_a_deadline_or_when_asked_a_call_fails_at_once(tmp_path: Path) -> None:
    async with Client(Calculator, bind=f"ipc://{tmp_path}/c.sock") as client:
        for stub in (
            client.stub(),
            client.with_options(timeout=WAIT_S, wait_for_ready=False).stub(),
        ):
            with anyio.fail_after(WAIT_S), pytest.raises(EngineNotFoundError) as info:
                await stub.add(1)
            assert str(info.value) == "no live engines: no engine has joined yet"
        # A stream waits too, and says why when it gives up.
        with pytest.raises(EngineNotFoundError, match=r"no live engine within 0\.2 s"):
            assert [i async for i in client.with_options(timeout=0.2).stub().count(3)] == []
