"""The client's membership hooks for launchers: connect/disconnect later, declare_dead, curve.

Engines run in this process (tasks), which is enough here: the hooks only change what the
client dials and which engines it counts as live.
"""

from __future__ import annotations

import functools
import os

import anyio
import pytest

import tensorrpc
from tensorrpc import rpc, service


@service
class Sleeper:
    def __init__(self, name: str) -> None:
        self.name = name

    @rpc
    async def whoami(self) -> str:
        return self.name

    @rpc
    async def sleep(self, seconds: float) -> str:
        await anyio.sleep(seconds)
        return self.name


async def test_connect_after_open_dials_a_listening_engine() -> None:
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            server = await tg.start(
                functools.partial(
                    tensorrpc.serve, Sleeper("late"), bind="tcp://127.0.0.1:0", engine_id="late"
                )
            )
            assert server.endpoint is not None
            async with tensorrpc.Client(
                Sleeper, bind="tcp://127.0.0.1:0", heartbeat_interval=0.1, dead_after=1.0
            ) as client:
                assert client.curve is None
                assert client.engines == {}
                client.connect(server.endpoint)
                engines = await client.wait_for_engines(1, timeout=10)
                assert engines["late"].address == server.endpoint
                assert await client.stub().whoami() == "late"
                client.disconnect(server.endpoint)
                client.disconnect("tcp://127.0.0.1:1")  # unknown: ignored
                await server.aclose()  # BYE: gone at once, and nothing dials it again
                with anyio.fail_after(5):
                    while client.engines:  # noqa: ASYNC110 - no event for this
                        await anyio.sleep(0.01)
            tg.cancel_scope.cancel()


async def test_declare_dead_fails_only_that_engines_calls_and_checks_the_pid() -> None:
    with anyio.fail_after(20):
        async with tensorrpc.Client(
            Sleeper, bind="tcp://127.0.0.1:0", heartbeat_interval=0.1, dead_after=5.0
        ) as client:
            address = client.addresses[0]
            async with anyio.create_task_group() as tg:
                for name in ("a", "b"):
                    tg.start_soon(
                        functools.partial(
                            tensorrpc.serve,
                            Sleeper(name),
                            connect=address,
                            engine_id=name,
                            grace_period=0.1,
                        )
                    )
                await client.wait_for_engines(2, timeout=10)
                assert not client.declare_dead("a", pid=os.getpid() + 1, reason="wrong pid")
                assert not client.declare_dead("zz", pid=os.getpid(), reason="unknown")
                outcome: list[BaseException | str] = []

                async def slow_call() -> None:
                    try:
                        outcome.append(await client.with_options(engine="a").stub().sleep(30))
                    except tensorrpc.EngineDeadError as exc:
                        outcome.append(exc)

                async with anyio.create_task_group() as calls:
                    calls.start_soon(slow_call)
                    while client.statistics().calls_in_flight == 0:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                    assert client.declare_dead("a", pid=os.getpid(), reason="died (test)")
                [error] = outcome
                assert isinstance(error, tensorrpc.EngineDeadError)
                assert error.engine_id == "a"
                assert "died (test)" in str(error)
                assert await client.with_options(engine="b").stub().whoami() == "b"
                tg.cancel_scope.cancel()


async def test_curve_property_returns_the_config() -> None:
    keys = tensorrpc.generate_keypair()
    curve = tensorrpc.CurveServerConfig(keys, None)
    async with tensorrpc.Client(Sleeper, bind="tcp://127.0.0.1:0", curve=curve) as client:
        assert client.curve is curve


async def test_connect_on_a_closed_client_raises() -> None:
    client = tensorrpc.Client(Sleeper, bind="tcp://127.0.0.1:0")
    with pytest.raises(tensorrpc.ClosedError):
        client.connect("tcp://127.0.0.1:1")
