"""Large buffers that tensorrpc drops are freed by its release thread, not on the event loop.

A weak-reference finalizer runs in the thread that drops an object's last reference, so
each test hangs one on the buffers it cares about (every large ZMQ frame received, on
either side, or the tensors handed to a call) and records the thread it ran in. No test
here times anything: the thread's identity is the evidence.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
import zmq

import tensorrpc
from tensorrpc import _codec, _streams, _zmq
from tensorrpc._client import Client
from tensorrpc._server import Server
from tensorrpc._service import rpc, service
from tensorrpc.transports import TransportName

LARGE = 4 << 20  # above the release threshold (1 MiB)
SMALL = 64 << 10  # out of band (above the inline threshold), below the release threshold
WAIT = 20.0
HEARTBEAT = 0.05  # both sides prune finished zero-copy sends on their housekeeping tick


class Freed:
    """Where the watched objects died: ``(what, nbytes, thread ident, thread name)``."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, int, str]] = []
        self._cond = threading.Condition()

    def watch(self, obj: object, what: str, nbytes: int) -> None:
        weakref.finalize(obj, self._died, what, nbytes)

    def _died(self, what: str, nbytes: int) -> None:
        thread = threading.current_thread()
        with self._cond:
            self.records.append((what, nbytes, threading.get_ident(), thread.name))
            self._cond.notify_all()

    def _wait(self, what: str, n: int) -> list[tuple[str, int, int, str]]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.of(what)) >= n, timeout=WAIT)
            return self.of(what)

    def of(self, what: str) -> list[tuple[str, int, int, str]]:
        return [r for r in self.records if r[0] == what]

    async def wait(self, what: str, n: int = 1) -> list[tuple[str, int, int, str]]:
        """The records of ``what`` once there are ``n`` (bounded: fails after WAIT)."""
        got = await anyio.to_thread.run_sync(self._wait, what, n)
        assert len(got) >= n, f"only {len(got)} of {n} {what!r} buffers were freed"
        return got


@pytest.fixture
def freed(monkeypatch: pytest.MonkeyPatch) -> Freed:
    """Watch every frame of at least `SMALL` bytes that a socket receives (both sides)."""
    watcher = Freed()
    recv_frames = _zmq.AsyncSocket._recv_frames

    def watching(self: _zmq.AsyncSocket) -> list[zmq.Frame]:
        frames = recv_frames(self)
        for frame in frames:
            if len(frame) >= SMALL:
                watcher.watch(frame, "frame", len(frame))
        return frames

    monkeypatch.setattr(_zmq.AsyncSocket, "_recv_frames", watching)
    return watcher


@service(name="Sink")
class Sink:
    """Takes, returns and makes tensors; ``made`` tensors are watched."""

    def __init__(self) -> None:
        self.freed: Freed | None = None
        self.arrived: anyio.Event | None = None

    @rpc
    async def consume(self, t: torch.Tensor) -> int:
        """Take a tensor."""
        return t.numel()

    @rpc
    async def echo(self, t: torch.Tensor) -> torch.Tensor:
        """Send the received tensor back."""
        return t

    @rpc
    async def make(self, nbytes: int) -> torch.Tensor:
        """A fresh tensor of ``nbytes``, watched until it dies."""
        t = torch.ones(nbytes, dtype=torch.uint8)
        assert self.freed is not None
        self.freed.watch(t, "made", nbytes)
        return t

    @rpc
    async def made(self, count: int, nbytes: int) -> AsyncIterator[torch.Tensor]:
        """``count`` fresh watched tensors; each next one once the last has died."""
        assert self.freed is not None
        for i in range(count):
            yield watched(self.freed, "made", nbytes)  # the generator keeps no reference
            await self.freed.wait("made", i + 1)

    @rpc
    async def many(self, count: int, nbytes: int) -> AsyncIterator[torch.Tensor]:
        """``count`` fresh tensors of ``nbytes``."""
        for _ in range(count):
            yield torch.ones(nbytes, dtype=torch.uint8)

    @rpc
    async def upload(self, ts: AsyncIterator[torch.Tensor]) -> int:
        """Take tensors as a request stream."""
        total = 0
        async for t in ts:
            total += t.numel()
        return total

    @rpc
    async def first(self, ts: AsyncIterator[torch.Tensor]) -> int:
        """Take the first tensor, then return once ``arrived`` is set."""
        n = 0
        async for t in ts:
            n = t.numel()
            tensorrpc.release_later(t)  # the handler's own: it keeps its drop off the loop
            del t
            break
        assert self.arrived is not None
        with anyio.fail_after(WAIT):
            await self.arrived.wait()
        return n


def watched(freed: Freed, what: str, nbytes: int) -> torch.Tensor:
    """A fresh tensor of ``nbytes`` that ``freed`` watches until it dies."""
    t = torch.ones(nbytes, dtype=torch.uint8)
    freed.watch(t, what, nbytes)
    return t


@asynccontextmanager
async def pair(
    tmp_path: Path,
    topology: str,
    freed: Freed,
    transport: TransportName = "frames",
    arrived: anyio.Event | None = None,
) -> AsyncIterator[tuple[Client[Sink], tensorrpc.Stub[Sink]]]:
    sink = Sink()
    sink.freed = freed
    sink.arrived = arrived
    address = f"ipc://{tmp_path}/s.sock"
    if topology == "dialin":
        client = Client(Sink, bind=address, heartbeat_interval=HEARTBEAT)
        server = Server(sink, engine_id="e1", connect=address, heartbeat_interval=HEARTBEAT)
    else:
        server = Server(sink, engine_id="e1", bind=address, heartbeat_interval=HEARTBEAT)
        client = Client(Sink, connect=address, heartbeat_interval=HEARTBEAT)
    first, second = (client, server) if topology == "dialin" else (server, client)
    async with first, second:
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
        yield client, client.with_options(engine="e1", transport=transport).stub()


TOPOLOGIES = ["dialin", "listen"]


def off_loop(records: list[tuple[str, int, int, str]], loop: int) -> None:
    for what, nbytes, ident, name in records:
        assert ident != loop, f"a {nbytes}-byte {what} was freed on the event loop"
        assert name == "tensorrpc-release", (what, nbytes, name)


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_engine_frees_a_large_call_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed
) -> None:
    loop = threading.get_ident()
    async with pair(tmp_path, topology, freed) as (_, stub):
        t = torch.ones(LARGE, dtype=torch.uint8)
        assert await stub.consume(t) == LARGE
        off_loop(await freed.wait("frame"), loop)
        # The next call (small) finds nothing of the large one left to free.
        assert await stub.consume(torch.ones(16, dtype=torch.uint8)) == 16
        assert [r[1] for r in freed.of("frame")] == [LARGE]


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_small_frames_are_still_freed_inline(
    tmp_path: Path, topology: str, freed: Freed
) -> None:
    loop = threading.get_ident()
    async with pair(tmp_path, topology, freed) as (_, stub):
        assert await stub.consume(torch.ones(SMALL, dtype=torch.uint8)) == SMALL
        [(_, nbytes, ident, _)] = await freed.wait("frame")
        assert nbytes == SMALL
        assert ident == loop  # below the threshold: no hand-over to the thread


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_echo_frees_both_frames_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed
) -> None:
    loop = threading.get_ident()
    async with pair(tmp_path, topology, freed) as (_, stub):
        back = await stub.echo(torch.ones(LARGE, dtype=torch.uint8))
        assert back.numel() == LARGE
        # The engine's frame (its reply held it until ZMQ was done with it) ...
        off_loop(await freed.wait("frame"), loop)
        # ... and the client's, which the caller hands to the release thread as well.
        assert tensorrpc.release_later(back)
        del back
        off_loop(await freed.wait("frame", 2), loop)


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_engine_frees_a_large_result_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed
) -> None:
    loop = threading.get_ident()
    async with pair(tmp_path, topology, freed) as (_, stub):
        got = await stub.make(LARGE)
        assert got.numel() == LARGE
        off_loop(await freed.wait("made"), loop)


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_client_frees_its_contiguous_copy_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A strided argument is sent from a contiguous copy that only the client holds
    # (until ZMQ has sent it): that copy is the client's own large buffer.
    host_bytes = _codec._host_bytes

    def watching(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
        out, view = host_bytes(tensor)
        if out is not tensor:
            freed.watch(out, "copy", out.nbytes)
        return out, view

    monkeypatch.setattr(_codec, "_host_bytes", watching)
    loop = threading.get_ident()
    src = torch.ones(2, LARGE, dtype=torch.uint8)
    async with pair(tmp_path, topology, freed) as (_, stub):
        assert await stub.consume(src[:, ::2]) == LARGE
        off_loop(await freed.wait("copy"), loop)


@pytest.mark.parametrize("transport", ["frames", "torch_shm"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_engine_frees_sent_stream_items_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed, transport: TransportName
) -> None:
    # Each item is made once the one before it died: an item the engine kept until
    # the next one arrived would never die (and die on the loop once it did).
    loop = threading.get_ident()
    async with pair(tmp_path, topology, freed, transport) as (_, stub):
        count = 0
        with anyio.fail_after(3 * WAIT):
            async for t in stub.made(3, LARGE):
                assert t.numel() == LARGE
                count += 1
        del t
        assert count == 3
        off_loop(await freed.wait("made", 3), loop)


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_client_frees_sent_request_items_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed
) -> None:
    # The caller's iterable makes each item once the one before it died (as above).
    loop = threading.get_ident()

    async def items() -> AsyncIterator[torch.Tensor]:
        for i in range(3):
            yield watched(freed, "sent", LARGE)
            await freed.wait("sent", i + 1)

    async with pair(tmp_path, topology, freed) as (_, stub):
        with anyio.fail_after(3 * WAIT):
            assert await stub.upload(items()) == 3 * LARGE
        off_loop(await freed.wait("sent", 3), loop)


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_engine_frees_untaken_request_items_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The handler takes one item of three and returns once the other two are buffered:
    # those two are the engine's own, dropped when the handler ended.
    loop = threading.get_ident()
    arrived = anyio.Event()
    push = _streams.RequestStream.push

    def counting(
        stream: _streams.RequestStream, payload: object, buffers: list[object]
    ) -> str | None:
        fault = push(stream, payload, buffers)  # type: ignore[arg-type]
        if stream.taken + len(stream.items) >= 3:
            arrived.set()
        return fault

    monkeypatch.setattr(_streams.RequestStream, "push", counting)
    ts = [torch.ones(LARGE, dtype=torch.uint8) for _ in range(3)]
    async with pair(tmp_path, topology, freed, arrived=arrived) as (_, stub):
        with anyio.fail_after(WAIT):
            assert await stub.first(ts) == LARGE
        off_loop(await freed.wait("frame", 3), loop)
        assert [r[1] for r in freed.of("frame")] == [LARGE] * 3


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_client_frees_untaken_stream_items_off_the_loop(
    tmp_path: Path, topology: str, freed: Freed, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller takes one item of three and closes the stream once the other two are
    # queued: those two are the client's own, dropped when the stream closes.
    loop = threading.get_ident()
    arrived = anyio.Event()
    received = 0
    recv_frames = _zmq.AsyncSocket._recv_frames

    def counting(sock: _zmq.AsyncSocket) -> list[zmq.Frame]:
        nonlocal received
        frames = recv_frames(sock)
        received += sum(len(frame) >= LARGE for frame in frames)
        if received >= 3:
            arrived.set()  # the message is handled before any other task runs
        return frames

    monkeypatch.setattr(_zmq.AsyncSocket, "_recv_frames", counting)
    async with pair(tmp_path, topology, freed) as (_, stub):
        stream = stub.many(3, LARGE)
        with anyio.fail_after(WAIT):
            first = await stream.__anext__()
            assert first.numel() == LARGE
            tensorrpc.release_later(first)  # the caller's own: it keeps its drop off the loop
            del first
            await arrived.wait()
        await stream.aclose()
        off_loop(await freed.wait("frame", 3), loop)
        assert [r[1] for r in freed.of("frame")] == [LARGE] * 3
