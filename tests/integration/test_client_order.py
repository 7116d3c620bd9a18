"""Stream items reach the consumer in the order the engine sent them, whoever reads them.

The client's socket has two readers: the reader task and the housekeeping tick, which
first handles the messages already received (``ClientIO.drain_received``: messages prove an
engine alive). The tick may run at any point where the reader yields, so the reader must
never hold a message it took off the socket across a yield; else the tick handles the
later messages first (seen as ``[1, 2, 3, 0, 4, ...]`` from a stream under load).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from tensorrpc import _zmq
from tensorrpc._client import Client
from tensorrpc._protocol import MessageKind

from .fake_engine import FakeEngine
from .services import Calculator

N = 10


@pytest.fixture
def tick_at_every_yield(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[Client[Calculator]]]:
    """Run the housekeeping tick's drain at every yield, with the socket's budget spent.

    Every ``recv``/``recv_nowait`` is followed by a fairness yield (the budget is always
    due), and at every yield of any task the clients in the list handle the messages
    already received, as their housekeeping tick does whenever it gets to run.
    """
    clients: list[Client[Calculator]] = []
    checkpoint = anyio.lowlevel.checkpoint
    shielded = anyio.lowlevel.cancel_shielded_checkpoint

    def tick() -> None:
        for client in clients:
            client._io.drain_received()

    async def ticking_checkpoint() -> None:
        tick()
        await checkpoint()

    async def ticking_shielded() -> None:
        tick()
        await shielded()

    monkeypatch.setattr(_zmq.AsyncSocket, "yield_due", lambda self: True)
    monkeypatch.setattr(anyio.lowlevel, "checkpoint", ticking_checkpoint)
    monkeypatch.setattr(anyio.lowlevel, "cancel_shielded_checkpoint", ticking_shielded)
    yield clients
    clients.clear()  # no tick of a closed client at the yields of the teardown


async def test_stream_items_stay_in_order_when_the_tick_drains_between(
    tmp_path: Path, tick_at_every_yield: list[Client[Calculator]]
) -> None:
    client = Client(
        Calculator,
        bind=f"ipc://{tmp_path}/client.sock",
        heartbeat_interval=0.05,
        dead_after=10.0,
        stream_window=2 * N,
    )
    async with client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        with anyio.fail_after(5):
            await client.wait_for_engines(1)
        tick_at_every_yield.append(client)
        got: list[int] = []
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                got.extend([i async for i in client.stub().count(N)])

            tg.start_soon(consume)
            call = await e1.next(MessageKind.CALL)
            for i in range(N):  # all queued at the client before it reads any
                await e1.reply(call.call_id, i, MessageKind.STREAM_ITEM)
            await e1.end(call.call_id)
        tick_at_every_yield.clear()
        assert got == list(range(N))
