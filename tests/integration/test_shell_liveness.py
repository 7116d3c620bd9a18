"""Liveness in the shells: one clock, and a peer whose messages wait in our socket is alive.

Both shells feed their machines the event loop's clock (`tensorrpc._zmq.loop_clock`),
the clock of anyio's cancel scopes too: on trio it is offset from ``time.monotonic`` by
hours, so a shell on another clock shows there.

Each shell has two readers of its socket: the receive loop and the housekeeping timer.
When both are due at once (a loop that stalled or was starved: both wake together, and
trio runs a batch of woken tasks in either order), the timer may run first. Before it
declares a peer dead it takes what the socket already holds, so a client whose PINGs
wait there (or an engine's) keeps its session.

Each test queues a message in the shell's socket, makes sure it is there without letting
the receive loop run (``zmq_poll`` on the shell's own socket, which also eats the edge of
its descriptor, so the receive loop stays asleep), moves the shell's clock past the
peer's bound and wakes the timer: the message must be answered, the session kept. The
clock is the shell's one clock (``loop_clock``), replaced by a number the test moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest
import zmq
from typing_extensions import Buffer

from tensorrpc import _client_io, _server
from tensorrpc._client import Client
from tensorrpc._protocol import MessageKind, encode_control, split_frames
from tensorrpc._server import Server
from tensorrpc._server_protocol import SessionState
from tensorrpc._service import describe
from tensorrpc._zmq import AsyncSocket

from .fake_engine import FakeEngine
from .server_peer import WAIT, Peer, open_peer
from .server_services import Probe
from .services import Calculator

PING, PONG, HELLO = MessageKind.PING, MessageKind.PONG, MessageKind.HELLO
DEAD_AFTER = 1.0


class Clock:
    """A clock that stands still (at the loop's time when first read) until the test
    moves it."""

    def __init__(self) -> None:
        self._now: float | None = None

    def __call__(self) -> float:
        if self._now is None:
            self._now = anyio.current_time()
        return self._now

    def advance(self, seconds: float) -> None:
        self._now = self() + seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The shells' one clock, replaced by a `Clock` (for the shells entered afterwards)."""
    fake = Clock()
    monkeypatch.setattr(_server, "loop_clock", lambda: fake)
    monkeypatch.setattr(_client_io, "loop_clock", lambda: fake)
    return fake


class Ticked:
    """Wraps a machine's ``tick``: `wait` returns once the timer ran after `arm`."""

    def __init__(self, machine: Any) -> None:
        self._tick = machine.tick
        self._event: anyio.Event | None = None
        machine.tick = self

    def __call__(self, now: float) -> Any:
        result = self._tick(now)
        if self._event is not None:
            self._event.set()
        return result

    def arm(self) -> None:
        self._event = anyio.Event()

    async def wait(self) -> None:
        assert self._event is not None
        with anyio.fail_after(WAIT):
            await self._event.wait()


async def reader_asleep(sock: AsyncSocket) -> None:
    """Wait (bounded) until the receive loop waits on the socket's descriptor: not at a
    checkpoint, from where it would take the next message at the next turn of the loop."""
    waiter = sock._waiter
    with anyio.fail_after(WAIT):
        while not (waiter.amask | waiter.fd_mask) & zmq.POLLIN:
            await anyio.lowlevel.checkpoint()


def queued(sock: AsyncSocket) -> None:
    """Wait (bounded) until a message waits in ``sock``, without taking it or yielding."""
    assert sock.socket.poll(int(WAIT * 1000), zmq.POLLIN), "the message never arrived"


# -- one clock -------------------------------------------------------------------------------


async def test_both_shells_feed_their_machines_the_event_loops_clock(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/sock"
    async with (
        Server(Calculator("e1"), bind=address, engine_id="e1") as server,
        Client(Calculator, connect=address) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            before = anyio.current_time()
            assert await client.stub().add(1) == 2
            after = anyio.current_time()
        # When each machine last heard its peer: during the call, on the loop's clock.
        [heard] = [
            s.last_heard for s in server._proto.sessions.values() if s.state is SessionState.LIVE
        ]
        assert before <= heard <= after
        assert before <= client._protocol.engines.engines["e1"].heard <= after


# -- the engine ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def engine(
    tmp_path: Path, listen: bool, clock: Clock
) -> AsyncIterator[tuple[Server, Peer, AsyncSocket]]:
    """An engine with a session with a scripted peer, and the engine's socket to it."""
    address = f"ipc://{tmp_path}/sock"
    options: dict[str, Any] = {"engine_id": "e1", "heartbeat_interval": 0.1}
    options["dead_after"] = DEAD_AFTER
    spec = describe(Probe)
    if listen:
        async with Server(Probe(), bind=address, **options) as server:
            assert server._router is not None
            async with open_peer(spec, connect=address) as (peer, _):
                await peer.handshake(listen=True)
                yield server, peer, server._router
    else:
        async with (
            open_peer(spec, bind=address) as (peer, _),
            Server(Probe(), connect=address, **options) as server,
        ):
            # A HELLO sent before the connection is up fails (ZMQ_IMMEDIATE) and is sent
            # again after a delay on the engine's clock, which stands still until moved.
            def nudge() -> None:
                clock.advance(0.1)
                server._wake_housekeeping()

            await peer.handshake(nudge=nudge)
            yield server, peer, server._dealers[address]


async def answer(peer: Peer, *kinds: MessageKind) -> tuple[MessageKind, int]:
    """The kind and call id of the engine's next message of ``kinds`` (bounded)."""
    with anyio.fail_after(WAIT):
        while True:
            frames = await peer.sock.recv()
            header, _, _ = split_frames(cast("list[Buffer]", frames[1:]))
            if header.kind in kinds:
                return header.kind, header.call_id


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "dial-in"])
async def test_the_engine_takes_queued_pings_before_declaring_a_client_dead(
    tmp_path: Path, clock: Clock, listen: bool
) -> None:
    async with engine(tmp_path, listen, clock) as (server, peer, sock):
        peer.control(PING, None, 7)  # after the WELCOME: its PONG says the session is live
        assert await answer(peer, PONG) == (PONG, 7)
        ticked = Ticked(server._proto)
        await reader_asleep(sock)
        peer.control(PING, None, 8)
        queued(sock)
        clock.advance(DEAD_AFTER + 1.0)  # the timer fires long after the last message taken
        ticked.arm()
        server._wake_housekeeping()
        await ticked.wait()
        assert [c.state for c in server.statistics().clients] == ["live"]
        assert await answer(peer, PONG, HELLO) == (PONG, 8)  # no HELLO of a new session


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "dial-in"])
async def test_a_call_sent_within_the_bound_is_answered_though_taken_after_it(
    tmp_path: Path, clock: Clock, listen: bool
) -> None:
    # The flake this guards against: a client whose loop stalled for just under the
    # engine's bound sends a CALL; the engine's timer fires before its receive loop took
    # it, and the call met a HELLO of a new session ("replaced by a new session").
    async with engine(tmp_path, listen, clock) as (server, peer, sock):
        assert await peer.result(peer.call("add", 1)) == 2
        ticked = Ticked(server._proto)
        await reader_asleep(sock)
        call_id = peer.call("add", 2)
        queued(sock)
        clock.advance(DEAD_AFTER + 1.0)
        ticked.arm()
        server._wake_housekeeping()
        await ticked.wait()
        assert [c.state for c in server.statistics().clients] == ["live"]
        kind, answered = await answer(peer, MessageKind.RESULT, MessageKind.ERROR, HELLO)
        assert (kind, answered) == (MessageKind.RESULT, call_id)


# -- the client ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def client_of(
    tmp_path: Path, listen: bool
) -> AsyncIterator[tuple[Client[Calculator], FakeEngine, AsyncSocket]]:
    """A client with a session with a scripted engine, and the client's socket."""
    # The engine's bound is long: the client never thinks it left the engine silent.
    address = f"ipc://{tmp_path}/sock"
    options: dict[str, Any] = {"heartbeat_interval": 0.1, "dead_after": DEAD_AFTER}
    options["connect" if listen else "bind"] = address
    fake = FakeEngine(address, "e1", listen=listen, dead_after_ms=60_000)
    client = Client(Calculator, **options)
    async with contextlib.AsyncExitStack() as stack:
        if listen:  # the engine listens, the client dials it
            await stack.enter_async_context(fake)
            await stack.enter_async_context(client)
        else:
            await stack.enter_async_context(client)
            await stack.enter_async_context(fake)
        await fake.join()
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
        assert client._io.sock is not None
        yield client, fake, client._io.sock


@pytest.mark.parametrize("listen", [True, False], ids=["engine-listens", "engine-dials-in"])
async def test_the_client_takes_queued_messages_before_declaring_an_engine_dead(
    tmp_path: Path, clock: Clock, listen: bool
) -> None:
    async with client_of(tmp_path, listen) as (client, fake, sock):
        await fake.send(encode_control(PING, None, 7))
        assert (await fake.next(PONG)).call_id == 7
        ticked = Ticked(client._io.protocol)
        ping = encode_control(PING, None, 8)
        await reader_asleep(sock)
        assert fake.sock is not None
        assert fake.peer is not None or not listen
        fake.sock.send_nowait([fake.peer, *ping] if fake.peer else ping)  # (no yield)
        queued(sock)
        clock.advance(DEAD_AFTER + 1.0)
        ticked.arm()
        tick = client._io.tick
        assert tick is not None
        tick.set()
        await ticked.wait()
        assert list(client.engines) == ["e1"]
        assert (await fake.next(PONG)).call_id == 8
