"""The standard health service end to end: real engines, both backends, the CLI probe."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

from tensorrpc._client import Client
from tensorrpc._exceptions import EngineNotFoundError, OverloadedError
from tensorrpc._health import HealthChange, HealthStatus
from tensorrpc._server import Server
from tensorrpc.cli import main

from .services import Calculator

SERVING = HealthStatus.SERVING
NOT_SERVING = HealthStatus.NOT_SERVING


async def test_health_is_answered_per_service_and_while_every_worker_is_busy(
    tmp_path: Path,
) -> None:
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(
            Calculator("e1"), bind=address, engine_id="e1", max_concurrency=1, max_queued=0
        ) as server,
        Client(Calculator, connect=address) as client,
        anyio.create_task_group() as tg,
    ):
        with anyio.fail_after(10):
            await client.wait_for_engines(1)
            assert await client.health() is SERVING
            assert await client.health("e1", service="Calculator") is SERVING
            assert await client.health("e1", service="Other") is HealthStatus.SERVICE_UNKNOWN
            # The only worker is taken: a call is refused, the health method still answers.
            tg.start_soon(client.stub().sleep, 30.0, "busy")
            while server.statistics().in_flight == 0:
                await anyio.lowlevel.checkpoint()
            with pytest.raises(OverloadedError):
                await client.with_options(wait=False).stub().add(1)
            assert await client.health("e1") is SERVING
            server.set_health(NOT_SERVING)  # a dependency is down
            assert await client.health("e1") is NOT_SERVING
            server.set_health(SERVING)
            assert await client.health("e1") is SERVING
            with pytest.raises(ValueError, match="SERVING or NOT_SERVING"):
                server.set_health(HealthStatus.UNKNOWN)
            with pytest.raises(EngineNotFoundError):
                await client.health("nobody")
            tg.cancel_scope.cancel()


async def test_a_draining_engine_answers_not_serving(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Calculator("e1"), bind=address, engine_id="e1", grace_period=30.0) as server,
        Client(Calculator, connect=address) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            async with anyio.create_task_group() as tg:
                running = anyio.CancelScope()

                async def long_call() -> None:
                    with running:
                        await client.stub().sleep(30.0, "held")

                tg.start_soon(long_call)
                while server.statistics().in_flight == 0:
                    await anyio.lowlevel.checkpoint()
                tg.start_soon(server.aclose)  # drains: waits for the running call
                while server.health is not NOT_SERVING:
                    await anyio.lowlevel.checkpoint()
                assert await client.health("e1") is NOT_SERVING
                assert await client.health("e1", service="Calculator") is NOT_SERVING
                running.cancel()  # the call ends: the drain completes


async def test_watch_health_yields_each_change_per_engine(tmp_path: Path) -> None:
    a, b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    changes: list[HealthChange] = []
    async with (
        Server(Calculator("a"), bind=a, engine_id="a") as server_a,
        Client(Calculator, connect=[a, b]) as client,
    ):
        with anyio.fail_after(20):
            watch = client.watch_health(interval=0.05)
            await client.wait_for_engines(1)
            changes.append(await watch.__anext__())
            async with Server(Calculator("b"), bind=b, engine_id="b") as server_b:
                await client.wait_for_engines(2)
                changes.append(await watch.__anext__())
                server_b.set_health(NOT_SERVING)
                changes.append(await watch.__anext__())
            changes.append(await watch.__anext__())  # b left
            server_a.set_health(NOT_SERVING)
            changes.append(await watch.__anext__())
            await watch.aclose()
    assert changes == [
        HealthChange("a", SERVING, None),
        HealthChange("b", SERVING, None),
        HealthChange("b", NOT_SERVING, SERVING),
        HealthChange("b", HealthStatus.UNKNOWN, NOT_SERVING),
        HealthChange("a", NOT_SERVING, SERVING),
    ]


async def test_watch_health_refuses_a_bad_interval(tmp_path: Path) -> None:
    async with Client(Calculator, bind=f"ipc://{tmp_path}/c.sock") as client:
        for interval, timeout in ((0.0, 1.0), (1.0, -1.0)):
            with pytest.raises(ValueError, match="interval and timeout"):
                await client.watch_health(interval=interval, timeout=timeout).__anext__()


def test_the_cli_probe_exits_0_serving_and_1_not_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"ipc://{tmp_path}/e.sock"
    with anyio.from_thread.start_blocking_portal() as portal:
        server = Server(Calculator("e1"), bind=address, engine_id="e1")
        with portal.wrap_async_context_manager(server):
            assert main(["health", address, "--timeout", "10"]) == 0
            assert capsys.readouterr().out.startswith("ok: engine e1")
            portal.call(server.set_health, NOT_SERVING)
            assert main(["health", address, "--timeout", "10"]) == 1
            err = capsys.readouterr().err.strip()
            assert "the engine is NOT_SERVING" in err
            assert len(err.splitlines()) == 1
            assert main(["health", address, "--timeout", "10", "--json"]) == 1
            assert '"status": "NOT_SERVING"' in capsys.readouterr().out
            portal.call(server.set_health, SERVING)
            assert main(["health", address, "--service", "Other", "--timeout", "10"]) == 1
            assert "service Other is SERVICE_UNKNOWN" in capsys.readouterr().err
