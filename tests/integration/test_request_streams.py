"""Client streaming and bidirectional streaming end to end: real engines, both backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from tensorrpc import (
    CallContext,
    CallTimeoutError,
    Client,
    ClientCall,
    EngineDeadError,
    InvalidArgumentError,
    PermissionDeniedError,
    RemoteError,
    ValidationError,
    _codec,
    rpc,
    serve,
    service,
)
from tensorrpc._exceptions import ErrorCode
from tensorrpc._protocol import Flags, MessageKind, pack_call_header, pack_reply_header
from tensorrpc._server import Server
from tensorrpc._service import describe

from ..engine_proc import EngineProcess
from .server_peer import Peer, open_peer
from .services import Chunk, Streams

WAIT = 20.0


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
    assert set(info.request_streaming) == {
        "upload", "first", "echo", "gated", "doubles", "sleepy", "fails_at", "tensors",
        "keep", "hold",
    }  # fmt: skip
    assert set(info.streaming) == {"echo", "gated", "doubles", "tensors"}
    assert info.stream_window == 16


async def test_client_streaming_takes_a_plain_iterable_and_an_empty_stream(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT):
            assert await client.call(Streams.first, iter([7, 8, 9])) == 7
            assert await client.stub().first(iter([])) == -1


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


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_tensors_travel_in_request_items_and_back_on_both_transports(
    anyio_backend: str, tmp_path: Path, transport: str
) -> None:
    """Request items and responses go by torch_shm handle to and from an engine process
    the kernel attests (ipc), as frames over tcp."""
    address = f"ipc://{tmp_path}/t.sock" if transport == "ipc" else "tcp://127.0.0.1:0"
    big = [torch.arange(256 * 1024, dtype=torch.float32) + i for i in range(4)]
    async with Client(Streams, bind=address) as client:
        with EngineProcess(
            "t1", workdir=tmp_path, connect=tuple(client.addresses), service="streams"
        ):
            with anyio.fail_after(60):
                await client.wait_for_engines(1)
            with anyio.fail_after(WAIT):
                got = [x async for x in client.stub().tensors(iter(big))]
            stats = client.statistics().transports
    for i, x in enumerate(got):
        assert torch.equal(x, big[i] * 2)
    if transport == "ipc":
        assert stats.torch_shm.tensors_sent == 4  # the request items, by handle
        assert stats.frames.tensors_sent == 0
        assert stats.torch_shm.tensors_received == 4  # the responses, by handle
        # The items' leases ended with the call.
        assert stats.torch_shm_detail is not None
        assert stats.torch_shm_detail.leases_active == 0
    else:
        assert stats.frames.tensors_sent == 4
        assert stats.frames.tensors_received == 4


async def test_request_items_by_handle_keep_their_values_in_a_handler_past_the_call(
    anyio_backend: str, tmp_path: Path
) -> None:
    """A handler that keeps its items' tensors past the call gets pages of their own
    before the RESULT: the client reuses its pool regions at once, the values stay."""
    big = [torch.arange(256 * 1024, dtype=torch.float32) + i for i in range(3)]
    async with Client(Streams, bind=f"ipc://{tmp_path}/k.sock") as client:
        with EngineProcess(
            "k1", workdir=tmp_path, connect=tuple(client.addresses), service="streams"
        ):
            with anyio.fail_after(60):
                await client.wait_for_engines(1)
            stub = client.stub()
            with anyio.fail_after(WAIT):
                assert await stub.keep(iter(big)) == 3
                sent = client.statistics().transports.torch_shm.tensors_sent
                # The same pool regions carry other values now.
                other = [torch.full((256 * 1024,), -7.0) for _ in range(3)]
                got = [x async for x in stub.tensors(iter(other))]
                kept = await stub.recall()
            detail = client.statistics().transports.torch_shm_detail
    assert sent == 3  # the kept items went by handle
    assert all(torch.equal(x, torch.full((256 * 1024,), -14.0)) for x in got)
    assert torch.equal(kept, torch.stack(big))
    assert detail is not None
    assert detail.leases_active == 0


async def test_a_cancelled_request_stream_by_handle_gets_its_item_leases_back(
    anyio_backend: str, tmp_path: Path
) -> None:
    """The client gives up on a request stream whose items went by handle: it keeps their
    leases until the engine, done with the handler, RELEASEs them (those it decoded and
    those it never took), then its pool has no lease left."""
    big = [torch.arange(256 * 1024, dtype=torch.float32) + i for i in range(3)]
    async with Client(Streams, bind=f"ipc://{tmp_path}/c.sock") as client:
        with EngineProcess(
            "c1", workdir=tmp_path, connect=tuple(client.addresses), service="streams"
        ):
            with anyio.fail_after(60):
                await client.wait_for_engines(1)
            stub = client.stub()
            with pytest.raises(CallTimeoutError):
                await client.with_options(timeout=1.0).stub().hold(iter(big))
            sent = client.statistics().transports.torch_shm.tensors_sent
            with anyio.fail_after(WAIT):
                while (  # noqa: ASYNC110 - bounded by fail_after; the engine RELEASEs
                    client.statistics().transports.torch_shm_detail.leases_active  # type: ignore[union-attr]
                ):
                    await anyio.sleep(0.01)
                # The engine still serves by handle afterwards.
                got = [x async for x in stub.tensors(iter(big))]
    assert sent == 3
    assert all(torch.equal(x, y * 2) for x, y in zip(got, big, strict=True))


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
            assert [m async for m in client.stub().echo(iter(["a"]))] == ["A"]


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
                got = [m async for m in stub.echo(iter(["x"] * 100))]
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
            await client.with_options(timeout=0.3).stub().sleepy(iter([1, 2]))
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
            stream = client.stub().echo(iter(["q"]))
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


# -- deadlines, cancellation and failures from either side ------------------------------------


@asynccontextmanager
async def raw_peer(tmp_path: Path, instance: Streams) -> AsyncIterator[Peer]:
    """An engine serving ``instance`` and a scripted client peer that completed the handshake."""
    address = f"ipc://{tmp_path}/raw.sock"
    async with (
        Server(instance, bind=address, engine_id="e1", grace_period=0.5) as server,
        open_peer(describe(Streams), connect=address) as (peer, _),
    ):
        assert server.endpoint is not None
        await peer.handshake(listen=True)
        yield peer


def request_item(peer: Peer, call_id: int, value: Any) -> None:
    encoded = _codec.encode(value)
    peer.send([pack_reply_header(MessageKind.STREAM_ITEM, call_id), encoded.payload])


async def test_the_engine_ends_a_request_stream_at_the_calls_deadline(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with raw_peer(tmp_path, Streams()) as peer:
        # The client sends one item and never half-closes: the engine's own deadline ends it.
        peer.send([pack_call_header(1, "upload", int(Flags.REQUEST_STREAM), 300), b"\x90"])
        request_item(peer, 1, {"seq": 0, "data": np.zeros(2, dtype=np.int64)})
        with anyio.fail_after(WAIT):
            msg = await peer.expect(MessageKind.ERROR, 1)
        assert msg.error().code == ErrorCode.DEADLINE_EXCEEDED


async def test_the_engine_grants_credit_as_its_handler_takes_items(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with raw_peer(tmp_path, Streams()) as peer:
        peer.send([pack_call_header(1, "first", int(Flags.REQUEST_STREAM)), b"\x90"])
        peer.send([pack_call_header(2, "echo", int(Flags.REQUEST_STREAM | Flags.STREAM)), b"\x90"])
        for i in range(16):
            request_item(peer, 2, f"w{i}")
        echoed: list[str] = []
        with anyio.fail_after(WAIT):
            while True:  # the echoes, and the CREDIT once the handler took half the window
                msg = await peer.recv()
                if msg.kind is MessageKind.CREDIT:
                    break
                assert msg.kind is MessageKind.STREAM_ITEM
                echoed.append(msg.value())
            assert msg.call_id == 2
            assert msg.body().n == 8
            request_item(peer, 1, 5)  # `first` answers at its first item
            credits = 8
            while (msg := await peer.recv()).kind is not MessageKind.RESULT:
                if msg.kind is MessageKind.CREDIT:
                    credits += msg.body().n
                else:
                    echoed.append(msg.value())
            assert (msg.call_id, msg.value()) == (1, 5)
        request_item(peer, 1, 6)  # the call ended: dropped, no reply
        peer.credit(2, 16)  # we took the 16 echoes: the engine may look for more
        peer.control(MessageKind.STREAM_END, None, 2)
        with anyio.fail_after(WAIT):
            while (msg := await peer.recv()).kind is not MessageKind.STREAM_END:
                assert msg.kind is MessageKind.STREAM_ITEM  # no CREDIT after the half-close
                echoed.append(msg.value())
        assert echoed == [f"W{i}" for i in range(16)]
        assert credits <= 16  # never more than the items the handler took


async def test_closing_a_bidirectional_stream_cancels_the_engine_handler(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def numbers() -> AsyncIterator[int]:
        i = 0
        while True:
            yield i
            i += 1

    async with running(tmp_path) as (client, instance):
        stream = client.stub().gated(numbers())
        with anyio.fail_after(WAIT):
            assert await stream.__anext__() == 0
            await stream.aclose()
            await instance.gated_closed.wait()  # the CANCEL stopped the handler
            assert await client.stub().upload(chunks(2)) == 4


async def test_a_handler_failing_mid_stream_stops_the_clients_sender(
    anyio_backend: str, tmp_path: Path
) -> None:
    pulled: list[int] = []

    async def numbers() -> AsyncIterator[int]:
        i = 0
        while True:
            pulled.append(i)
            yield i
            i += 1

    async with running(tmp_path) as (client, _):
        with anyio.fail_after(WAIT), pytest.raises(RemoteError, match="boom at 3"):
            await client.stub().fails_at(numbers())
        # The sender stopped with the call: no more than the window past item 3.
        assert len(pulled) <= 3 + 16 + 2


async def test_an_engine_dying_mid_stream_fails_the_call(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def numbers() -> AsyncIterator[int]:
        i = 0
        while True:
            yield i
            i += 1
            await anyio.sleep(0.001)

    async with Client(
        Streams, bind=f"ipc://{tmp_path}/c.sock", heartbeat_interval=0.1, dead_after=1.0
    ) as client:
        with EngineProcess(
            "d1", workdir=tmp_path, connect=tuple(client.addresses), service="streams"
        ) as victim:
            with anyio.fail_after(30):
                await client.wait_for_engines(1)
            async with anyio.create_task_group() as tg:
                failed = anyio.Event()
                errors: list[BaseException] = []

                async def upload() -> None:
                    try:
                        await client.stub().sleepy(numbers())
                    except EngineDeadError as exc:
                        errors.append(exc)
                        failed.set()

                tg.start_soon(upload)
                with anyio.fail_after(WAIT):
                    await client.stub().echo(iter(["warm"])).__anext__()
                victim.kill()
                with anyio.fail_after(WAIT):
                    await failed.wait()
        assert errors
        assert errors[0].engine_id == "d1"  # type: ignore[attr-defined]


async def test_engine_interceptors_run_around_request_stream_handlers(
    anyio_backend: str, tmp_path: Path
) -> None:
    seen: list[tuple[str, str]] = []

    async def icpt(ctx: CallContext, proceed: Callable[[], Awaitable[Any]]) -> Any:
        seen.append((ctx.method, ctx.metadata.get("tag", "")))
        if ctx.metadata.get("tag") == "deny":
            raise PermissionDeniedError("not you")
        return await proceed()

    async with running(tmp_path, interceptors=(icpt,)) as (client, _):
        view = client.with_options(metadata={"tag": "ok"})
        with anyio.fail_after(WAIT):
            assert await view.stub().upload(chunks(3)) == 12
            assert [m async for m in view.stub().echo(["a"])] == ["A"]
            with pytest.raises(PermissionDeniedError, match="not you"):
                await client.with_options(metadata={"tag": "deny"}).stub().upload(chunks(3))
    assert seen == [("upload", "ok"), ("echo", "ok"), ("upload", "deny")]


async def test_the_engine_window_bounds_what_a_client_sends_ahead(
    anyio_backend: str, tmp_path: Path
) -> None:
    sent: list[int] = []

    async def numbers() -> AsyncIterator[int]:
        for i in range(100):
            sent.append(i)
            yield i

    async with running(tmp_path, stream_window=2) as (client, instance):
        assert client._protocol.engines.engines["e1"].info.stream_window == 2
        async with client.stub().gated(numbers()) as slow:
            with anyio.fail_after(WAIT):
                assert await slow.__anext__() == 0
                # Another call's round trip: whatever the sender could send has gone.
                assert await client.stub().first([1]) == 1
            assert len(sent) <= 2 + 2  # the window, the item the handler holds, one pulled
            instance.gate.set()
            with anyio.fail_after(WAIT):
                assert [x async for x in slow] == list(range(1, 100))


async def test_an_engine_killed_mid_stream_frees_the_clients_item_leases(
    anyio_backend: str, tmp_path: Path
) -> None:
    """The engine holding request items by handle is killed (SIGKILL): the call fails and
    the client's pool has no lease left (the engine's end drops them all)."""
    big = [torch.arange(256 * 1024, dtype=torch.float32) + i for i in range(3)]
    async with Client(Streams, bind=f"ipc://{tmp_path}/d.sock") as client:
        with EngineProcess(
            "d1", workdir=tmp_path, connect=tuple(client.addresses), service="streams"
        ) as proc:
            with anyio.fail_after(60):
                await client.wait_for_engines(1)
            failed: list[BaseException] = []

            async def call() -> None:
                try:
                    await client.stub().hold(iter(big))
                except EngineDeadError as exc:
                    failed.append(exc)

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    while client.statistics().transports.torch_shm.tensors_sent < 3:  # noqa: ASYNC110 - bounded by fail_after
                        await anyio.sleep(0.01)
                    proc.kill()
            detail = client.statistics().transports.torch_shm_detail
    assert len(failed) == 1
    assert detail is not None
    assert detail.leases_active == 0
