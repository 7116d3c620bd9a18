"""The client against a scripted engine: exactly what goes over the wire, and when."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import anyio
import pytest
import torch

from tensorrpc._client import CallOptions, Client
from tensorrpc._exceptions import (
    BroadcastError,
    CallTimeoutError,
    ClosedError,
    ConnectError,
    EngineDeadError,
    EngineNotFoundError,
    EnginesUnavailableError,
    ErrorCode,
    MethodNotFoundError,
    OverloadedError,
    RemoteError,
    ValidationError,
)
from tensorrpc._protocol import Credit, Flags, MessageKind, Reject, Welcome

from .fake_engine import FakeEngine
from .services import Calculator, CalculatorV2

CALL = MessageKind.CALL


def make_client(tmp_path: Path, **kw: object) -> Client[Calculator]:
    # The fake engine answers PINGs only while a test reads from it: a short dead_after
    # would declare it dead whenever the test (or a loaded machine) pauses. Only the
    # silence test asks for a short one.
    options: dict[str, object] = {"heartbeat_interval": 0.05, "dead_after": 10.0}
    options.update(kw)
    return Client(Calculator, bind=f"ipc://{tmp_path}/client.sock", **options)  # type: ignore[arg-type]


async def test_handshake_welcome_and_engine_info(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path, stream_window=5) as client,
        FakeEngine(client.addresses[0], "e1", pid=4242) as engine,
    ):
        welcome = await engine.join()
        assert isinstance(welcome, Welcome)
        assert welcome.client_id == client.client_id
        assert welcome.stream_window == 5
        assert welcome.heartbeat_ms == 50
        with anyio.fail_after(5):
            engines = await client.wait_for_engines(1)
        assert engines["e1"].pid == 4242
        assert engines["e1"].service == "Calculator"
        assert engines["e1"].address is None


async def test_fingerprint_mismatch_is_refused_with_reason(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client:
        async with FakeEngine(client.addresses[0], "old", service=CalculatorV2) as engine:
            reject = await engine.join()
        assert isinstance(reject, Reject)
        assert reject.reason == "fingerprint"
        assert reject.message.startswith("engine 'old' has a different schema: ")
        # The readable diff comes first, the hashes shortened to 12 hex digits at the end.
        assert reject.message.index("engine lacks") < reject.message.index("(fingerprint ")
        assert re.search(
            r"\(fingerprint [0-9a-f]{12}, client expects [0-9a-f]{12}\)$", reject.message
        )
        with pytest.raises(EnginesUnavailableError) as info:
            await client.wait_for_engines(1, timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        assert "old" in info.value.rejected
        assert "fingerprint" in str(info.value)
        assert client.engines == {}


async def test_duplicate_live_id_is_refused_first_keeps_serving(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path) as client,
        FakeEngine(client.addresses[0], "e1") as first,
        FakeEngine(client.addresses[0], "e1") as second,
    ):
        assert isinstance(await first.join(), Welcome)
        reject = await second.join()
        assert isinstance(reject, Reject)
        assert reject.reason == "duplicate_id"
        async with anyio.create_task_group() as tg:
            results: list[int] = []

            async def call() -> None:
                results.append(await client.with_options(engine="e1").stub().add(1, 2))

            tg.start_soon(call)
            msg = await first.next(CALL)
            assert first.args(msg) == [1, 2]
            await first.reply(msg.call_id, 3)
        assert results == [3]


async def test_call_result_and_late_or_foreign_replies_are_dropped(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path) as client,
        FakeEngine(client.addresses[0], "e1") as e1,
        FakeEngine(client.addresses[0], "e2") as e2,
    ):
        await e1.join()
        await e2.join()
        results: dict[str, object] = {}
        async with anyio.create_task_group() as tg:

            async def call(tag: str) -> None:
                results[tag] = await client.with_options(engine="e1").stub().echo(tag)

            tg.start_soon(call, "a")
            msg_a = await e1.next(CALL)
            tg.start_soon(call, "b")
            msg_b = await e1.next(CALL)
            assert msg_a.call_id != msg_b.call_id
            # e2 answers a call that was sent to e1: must be ignored
            await e2.reply(msg_a.call_id, "forged")
            await e1.reply(msg_b.call_id, "B")
            await e1.reply(msg_a.call_id, "A")
            # a duplicate reply after the call finished: dropped
            await e1.reply(msg_a.call_id, "late")
        assert results == {"a": "A", "b": "B"}
        assert await await_call(client, e1, "c") == "C"


async def await_call(client: Client[Calculator], engine: FakeEngine, tag: str) -> object:
    async with anyio.create_task_group() as tg:
        out: list[object] = []

        async def call() -> None:
            out.append(await client.with_options(engine=engine.engine_id).stub().echo(tag))

        tg.start_soon(call)
        msg = await engine.next(CALL)
        await engine.reply(msg.call_id, tag.upper())
    return out[0]


async def test_timeout_sends_deadline_and_cancel(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        with pytest.raises(CallTimeoutError) as info:
            await client.with_options(timeout=0.2).stub().sleep(10.0)
        assert isinstance(info.value, TimeoutError)
        call = await e1.next(CALL)
        assert 0 < call.header.timeout_ms <= 200
        cancel = await e1.next(MessageKind.CANCEL)
        assert cancel.call_id == call.call_id
        assert client.statistics().calls_in_flight == 0
        assert client.statistics().engines["e1"].errors == 1


async def test_cancelling_the_caller_sends_cancel(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.call, Calculator.sleep, 10.0)
            call = await e1.next(CALL)
            tg.cancel_scope.cancel()
        cancel = await e1.next(MessageKind.CANCEL)
        assert cancel.call_id == call.call_id
        await e1.reply(call.call_id, "too late")  # dropped, nobody waits
        assert client.statistics().calls_in_flight == 0
        assert await await_call(client, e1, "x") == "X"


async def test_remote_errors_are_typed(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        async with anyio.create_task_group() as tg:

            async def engine_side() -> None:
                msg = await e1.next(CALL)
                await e1.error(msg.call_id, ErrorCode.REMOTE, "boom", "builtins.ValueError")
                msg = await e1.next(CALL)
                await e1.error(msg.call_id, ErrorCode.METHOD_NOT_FOUND, "no such method")

            tg.start_soon(engine_side)
            with pytest.raises(RemoteError) as info:
                await client.stub().fail("boom")
            assert info.value.remote_type == "builtins.ValueError"
            with pytest.raises(MethodNotFoundError):
                await client.stub().add(1)


async def test_bad_result_type_is_a_validation_error(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        async with anyio.create_task_group() as tg:

            async def engine_side() -> None:
                msg = await e1.next(CALL)
                await e1.reply(msg.call_id, "not an int")

            tg.start_soon(engine_side)
            with pytest.raises(ValidationError):
                await client.stub().add(1, 2)


async def test_local_validation_sends_nothing(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        with pytest.raises(ValidationError):
            await client.stub().add("x")  # type: ignore[arg-type]
        with pytest.raises(ValidationError):
            client.stub().count("x")  # type: ignore[arg-type]
        gc.collect()
        assert client.statistics().engines["e1"].calls == 0


async def test_unknown_engine_lists_live_ones(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        with pytest.raises(EngineNotFoundError, match="no live engines"):
            await client.stub().add(1)
        await e1.join()
        with pytest.raises(EngineNotFoundError) as info:
            await client.with_options(engine="nope").stub().add(1)
        assert info.value.live == ("e1",)


async def test_stream_credit_and_early_close(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path, stream_window=4) as client,
        FakeEngine(client.addresses[0], "e1") as e1,
    ):
        await e1.join()
        stream = client.stream(Calculator.count, 100)
        async with anyio.create_task_group() as tg:
            got: list[int] = []

            async def consume() -> None:
                async for item in stream:
                    got.append(item)
                    if len(got) == 3:
                        await stream.aclose()

            tg.start_soon(consume)
            call = await e1.next(CALL)
            assert call.header.flags & Flags.STREAM
            for i in range(4):
                await e1.reply(call.call_id, i, MessageKind.STREAM_ITEM)
            credit = await e1.next(MessageKind.CREDIT)
            assert credit.call_id == call.call_id
            assert credit.body() == Credit(2)
            cancel = await e1.next(MessageKind.CANCEL)
            assert cancel.call_id == call.call_id
        assert got == [0, 1, 2]
        assert client.statistics().calls_in_flight == 0


async def test_stream_end_and_error(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        async with anyio.create_task_group() as tg:

            async def engine_side() -> None:
                msg = await e1.next(CALL)
                for i in range(3):
                    await e1.reply(msg.call_id, i, MessageKind.STREAM_ITEM)
                await e1.end(msg.call_id)
                msg = await e1.next(CALL)
                await e1.reply(msg.call_id, 7, MessageKind.STREAM_ITEM)
                await e1.error(msg.call_id, ErrorCode.REMOTE, "mid-stream", "RuntimeError")

            tg.start_soon(engine_side)
            assert [i async for i in client.stub().count(3)] == [0, 1, 2]
            got: list[int] = []

            async def consume() -> None:
                async for i in client.stub().count(3):
                    got.append(i)

            with pytest.raises(RemoteError, match="mid-stream"):
                await consume()
            assert got == [7]


async def test_abandoned_stream_is_cancelled_after_gc(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        holder = [client.stream(Calculator.forever, "t")]
        async with anyio.create_task_group() as tg:

            async def first() -> None:
                assert await holder[0].__anext__() == 0

            tg.start_soon(first)
            call = await e1.next(CALL)
            await e1.reply(call.call_id, 0, MessageKind.STREAM_ITEM)
        holder.clear()
        gc.collect()
        cancel = await e1.next(MessageKind.CANCEL)
        assert cancel.call_id == call.call_id
        assert client.statistics().calls_in_flight == 0


async def test_silent_engine_is_declared_dead_and_id_freed(tmp_path: Path) -> None:
    async with make_client(tmp_path, dead_after=0.6) as client:
        async with FakeEngine(client.addresses[0], "e1") as e1:
            await e1.join()
            e1.answer_pings = False
            with anyio.fail_after(5):
                with pytest.raises(EngineDeadError) as info:
                    await client.stub().sleep(30.0)
            assert info.value.engine_id == "e1"
            assert "e1" not in client.engines
        async with FakeEngine(client.addresses[0], "e1") as again:
            assert isinstance(await again.join(), Welcome)
            assert await await_call(client, again, "r") == "R"
        stats = client.statistics().engines["e1"]
        assert stats.calls == 2
        assert stats.errors == 1


async def test_bye_fails_in_flight_calls(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        async with anyio.create_task_group() as tg:

            async def engine_side() -> None:
                await e1.next(CALL)
                await e1.bye()

            tg.start_soon(engine_side)
            with pytest.raises(EngineDeadError, match="BYE"):
                await client.stub().sleep(30.0)
        assert client.engines == {}


async def test_backpressure_wait_or_overloaded(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path, max_in_flight=1) as client,
        FakeEngine(client.addresses[0], "e1") as e1,
    ):
        await e1.join()
        async with anyio.create_task_group() as tg:
            results: list[str] = []

            async def call(tag: str) -> None:
                results.append(await client.stub().echo(tag))

            tg.start_soon(call, "a")
            first = await e1.next(CALL)
            with pytest.raises(OverloadedError):
                await client.with_options(wait=False).stub().echo("x")
            tg.start_soon(call, "b")
            await anyio.wait_all_tasks_blocked()
            assert client.statistics().waiting_for_capacity == 1
            await e1.reply(first.call_id, "A")
            second = await e1.next(CALL)
            assert e1.args(second) == ["b"]
            await e1.reply(second.call_id, "B")
        assert results == ["A", "B"]


async def test_engine_overload_is_retried_only_when_waiting(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        async with anyio.create_task_group() as tg:

            async def engine_side() -> None:
                first = await e1.next(CALL)
                assert not first.header.flags & Flags.NO_WAIT
                await e1.error(first.call_id, ErrorCode.OVERLOADED, "queue full")
                retry = await e1.next(CALL)
                assert retry.call_id != first.call_id
                assert e1.args(retry) == [20, 22]
                await e1.reply(retry.call_id, 42)
                refused = await e1.next(CALL)
                assert refused.header.flags & Flags.NO_WAIT
                await e1.error(refused.call_id, ErrorCode.OVERLOADED, "queue full")

            tg.start_soon(engine_side)
            assert await client.stub().add(20, 22) == 42
            with pytest.raises(OverloadedError, match="queue full"):
                await client.with_options(wait=False).stub().add(1, 2)
        stats = client.statistics()
        assert stats.overload_retries == 1
        assert stats.engines["e1"].errors == 1


async def test_broadcast_collects_every_outcome(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path) as client,
        FakeEngine(client.addresses[0], "e1") as e1,
        FakeEngine(client.addresses[0], "e2") as e2,
    ):
        await e1.join()
        await e2.join()
        async with anyio.create_task_group() as tg:

            async def engines_side(fail: bool) -> None:
                for engine in (e1, e2):
                    msg = await engine.next(CALL)
                    assert engine.args(msg) == [1, 2]
                    if fail and engine is e2:
                        await engine.error(msg.call_id, ErrorCode.REMOTE, "no", "KeyError")
                    else:
                        await engine.reply(msg.call_id, 3)

            tg.start_soon(engines_side, False)
            assert await client.broadcast("add", 1, 2) == {"e1": 3, "e2": 3}
        async with anyio.create_task_group() as tg:
            tg.start_soon(engines_side, True)
            with pytest.raises(BroadcastError) as info:
                await client.broadcast("add", 1, b=2)
        assert info.value.results["e1"] == 3
        assert isinstance(info.value.errors["e2"], RemoteError)


async def test_tensor_arguments_travel_as_frames(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        x = torch.arange(4096, dtype=torch.float32).reshape(64, 64)[:, ::2]
        async with anyio.create_task_group() as tg:

            async def engine_side() -> None:
                msg = await e1.next(CALL)
                assert len(msg.buffers) == 1
                arg, factor = e1.args(msg)
                await e1.reply(msg.call_id, arg * factor)

            tg.start_soon(engine_side)
            out = await client.call(Calculator.scale, x, 2.0)
        assert torch.equal(out, x * 2)
        assert client.statistics().engines["e1"].bytes_sent > x.numel() * 4


async def test_closed_client_fails_calls(tmp_path: Path) -> None:
    client = make_client(tmp_path)
    with pytest.raises(ClosedError):
        await client.stub().add(1)
    async with client, FakeEngine(client.addresses[0], "e1") as e1:
        await e1.join()
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                with pytest.raises(ClosedError):
                    await client.stub().sleep(10.0)

            tg.start_soon(call)
            await e1.next(CALL)
            await client.aclose()
        bye = await e1.next(MessageKind.BYE)
        assert bye.kind is MessageKind.BYE
    with pytest.raises(ClosedError):
        await client.stub().add(1)


async def test_client_dials_listening_engine_and_sees_its_restart(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    async with (
        Client(Calculator, connect=address, heartbeat_interval=0.05, dead_after=5.0) as client,
        FakeEngine(address, "l1", listen=True, pid=100) as engine,
    ):
        assert isinstance(await engine.join(), Welcome)
        assert client.engines["l1"].address == address
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                with pytest.raises(EngineDeadError, match="replaced"):
                    await client.stub().sleep(30.0)

            tg.start_soon(call)
            await engine.next(CALL)
            # the same address now answers with another process (a quick restart)
            engine.hello_fields["pid"] = 101
            engine.hello_fields["epoch"] += 1  # a new process: a new session
            assert isinstance(await engine.join(), Welcome)
        assert client.engines["l1"].pid == 101
        assert await await_call(client, engine, "z") == "Z"


async def test_open_and_close_at_once(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client:
        assert client.addresses
    assert client.statistics().calls_in_flight == 0
    await client.aclose()


async def test_address_in_use_is_a_connect_error() -> None:
    async with Client(Calculator, bind="tcp://127.0.0.1:0") as first:
        second = Client(Calculator, bind=first.addresses[0])
        with pytest.raises(ConnectError):
            await second.__aenter__()
        with pytest.raises(ClosedError):
            await second.stub().add(1)


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="timeout"):
        CallOptions(timeout=0)
    with pytest.raises(ValueError, match="transport"):
        CallOptions(transport="carrier-pigeon")  # type: ignore[arg-type]
