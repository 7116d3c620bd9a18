"""A careless client over real sockets (issue 9 item 9): many calls after a loop stall.

Starting 100,000 calls at once holds the client's loop longer than an engine's bound, so
the engine forgets the session before the first call runs. The protocol-level rules are
in tests/unit/test_client_stall.py; this checks that the shell acts on them: no CALL goes
to the engine before it has been welcomed again, and every call then completes, each
admitted with one wake-up.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from tensorrpc._client import Client
from tensorrpc._protocol import MessageKind

from .fake_engine import FakeEngine
from .services import Calculator

CALL = MessageKind.CALL
WELCOME = MessageKind.WELCOME


async def test_calls_started_after_a_stall_wait_for_the_engine_to_rejoin(tmp_path: Path) -> None:
    calls = 200
    async with (
        Client(
            Calculator, bind=f"ipc://{tmp_path}/c.sock", max_in_flight=4, dead_after=30.0
        ) as client,
        FakeEngine(client.addresses[0], "e1", dead_after_ms=5000, epoch=1) as engine,
    ):
        await engine.join()
        # The loop "stalled": nothing was sent to the engine for longer than its 5 s bound
        # (as when the caller below spends seconds starting its tasks). The engine has
        # forgotten the session, as a real one would. (A bound of 5 s, not 1 s: on a loaded
        # host the 200 calls below could hold the loop past 1 s, a real stall the client
        # then reports as such, failing calls this test expects to complete.)
        client._protocol.engines.engines["e1"].sent -= 100.0
        results: list[str] = []

        async def call(i: int) -> None:
            results.append(await client.stub().echo(str(i)))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(calls):
                    tg.start_soon(call, i)
                # a forgetting engine in GREETING says HELLO again; no CALL may come first
                engine.hello_fields["epoch"] = 2
                await engine.send_hello()
                assert (await engine.next(CALL, WELCOME)).kind is WELCOME
                for _ in range(calls):
                    msg = await engine.next(CALL)
                    await engine.reply(msg.call_id, engine.args(msg)[0])
        assert sorted(results, key=int) == [str(i) for i in range(calls)]
        assert client.statistics().engines["e1"].errors == 0
        # The rejoin woke 4 (one per slot), then one per freed slot; a few passed on.
        assert client._protocol.capacity.wakeups <= calls + 8
