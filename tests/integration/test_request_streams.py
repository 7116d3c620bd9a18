"""Client streaming and bidirectional streaming end to end: real engines, both backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from tensorrpc import (
    CallContext,
    CallTimeoutError,
    Client,
    ClientCall,
    InvalidArgumentError,
    RemoteError,
    ValidationError,
    call_context,
    rpc,
    serve,
    service,
)

WAIT = 20.0


@dataclass
class Chunk:
    seq: int
    data: np.ndarray


@service
class Streams:
    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.taken: list[int] = []
        self.closed: list[str] = []

    @rpc
    async def upload(self, chunks: AsyncIterator[Chunk]) -> int:
        total = 0
        async for chunk in chunks:
            total += int(chunk.data.sum())
        return total

    @rpc
    async def first(self, xs: AsyncIterator[int]) -> int:
        async for x in xs:
            return x  # returns before the request stream ends
        return -1

    @rpc
    async def echo(self, msgs: AsyncIterator[str]) -> AsyncIterator[str]:
        ctx = call_context()
        ctx.set_response_metadata({"seen": ctx.metadata.get("tag", "")})
        async for m in msgs:
            yield m.upper()

    @rpc
    async def gated(self, xs: AsyncIterator[int]) -> AsyncIterator[int]:
        """Takes one item, then waits for the gate before taking more: a slow reader."""
        try:
            async for x in xs:
                self.taken.append(x)
                yield x
                await self.gate.wait()
        finally:
            self.closed.append("gated")

    @rpc
    async def doubles(self, xs: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
        async for x in xs:
            yield x * 2

    @rpc
    async def sleepy(self, xs: AsyncIterator[int]) -> int:
        async for _ in xs:
            await anyio.sleep(3600)
        return 0


@asynccontextmanager
async def running(
    tmp_path: Path,
    instance: Streams | None = None,
    *,
    client_interceptors: tuple[Any, ...] = (),
    **engine: Any,
) -> AsyncIterator[tuple[Client[Streams], Streams]]:
    address = f"ipc://{tmp_path}/streams.sock"
    instance = instance if instance is not None else Streams()
    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: serve(
                instance, bind=address, engine_id="e1", task_status=task_status, **engine
            )
        )
        try:
            async with Client(Streams, connect=address, interceptors=client_interceptors) as client:
                with anyio.fail_after(WAIT):
                    await client.wait_for_engines(1)
                yield client, instance
        finally:
            tg.cancel_scope.cancel()


async def chunks(n: int, size: int = 4) -> AsyncIterator[Chunk]:
    for i in range(n):
        yield Chunk(i, np.full(size, i, dtype=np.int64))


async def test_client_streaming_sums_many_chunks_with_tensors(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT):
            # 100 items through a window of 16: credit must come back many times; 4 KiB
            # tensors go as frames.
            total = await client.stub().upload(chunks(100, size=512))
    assert total == sum(i * 512 for i in range(100))


async def test_the_engine_hello_names_its_request_streaming_methods(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as (client, _):
        info = client._protocol.engines.engines["e1"].info
    assert set(info.request_streaming) == {"upload", "first", "echo", "gated", "doubles", "sleepy"}
    assert set(info.streaming) == {"echo", "gated", "doubles"}
    assert info.stream_window == 16


async def test_client_streaming_takes_a_plain_iterable_and_an_empty_stream(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT):
            assert await client.call(Streams.first, iter([7, 8, 9])) == 7  # type: ignore[arg-type]
            assert await client.stub().first(iter([])) == -1  # type: ignore[arg-type]


async def test_bidirectional_stream_echoes_in_order_with_metadata(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def words() -> AsyncIterator[str]:
        for w in ["a", "b", "c"] * 20:
            yield w

    async with running(tmp_path) as (client, _):
        view = client.with_options(metadata={"tag": "t1"}, timeout=WAIT)
        async with view.stream(Streams.echo, words()) as stream:
            got = [m async for m in stream]
        assert got == ["A", "B", "C"] * 20
        assert stream.response_metadata == {"seen": "t1"}


async def test_bidirectional_stream_carries_tensors_both_ways(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def arrays() -> AsyncIterator[np.ndarray]:
        for i in range(5):
            yield np.arange(1000, dtype=np.float32) + i

    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT):
            got = [x async for x in client.stub().doubles(arrays())]
    assert len(got) == 5
    for i, x in enumerate(got):
        np.testing.assert_array_equal(x, (np.arange(1000, dtype=np.float32) + i) * 2)


async def test_a_bad_request_item_ends_the_call_with_its_path(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def bad() -> AsyncIterator[Any]:
        yield Chunk(0, np.zeros(2, dtype=np.int64))
        yield {"seq": "nope", "data": np.zeros(2)}

    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT), pytest.raises(ValidationError) as info:
            await client.stub().upload(bad())
        assert info.value.path == "chunks[1]"
        # The connection and the engine are fine afterwards.
        with anyio.fail_after(WAIT):
            assert await client.stub().upload(chunks(3)) == 12


async def test_the_engine_refuses_a_bad_item_with_invalid_argument_and_its_path(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def items() -> AsyncIterator[Any]:
        yield "fine"
        yield 2  # not a str: the engine's check refuses it

    async with running(tmp_path) as (client, _):
        spec = client._spec.methods["echo"]
        checked = spec.check_item
        # Skip the client's own check of items: the engine's is what is tested.
        object.__setattr__(spec, "check_item", lambda value, index: value)
        try:
            got: list[str] = []

            async def read() -> None:
                async for m in client.stub().echo(items()):
                    got.append(m)

            with anyio.fail_after(WAIT), pytest.raises(InvalidArgumentError) as info:
                await read()
        finally:
            object.__setattr__(spec, "check_item", checked)
        assert got == ["FINE"]
        assert info.value.path == ("msgs", 1)
        with anyio.fail_after(WAIT):
            assert [m async for m in client.stub().echo(iter(["a"]))] == ["A"]  # type: ignore[arg-type]


async def test_a_slow_reader_stalls_only_its_own_stream(anyio_backend: str, tmp_path: Path) -> None:
    sent: list[int] = []

    async def numbers() -> AsyncIterator[int]:
        for i in range(1000):
            sent.append(i)
            yield i

    async with running(tmp_path) as (client, instance):
        stub = client.stub()
        async with stub.gated(numbers()) as slow:
            assert await slow.__anext__() == 0
            # The engine's handler waits at the gate: our sender stops at the window.
            with anyio.fail_after(WAIT):
                total = await stub.upload(chunks(200))
            assert total == sum(i * 4 for i in range(200))
            with anyio.fail_after(WAIT):
                got = [m async for m in stub.echo(iter(["x"] * 100))]  # type: ignore[arg-type]
            assert got == ["X"] * 100
            # Window 16 at the engine, plus the item the handler holds; never all 1000.
            assert len(sent) <= 16 + 2
            instance.gate.set()
            with anyio.fail_after(WAIT):
                rest = [x async for x in slow]
        assert rest == list(range(1, 1000))


async def test_a_slow_consumer_of_a_bidirectional_stream_stalls_only_that_stream(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def forever() -> AsyncIterator[str]:
        i = 0
        while True:
            yield str(i)
            i += 1

    async with running(tmp_path) as (client, _):
        stub = client.stub()
        async with stub.echo(forever()) as stream:
            assert await stream.__anext__() == "0"
            # We read nothing more: the engine stops at our window, its handler stops
            # taking items, our sender stops at its window; other calls flow.
            with anyio.fail_after(WAIT):
                assert await stub.upload(chunks(50)) == sum(i * 4 for i in range(50))


async def test_the_client_deadline_ends_a_request_stream(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT), pytest.raises(CallTimeoutError):
            await client.with_options(timeout=0.3).stub().sleepy(iter([1, 2]))  # type: ignore[arg-type]
        with anyio.fail_after(WAIT):
            assert await client.stub().upload(chunks(2)) == 4


async def test_a_failing_request_iterator_cancels_the_call(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def broken() -> AsyncIterator[str]:
        yield "a"
        raise KeyError("source broke")

    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT), pytest.raises(KeyError, match="source broke"):
            async for _ in client.stub().echo(broken()):
                pass


async def test_client_interceptors_run_around_request_streams(
    anyio_backend: str, tmp_path: Path
) -> None:
    seen: list[str] = []

    async def icpt(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        seen.append(call.method)
        call.metadata["tag"] = "from-icpt"
        return await proceed()

    async with running(tmp_path, client_interceptors=(icpt,)) as (client, _):
        with anyio.fail_after(WAIT):
            assert await client.stub().upload(chunks(3)) == 12
            stream = client.stub().echo(iter(["q"]))  # type: ignore[arg-type]
            assert [m async for m in stream] == ["Q"]
        assert stream.response_metadata == {"seen": "from-icpt"}
    assert seen == ["upload", "echo"]


def test_request_streaming_methods_are_refused_with_more_parameters() -> None:
    from tensorrpc import ServiceDefinitionError

    with pytest.raises(ServiceDefinitionError, match="exactly one parameter"):

        @service
        class Bad:
            @rpc
            async def up(self, tag: str, xs: AsyncIterator[int]) -> int:
                return 0


unused = (CallContext, RemoteError)
