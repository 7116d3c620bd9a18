"""Call context, metadata and interceptors end to end: a stub over a real engine, both backends."""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import tensorrpc
from tensorrpc import (
    Batching,
    CallContext,
    Client,
    ClientCall,
    MetadataError,
    NoCallContextError,
    PermissionDeniedError,
    RemoteError,
    _codec,
    call_context,
    rpc,
    serve,
    service,
)
from tensorrpc._exceptions import ErrorCode
from tensorrpc._metadata import encode_block
from tensorrpc._protocol import (
    HEADER_SIZE,
    Flags,
    MessageKind,
    pack_call_header,
    pack_metadata_reply_header,
    pack_reply_header,
)
from tensorrpc._text import CONTROL
from tensorrpc.batching import current_batch

from .fake_engine import FakeEngine
from .services import Calculator
from .test_server import engine, error_of

WAIT = 20.0


def describe_context(ctx: CallContext) -> dict[str, str]:
    remaining = ctx.time_remaining()
    return {
        "method": ctx.method,
        "engine": ctx.engine_id,
        "caller": ctx.caller,
        "deadline": "none" if remaining is None else "set",
        "cancelled": str(ctx.cancelled),
        **{f"md:{k}": v for k, v in ctx.metadata.items()},
    }


@service
class Ctx:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float | None]] = []

    @rpc
    async def whoami(self) -> dict[str, str]:
        ctx = call_context()
        ctx.set_response_metadata({"served-by": ctx.engine_id})
        return describe_context(ctx)

    @rpc
    def whoami_sync(self) -> dict[str, str]:
        ctx = call_context()  # in the worker thread
        ctx.set_response_metadata({"thread": "yes"})
        return describe_context(ctx)

    @rpc
    async def remaining(self) -> float:
        left = call_context().time_remaining()
        assert left is not None
        return left

    @rpc
    async def count(self, n: int) -> AsyncIterator[str]:
        ctx = call_context()
        for i in range(n):
            yield f"{i}:{ctx.metadata.get('tag', '')}"
        ctx.set_response_metadata({"items": str(n)})

    @rpc
    async def bad_response_metadata(self) -> str:
        try:
            call_context().set_response_metadata({"Upper": "x"})
        except MetadataError as exc:
            return f"refused: {exc}"
        return "accepted"

    @rpc(batch=Batching(max_size=8, max_delay=0.05))
    async def tag(self, x: list[int]) -> list[str]:
        batch = current_batch()
        out = []
        for i, value in enumerate(x):
            ctx = batch.items[i].context
            assert ctx is not None
            ctx.set_response_metadata({"item": str(value)})
            out.append(f"{value}:{ctx.metadata['tag']}")
        try:
            call_context()
        except NoCallContextError:
            return out
        raise AssertionError("a batched handler has no single call context")


@asynccontextmanager
async def running(
    tmp_path: Path,
    *,
    engine_interceptors: tuple[Any, ...] = (),
    client_interceptors: tuple[Any, ...] = (),
) -> AsyncIterator[Client[Ctx]]:
    address = f"ipc://{tmp_path}/ctx.sock"
    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: serve(
                Ctx(),
                bind=address,
                engine_id="e1",
                interceptors=engine_interceptors,
                task_status=task_status,
            )
        )
        try:
            async with Client(
                Ctx, connect=address, client_id="ctx-client", interceptors=client_interceptors
            ) as client:
                with anyio.fail_after(WAIT):
                    await client.wait_for_engines(1)
                yield client
        finally:
            tg.cancel_scope.cancel()


# -- call context and metadata ----------------------------------------------------------------


async def test_an_async_handler_sees_its_call_and_returns_response_metadata(
    anyio_backend: str, tmp_path: Path
) -> None:
    seen: list[ClientCall] = []

    async def keep(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        seen.append(call)
        return await proceed()

    async with running(tmp_path, client_interceptors=(keep,)) as client:
        stub = client.with_options(metadata={"authorization": "Bearer t", "x-trace": "é"}).stub()
        with anyio.fail_after(WAIT):
            info = await stub.whoami()
        assert info == {
            "method": "whoami",
            "engine": "e1",
            "caller": "ctx-client",
            "deadline": "none",
            "cancelled": "False",
            "md:authorization": "Bearer t",
            "md:x-trace": "é",
        }
        assert dict(seen[0].response_metadata) == {"served-by": "e1"}
        assert seen[0].engine == "e1"


async def test_a_sync_handler_sees_its_call_in_the_worker_thread(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as client:
        with anyio.fail_after(WAIT):
            info = await client.with_options(metadata={"k": "v"}, timeout=30).call(Ctx.whoami_sync)
        assert info["method"] == "whoami_sync"
        assert info["md:k"] == "v"
        assert info["deadline"] == "set"
        with anyio.fail_after(WAIT):
            everyone = await client.with_options(metadata={"k": "b"}).broadcast("whoami_sync")
        assert everyone["e1"]["md:k"] == "b"


async def test_the_remaining_deadline_is_what_the_caller_gave(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as client:
        with anyio.fail_after(WAIT):
            left = await client.with_options(timeout=10).stub().remaining()
        assert 0 < left <= 10


async def test_a_stream_reads_its_metadata_and_ends_with_response_metadata(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as client:
        with anyio.fail_after(WAIT):
            stream = client.with_options(metadata={"tag": "t"}).stub().count(3)
            assert stream.response_metadata == {}
            assert [item async for item in stream] == ["0:t", "1:t", "2:t"]
        assert dict(stream.response_metadata) == {"items": "3"}


async def test_each_batched_item_has_its_own_call_context(
    anyio_backend: str, tmp_path: Path
) -> None:
    seen: list[ClientCall] = []

    async def keep(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        seen.append(call)
        return await proceed()

    async with running(tmp_path, client_interceptors=(keep,)) as client:
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = await client.with_options(metadata={"tag": f"t{i}"}).stub().tag(i)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(one, i)
        assert results == {i: f"{i}:t{i}" for i in range(5)}
        assert sorted(c.response_metadata["item"] for c in seen) == [str(i) for i in range(5)]


async def test_response_metadata_is_checked_in_the_handler(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with running(tmp_path) as client:
        with anyio.fail_after(WAIT):
            answer = await client.stub().bad_response_metadata()
        assert answer.startswith("refused: response metadata: key 'Upper'")


def test_call_context_outside_a_call_fails_with_a_typed_error() -> None:
    with pytest.raises(NoCallContextError, match="only available while a handler runs"):
        call_context()
    assert issubclass(NoCallContextError, LookupError)


def test_bad_request_metadata_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(MetadataError, match="reserved"):
        tensorrpc.CallOptions(metadata={"tensorrpc-x": "1"})
    with pytest.raises(MetadataError, match="control character"):
        tensorrpc.CallOptions(metadata={"k": "a\nb"})


async def test_metadata_added_by_an_interceptor_is_checked_when_sent(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def bad(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        call.metadata["k"] = "x" * 5000
        return await proceed()

    async with running(tmp_path, client_interceptors=(bad,)) as client:
        with anyio.fail_after(WAIT), pytest.raises(MetadataError, match="at most 4096"):
            await client.stub().whoami()


# -- interceptors ----------------------------------------------------------------------------


async def test_engine_interceptors_run_in_order_and_can_refuse_with_a_typed_error(
    anyio_backend: str, tmp_path: Path
) -> None:
    order: list[str] = []

    async def outer(ctx: CallContext, proceed: Callable[[], Awaitable[Any]]) -> Any:
        order.append(f"outer {ctx.method}")
        result = await proceed()
        order.append("outer done")
        return result

    async def auth(ctx: CallContext, proceed: Callable[[], Awaitable[Any]]) -> Any:
        order.append("auth")
        if ctx.metadata.get("authorization") != "Bearer good":
            raise PermissionDeniedError(f"{ctx.method}: bad or missing token")
        ctx.set_response_metadata({"auth": "ok"})
        return await proceed()

    async with running(tmp_path, engine_interceptors=(outer, auth)) as client:
        with anyio.fail_after(WAIT):
            with pytest.raises(PermissionDeniedError, match="whoami: bad or missing token"):
                await client.with_options(metadata={"authorization": "Bearer bad"}).stub().whoami()
            assert order == ["outer whoami", "auth"]
            order.clear()
            good = client.with_options(metadata={"authorization": "Bearer good"}).stub()
            assert (await good.whoami())["method"] == "whoami"
            assert order == ["outer whoami", "auth", "outer done"]
            assert [i async for i in good.count(2)] == ["0:", "1:"]
            with pytest.raises(PermissionDeniedError):
                await client.stub().whoami_sync()
            with pytest.raises(PermissionDeniedError):
                [i async for i in client.stub().count(2)]


async def test_an_engine_interceptor_times_calls_and_streams(
    anyio_backend: str, tmp_path: Path
) -> None:
    timed: list[tuple[str, float]] = []

    async def timer(ctx: CallContext, proceed: Callable[[], Awaitable[Any]]) -> Any:
        start = time.perf_counter()
        try:
            return await proceed()
        finally:
            timed.append((ctx.method, time.perf_counter() - start))
            ctx.set_response_metadata({"took-us": str(int((time.perf_counter() - start) * 1e6))})

    async with running(tmp_path, engine_interceptors=(timer,)) as client:
        with anyio.fail_after(WAIT):
            await client.stub().whoami()
            stream = client.stub().count(2)
            assert len([i async for i in stream]) == 2
        assert [m for m, _ in timed] == ["whoami", "count"]
        assert "took-us" in stream.response_metadata
        assert stream.response_metadata["items"] == "2"


async def test_an_engine_interceptor_runs_around_each_batched_item(
    anyio_backend: str, tmp_path: Path
) -> None:
    """Each item of a batch is a call: the engine's interceptors see it alone, and what
    they return is that caller's result."""
    seen: list[tuple[str, str]] = []

    async def wrap(ctx: CallContext, proceed: Callable[[], Awaitable[Any]]) -> Any:
        seen.append((ctx.method, ctx.metadata["tag"]))
        return f"<{await proceed()}>"

    async with running(tmp_path, engine_interceptors=(wrap,)) as client:
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = await client.with_options(metadata={"tag": f"t{i}"}).stub().tag(i)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
    assert results == {i: f"<{i}:t{i}>" for i in range(4)}
    assert sorted(seen) == [("tag", f"t{i}") for i in range(4)]


async def test_an_exception_in_an_engine_interceptor_is_a_remote_error(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def broken(ctx: CallContext, proceed: Callable[[], Awaitable[Any]]) -> Any:
        raise KeyError("nope")

    async with running(tmp_path, engine_interceptors=(broken,)) as client:
        with anyio.fail_after(WAIT), pytest.raises(RemoteError, match="KeyError"):
            await client.stub().whoami()


async def test_client_interceptors_add_metadata_time_and_refuse(
    anyio_backend: str, tmp_path: Path
) -> None:
    log: list[str] = []

    async def add_token(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        call.metadata["authorization"] = "Bearer from-interceptor"
        return await proceed()

    async def refuse_sync(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        if call.method == "whoami_sync":
            raise PermissionDeniedError("not from this client")
        return await proceed()

    async def logger(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        log.append(f"start {call.method} stream={call.streaming}")
        result = await proceed()
        if not call.streaming:
            log.append(f"end {call.method} {dict(call.response_metadata)}")
            return result

        async def items() -> AsyncIterator[Any]:
            try:
                async for item in result:
                    yield item
            finally:
                log.append(f"end {call.method} {dict(call.response_metadata)}")

        return items()

    interceptors = (logger, add_token, refuse_sync)
    async with running(tmp_path, client_interceptors=interceptors) as client:
        with anyio.fail_after(WAIT):
            info = await client.stub().whoami()
            assert info["md:authorization"] == "Bearer from-interceptor"
            with pytest.raises(PermissionDeniedError, match="not from this client"):
                await client.stub().whoami_sync()
            assert [
                i async for i in client.with_options(metadata={"tag": "x"}).stub().count(2)
            ] == ["0:x", "1:x"]
            async with client.stub().count(5) as early:
                async for _ in early:
                    break
    # the early-closed stream ended before or after its STREAM_END came
    log[-1] = log[-1].replace(" {}", "").replace(" {'items': '5'}", "")
    assert log == [
        "start whoami stream=False",
        "end whoami {'served-by': 'e1'}",
        "start whoami_sync stream=False",
        "start count stream=True",
        "end count {'items': '2'}",
        "start count stream=True",
        "end count",
    ]


async def test_a_stream_interceptor_must_return_the_items(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def wrong(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        result = await proceed()
        return 42 if call.streaming else result

    async with running(tmp_path, client_interceptors=(wrong,)) as client:
        with anyio.fail_after(WAIT), pytest.raises(TypeError, match="returned 'int'"):
            [i async for i in client.stub().count(2)]
        with anyio.fail_after(WAIT):
            assert (await client.stub().whoami())["method"] == "whoami"


async def test_a_hostile_metadata_block_gets_protocol_error_and_an_escaped_log(
    anyio_backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tensorrpc")
    hostile = "\x1b]0;owned\x07\u202e".encode()
    entry = b"\x04user" + struct.pack("<H", len(hostile)) + hostile
    block = struct.pack("<H", len(entry)) + entry
    async with engine(tmp_path, "ipc-listen") as (_server, peer, _probe):
        header = bytearray(pack_call_header(5, "add"))
        header[4:6] = int(Flags.METADATA).to_bytes(2, "little")
        payload = _codec.encode([1, 2]).payload
        peer.send([bytes(header[:HEADER_SIZE]) + block + b"add", payload])
        with anyio.fail_after(WAIT):
            message = await error_of(peer, 5, ErrorCode.PROTOCOL)
            assert await peer.result(peer.call("add", 1, 2)) == 3  # the engine carries on
    assert "control character" in message
    assert CONTROL.search(message) is None
    for record in caplog.records:
        assert CONTROL.search(record.getMessage()) is None, record.getMessage()


def test_interceptors_must_be_callable() -> None:
    with pytest.raises(TypeError, match="async callables"):
        Client(Ctx, connect="ipc:///nonexistent", interceptors=[42])  # type: ignore[list-item]
    logging.getLogger(__name__).debug("constructed nothing")


def test_the_blocking_client_takes_metadata_and_interceptors() -> None:
    async def noop(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        return await proceed()

    with tensorrpc.BlockingClient(Ctx, bind="tcp://127.0.0.1:0", interceptors=[noop]) as client:
        view = client.with_options(metadata={"k": "v"})
        assert view._view.options.metadata == {"k": "v"}
        stub: Any = client.with_options(metadata={"k": "w"}, wait_for_ready=True).stub()
        assert stub._async_stub._options.metadata == {"k": "w"}
        assert stub._async_stub._options.wait_for_ready is True
        with pytest.raises(MetadataError):
            client.with_options(metadata={"K": "v"})


async def test_call_with_metadata_returns_the_response_metadata(
    anyio_backend: str, tmp_path: Path
) -> None:
    async def tag(call: ClientCall, proceed: Callable[[], Awaitable[Any]]) -> Any:
        call.metadata["from-interceptor"] = "1"
        return await proceed()

    (tmp_path / "b").mkdir()
    async with (
        running(tmp_path) as plain,
        running(tmp_path / "b", client_interceptors=(tag,)) as icpt,
    ):
        with anyio.fail_after(WAIT):
            info, metadata = await plain.with_options(metadata={"k": "v"}).call_with_metadata(
                Ctx.whoami
            )
            assert info["md:k"] == "v"
            assert dict(metadata) == {"served-by": "e1"}
            info, metadata = await icpt.call_with_metadata(Ctx.whoami_sync)
            assert info["md:from-interceptor"] == "1"
            assert dict(metadata) == {"thread": "yes"}
            with pytest.raises(TypeError, match="streaming method"):
                await plain.call_with_metadata(Ctx.count, 1)


async def test_the_client_sends_metadata_and_drops_a_reply_with_a_hostile_block(
    anyio_backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tensorrpc")
    hostile = "\x1b[2J\u202eforged\nline".encode()
    entry = b"\x01k" + struct.pack("<H", len(hostile)) + hostile
    async with (
        Client(Calculator, bind=f"ipc://{tmp_path}/c.sock", heartbeat_interval=0.05) as client,
        FakeEngine(client.addresses[0], "e1") as engine,
    ):
        await engine.join()
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            async with anyio.create_task_group() as tg:
                outcome: list[Any] = []

                async def call() -> None:
                    view = client.with_options(metadata={"authorization": "Bearer t"})
                    outcome.append(await view.call_with_metadata(Calculator.add, 1, 2))

                tg.start_soon(call)
                msg = await engine.next(MessageKind.CALL)
                assert dict(msg.header.metadata) == {"authorization": "Bearer t"}
                bad = bytearray(pack_reply_header(MessageKind.RESULT, msg.call_id))
                bad[4:6] = int(Flags.METADATA).to_bytes(2, "little")
                payload = _codec.encode(3).payload
                await engine.send([bytes(bad) + struct.pack("<H", len(entry)) + entry, payload])
                good = encode_block({"served-by": "fake"})
                header = pack_metadata_reply_header(MessageKind.RESULT, msg.call_id, good)
                await engine.send([header, payload])
        assert outcome == [(3, {"served-by": "fake"})]
    assert any("control character" in r.getMessage() for r in caplog.records)
    for record in caplog.records:
        assert CONTROL.search(record.getMessage()) is None, record.getMessage()
