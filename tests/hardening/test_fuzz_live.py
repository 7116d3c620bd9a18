"""Hostile frames against a LIVE engine and a LIVE client (hypothesis, plus a seeded mutator).

The engine (an in-process :class:`~tensorrpc._server.Server` serving ``Probe``) and the
client run in an event loop of their own (an anyio blocking portal, asyncio and trio), so
that hypothesis drives them from ordinary synchronous tests. After every hostile message
the test sends a sentinel call and reads until its answer, which proves that the process
neither crashed nor hung, and checks the rules:

* a message whose header parses as a CALL gets exactly one answer (an ERROR, or a RESULT
  when the random bytes happen to form a valid call); nothing else is ever answered;
* a message that does not even split into header/payload/buffers is counted in
  ``statistics().dropped``;
* the client gives its caller exactly one outcome (the value or a typed tensorrpc error)
  and keeps its call table clean;
* memory stays bounded over thousands of hostile messages; a normal call works afterwards.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.from_thread
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from typing_extensions import Buffer

from tensorrpc._client import Client
from tensorrpc._exceptions import RemoteProtocolError, TensorRPCError
from tensorrpc._protocol import (
    MessageKind,
    pack_call_header,
    pack_reply_header,
    split_frames,
    unpack_header,
)
from tensorrpc._server import Server
from tensorrpc._server_protocol import readable_call_id
from tensorrpc._zmq import create_socket
from tests.integration.fake_engine import FakeEngine
from tests.integration.server_peer import Peer
from tests.integration.services import Calculator

from . import _frames
from ._live import live_engine, rss_bytes

WAIT = 10.0
#: Stands for the live call's id in frames drawn before the call exists.
PLACEHOLDER = 2**63 + 12345
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


def _parsed(frame: bytes) -> Any:
    try:
        return unpack_header(frame)
    except RemoteProtocolError:
        return None


def _splits(frames: list[bytes]) -> bool:
    try:
        split_frames(cast("list[Buffer]", frames))
    except RemoteProtocolError:
        return False
    return True


# -- the engine under fire ------------------------------------------------------------------


@dataclass
class EngineHarness:
    portal: anyio.from_thread.BlockingPortal
    server: Server
    peer: Peer
    sentinels: int = 0

    async def _exchange(self, frames: list[bytes]) -> tuple[list[Any], int]:
        header = _parsed(frames[0])
        if header is not None:
            expect = header.call_id if header.kind is MessageKind.CALL else None
        else:  # a CALL header that fails a check but whose call id can be read is answered
            expect = readable_call_id(frames[0]) if frames else None
        self.sentinels += 1
        sentinel = _frames.SENTINEL_BASE + self.sentinels
        self.peer.send(frames)
        self.peer.call("add", 1, 2, call_id=sentinel)
        answers: list[Any] = []
        sentinel_ok = False
        with anyio.fail_after(WAIT):
            while not sentinel_ok or (expect is not None and not answers):
                msg = await self.peer.recv()
                if msg.call_id == sentinel:
                    assert msg.kind is MessageKind.RESULT, msg.error()
                    assert msg.value() == 3
                    sentinel_ok = True
                    continue
                assert expect is not None, f"unexpected {msg.kind!r} #{msg.call_id}"
                assert msg.call_id == expect, (msg.kind, msg.call_id, expect)
                assert msg.kind in (MessageKind.ERROR, MessageKind.RESULT), msg.kind
                answers.append(msg)
        return answers, self.server.statistics().dropped

    def exchange(self, frames: list[bytes]) -> tuple[list[Any], int]:
        answers, dropped = self.portal.call(self._exchange, frames)
        return answers, dropped

    def dropped(self) -> int:
        return self.portal.call(self._dropped)

    async def _dropped(self) -> int:
        return self.server.statistics().dropped


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def engine_harness(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineHarness]:
    tmp = tmp_path_factory.mktemp("fuzz-engine")
    with (
        anyio.from_thread.start_blocking_portal(request.param) as portal,
        portal.wrap_async_context_manager(
            live_engine(tmp, heartbeat_interval=1.0, dead_after=60.0)
        ) as (server, peer, _probe),
    ):
        yield EngineHarness(portal, server, peer)


@FUZZ
@given(frames=_frames.engine_bound())
def test_engine_survives_hostile_frames(engine_harness: EngineHarness, frames: list[bytes]) -> None:
    header = _parsed(frames[0])
    assume(header is None or header.kind not in _frames.SESSION_KINDS)
    dropped_before = engine_harness.dropped()
    answers, dropped_after = engine_harness.exchange(frames)
    if header is not None and header.kind is MessageKind.CALL:
        assert len(answers) == 1
    if not _splits(frames):
        assert dropped_after > dropped_before


def test_engine_memory_stays_bounded_under_mutated_frames(engine_harness: EngineHarness) -> None:
    rng = random.Random(6)
    seeds = _frames.valid_messages()

    def barrage(n: int) -> None:
        for _ in range(n):
            frames = _frames.mutate(rng.choice(seeds), rng)
            header = _parsed(frames[0])
            if header is not None and header.kind in _frames.SESSION_KINDS:
                continue
            engine_harness.exchange(frames)

    barrage(200)  # warm-up: caches, lazily created objects, logging records
    gc.collect()
    rss_before = rss_bytes()
    tracemalloc.start()
    try:
        gc.collect()
        heap_before = tracemalloc.get_traced_memory()[0]
        barrage(800)
        gc.collect()
        heap_growth = tracemalloc.get_traced_memory()[0] - heap_before
    finally:
        tracemalloc.stop()
    rss_growth = rss_bytes() - rss_before
    assert heap_growth < 2 * 1024 * 1024, heap_growth
    assert rss_growth < 64 * 1024 * 1024, rss_growth
    answers, _ = engine_harness.exchange([pack_call_header(99, "mul"), b"\x92\x06\x07"])
    assert answers[0].value() == 42


# -- the client under fire ------------------------------------------------------------------


@dataclass
class ClientHarness:
    portal: anyio.from_thread.BlockingPortal
    client: Client[Calculator]
    engine: FakeEngine

    async def _exchange(self, make: Any) -> object:
        outcome: list[object] = []
        done = anyio.Event()
        sock = self.engine.sock
        assert sock is not None

        async def caller() -> None:
            try:
                outcome.append(await self.client.with_options(timeout=WAIT).stub().add(1, 2))
            except TensorRPCError as exc:
                outcome.append(exc)
            finally:
                done.set()

        async def responder(first: int) -> None:
            # Answer the first CALL with the hostile frames then a proper RESULT; answer
            # retries (an OVERLOADED ERROR makes the client retry) properly.
            await self.engine.send(make(first))
            await self.engine.send([pack_reply_header(MessageKind.RESULT, first), b"\x03"])
            while True:
                frames = await sock.recv()
                header = _parsed(frames[0].bytes)
                if header is not None and header.kind is MessageKind.CALL:
                    reply = [pack_reply_header(MessageKind.RESULT, header.call_id), b"\x03"]
                    await self.engine.send(reply)
                elif header is not None and header.kind is MessageKind.PING:
                    await self.engine.send(
                        [pack_reply_header(MessageKind.PONG, header.call_id), b""]
                    )

        with anyio.fail_after(WAIT + 5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(caller)
                while True:  # skip what the last exchange left behind (CANCEL, PING)
                    frames = await sock.recv()
                    header = _parsed(frames[0].bytes)
                    if header is not None and header.kind is MessageKind.CALL:
                        break
                tg.start_soon(responder, header.call_id)
                await done.wait()
                tg.cancel_scope.cancel()
        assert len(outcome) == 1
        assert self.client.statistics().calls_in_flight == 0
        return outcome[0]

    def exchange(self, make: Any) -> object:
        return self.portal.call(self._exchange, make)


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def client_harness(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClientHarness]:
    tmp = tmp_path_factory.mktemp("fuzz-client")
    client = Client(
        Calculator, bind=f"ipc://{tmp}/client.sock", heartbeat_interval=1.0, dead_after=60.0
    )
    with (
        anyio.from_thread.start_blocking_portal(request.param) as portal,
        portal.wrap_async_context_manager(client),
    ):
        engine = FakeEngine(client.addresses[0], "hostile")
        with portal.wrap_async_context_manager(engine):
            portal.call(engine.join)
            portal.call(_wait_engines, client)
            yield ClientHarness(portal, client, engine)


async def _wait_engines(client: Client[Calculator]) -> None:
    with anyio.fail_after(WAIT):
        await client.wait_for_engines(1)


@FUZZ
@given(data=st.data())
def test_client_survives_hostile_frames(client_harness: ClientHarness, data: st.DataObject) -> None:
    # Drawn here, with a placeholder for the live call id that only the exchange knows.
    drawn = data.draw(_frames.client_bound(PLACEHOLDER))
    header = _parsed(drawn[0])
    if header is not None and header.kind in _frames.SESSION_KINDS:
        drawn = [b"garbage"]
    mark = PLACEHOLDER.to_bytes(8, "little")

    def make(call_id: int) -> list[bytes]:
        first = drawn[0]
        if first[8:16] == mark:
            first = first[:8] + call_id.to_bytes(8, "little") + first[16:]
        return [first, *drawn[1:]]

    outcome = client_harness.exchange(make)
    assert type(outcome) is int or isinstance(outcome, TensorRPCError), outcome
    assert set(client_harness.client.engines) == {"hostile"}


def test_client_keeps_working_after_the_barrage(client_harness: ClientHarness) -> None:
    rng = random.Random(7)
    for _ in range(200):

        def make(call_id: int) -> list[bytes]:
            frames = [pack_reply_header(MessageKind.RESULT, call_id), b"\x03"]
            return _frames.mutate(frames, rng)

        outcome = client_harness.exchange(make)
        assert type(outcome) is int or isinstance(outcome, TensorRPCError), outcome
    assert client_harness.exchange(lambda call_id: [b"x"]) == 3


# -- a raw ROUTER in front of a listening engine (connect mode) -----------------------------


async def test_listening_engine_survives_strangers(tmp_path: Path) -> None:
    """Peers that never did the handshake: garbage is dropped, CALLs get PROTOCOL errors."""
    rng = random.Random(5)
    async with live_engine(tmp_path, listen=True) as (server, peer, _):
        assert server.endpoint is not None
        stranger = create_socket(zmq.DEALER)
        try:
            stranger.connect(server.endpoint)
            seeds = _frames.valid_messages()
            for i in range(200):
                hostile = _frames.mutate(rng.choice(seeds), rng) if i % 2 else [rng.randbytes(30)]
                stranger.send_nowait(hostile)
            call = [pack_call_header(5, "add"), b"\x92\x01\x02"]
            stranger.send_nowait(call)
            with anyio.fail_after(WAIT):
                while True:
                    frames = await stranger.recv()
                    header = unpack_header(frames[0].bytes)
                    if header.call_id == 5:
                        break
            assert header.kind is MessageKind.ERROR
            call_id = peer.call("add", 2, 3)
            assert await peer.result(call_id) == 5
            assert server.statistics().dropped >= 100
        finally:
            await stranger.aclose()
