"""Large payloads and frames are compressed and decompressed off the event loop.

zstd at level 1 takes milliseconds per MiB: the shells run the codec on a worker thread
for a message with at least ``OFF_LOOP_BYTES`` to compress or decompress (zstd releases
the GIL), so the small calls beside it are not stalled; below that the thread hop costs
more than the work, and it stays inline. The engine runs in this process, on this
thread's event loop: each test records which thread ran each compression and
decompression, on both sides; nothing is timed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from tensorrpc import _compression
from tensorrpc._client import Client
from tensorrpc._compression import OFF_LOOP_BYTES
from tensorrpc._server import Server

from .services import Calculator, Streams

pytest.importorskip("zstandard")

TCP = "tcp://127.0.0.1:0"
WAIT = 30.0


def activations(nbytes: int) -> torch.Tensor:
    """Compressible float32 values (half of them zero), ``nbytes`` of them."""
    gen = torch.Generator().manual_seed(3)
    return torch.relu(torch.randn(nbytes // 4, generator=gen))


LARGE = activations(4 * OFF_LOOP_BYTES)
SMALL = activations(OFF_LOOP_BYTES // 4)  # over Compression.min_bytes: compressed inline


class Threads:
    """``(what, uncompressed bytes, ran on the loop)`` of each compress/decompress."""

    def __init__(self, loop: int) -> None:
        self.loop = loop
        self.records: list[tuple[str, int, bool]] = []

    def wrap(self, what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def watched(data: Any, arg: Any) -> Any:
            size = memoryview(data).nbytes if what == "compress" else arg
            self.records.append((what, size, threading.get_ident() == self.loop))
            return fn(data, arg)

        return watched


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> Threads:
    watcher = Threads(threading.get_ident())  # (the test's thread runs the event loop)
    for what, name in (("compress", "compress"), ("decompress", "decompress_exact")):
        monkeypatch.setattr(_compression, name, watcher.wrap(what, getattr(_compression, name)))
    return watcher


async def test_large_frames_are_compressed_and_decompressed_off_the_loop(
    threads: Threads,
) -> None:
    async with (
        Server(Calculator("e1"), bind=TCP, engine_id="e1") as server,
        Client(Calculator, connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            stub = client.with_options(compression="zstd").stub()
            assert torch.equal(await stub.scale(LARGE, 2.0), LARGE * 2)
            large = list(threads.records)
            threads.records.clear()
            assert torch.equal(await stub.scale(SMALL, 2.0), SMALL * 2)
    n = LARGE.nbytes
    # Client compresses the arguments, engine decompresses them and compresses the
    # result, client decompresses it: each on a worker thread.
    assert large == [
        ("compress", n, False),
        ("decompress", n, False),
        ("compress", n, False),
        ("decompress", n, False),
    ]
    n = SMALL.nbytes
    assert threads.records == [
        ("compress", n, True),
        ("decompress", n, True),
        ("compress", n, True),
        ("decompress", n, True),
    ]


async def test_a_large_compressed_payload_is_decoded_off_the_loop(threads: Threads) -> None:
    tag = "x" * (2 * OFF_LOOP_BYTES)  # one long string: the payload itself is compressed
    async with (
        Server(Calculator("e1"), bind=TCP, engine_id="e1") as server,
        Client(Calculator, connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            assert await client.with_options(compression="zstd").stub().echo(tag) == f"e1:{tag}"
    assert [(what, on_loop) for what, _, on_loop in threads.records] == [
        ("compress", False),
        ("decompress", False),
        ("compress", False),
        ("decompress", False),
    ]


@pytest.mark.parametrize("side", ["client", "engine"])
async def test_a_call_cancelled_while_its_frame_is_compressed_ends_cleanly(
    side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's arguments (first compression) or the engine's result (second) is
    held on its worker thread while the caller cancels: the thread is not abandoned, the
    call ends, and both sides go on as before."""
    started, go = threading.Event(), threading.Event()
    compress = _compression.compress
    seen: list[int] = []

    def held(data: Any, compression: Any) -> Any:
        seen.append(memoryview(data).nbytes)
        if len(seen) == (1 if side == "client" else 2):
            started.set()
            go.wait(WAIT)  # (bounded: a compression on the loop would block it, and fail)
        return compress(data, compression)

    monkeypatch.setattr(_compression, "compress", held)
    async with (
        Server(Calculator("e1"), bind=TCP, engine_id="e1") as server,
        Client(Calculator, connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            stub = client.with_options(compression="zstd").stub()
            scope = anyio.CancelScope()

            async def call() -> None:
                with scope:
                    await stub.scale(LARGE, 2.0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.to_thread.run_sync(started.wait, WAIT)
                assert await stub.add(1, 2) == 3  # the loop serves meanwhile
                scope.cancel()
                go.set()
            assert scope.cancelled_caught
            assert client.statistics().calls_in_flight == 0
            while server.statistics().in_flight:  # noqa: ASYNC110 - bounded by fail_after
                await anyio.sleep(0.01)
            assert torch.equal(await stub.scale(LARGE, 3.0), LARGE * 3)
    # A call cancelled while the client compressed its arguments was never sent.
    assert server.statistics().methods["scale"]["calls"] == (1 if side == "client" else 2)
    assert seen == [LARGE.nbytes] * (3 if side == "client" else 4)


async def test_large_request_items_are_compressed_off_the_loop(threads: Threads) -> None:
    """The items of a client stream are compressed and decompressed as a CALL's
    arguments are: one with frames of at least ``OFF_LOOP_BYTES`` on a worker thread, a
    small one inline."""
    async with (
        Server(Streams(), bind=TCP, engine_id="e1") as server,
        Client(Streams, connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            stub = client.with_options(compression="zstd").stub()
            assert await stub.keep([LARGE, SMALL]) == 2
    for what in ("compress", "decompress"):
        done = [(size, on_loop) for w, size, on_loop in threads.records if w == what]
        assert done == [(LARGE.nbytes, False), (SMALL.nbytes, True)], what
