"""The schemaless client (``Client.dynamic``): calls by name, learned from the engine's HELLO."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch

import tensorrpc
from tensorrpc import Client, Server, serve
from tensorrpc.testing import EnginesFactory

from .services import Calculator, CalculatorV2

WAIT = 20.0


@asynccontextmanager
async def engine(instance: object, address: str, engine_id: str) -> AsyncIterator[Server]:
    async with anyio.create_task_group() as tg:
        server: Server = await tg.start(
            lambda task_status: serve(
                instance, bind=address, engine_id=engine_id, task_status=task_status
            )
        )
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()


def ipc(tmp_path: Path, name: str) -> str:
    return f"ipc://{tmp_path}/{name}.sock"


async def test_hello_announces_signatures_and_streaming_methods(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with (
        engine(Calculator("e1"), ipc(tmp_path, "e1"), "e1") as server,
        Client.dynamic(connect=server.endpoint) as client,
    ):
        assert client.schemaless
        with anyio.fail_after(WAIT):
            info = (await client.wait_for_engines(1))["e1"]
        assert info.service == "Calculator"
        assert info.fingerprint == tensorrpc.describe(Calculator).fingerprint
        assert set(info.streaming) == {"count", "forever"}
        assert info.signatures[info.methods.index("add")] == "add(a: int, b: int = 1) -> int"
        assert len(info.signatures) == len(info.methods)


async def test_call_by_name_sends_a_map_and_returns_the_decoded_value(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with (
        engine(Calculator("e1"), ipc(tmp_path, "e1"), "e1") as server,
        Client.dynamic(connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            assert await client.call_by_name("add", {"a": 2, "b": 40}) == 42
            assert await client.call_by_name("add", {"a": 2}) == 3  # default filled
            assert await client.call_by_name("mul", {"b": 3, "a": 5}) == 15  # sync handler
            scaled = await client.call_by_name("scale", {"x": torch.ones(300), "factor": 2})
            assert isinstance(scaled, torch.Tensor)
            assert torch.equal(scaled, torch.full((300,), 2.0))
            items = [i async for i in client.stream_by_name("count", {"n": 4})]
            assert items == [0, 1, 2, 3]


async def test_unknown_method_fails_fast_listing_the_offered_ones(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with (
        engine(Calculator("e1"), ipc(tmp_path, "e1"), "e1") as server,
        Client.dynamic(connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            with pytest.raises(tensorrpc.MethodNotFoundError, match=r"'nope'.*offers: .*add"):
                await client.call_by_name("nope", {})
            assert client.statistics().engines["e1"].calls == 0  # nothing was sent


async def test_engine_validates_map_arguments(anyio_backend: str, tmp_path: Path) -> None:
    async with (
        engine(Calculator("e1"), ipc(tmp_path, "e1"), "e1") as server,
        Client.dynamic(connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            with pytest.raises(tensorrpc.InvalidArgumentError, match="unexpected argument 'c'"):
                await client.call_by_name("add", {"a": 1, "c": 2})
            with pytest.raises(tensorrpc.InvalidArgumentError, match="missing required"):
                await client.call_by_name("mul", {"a": 1})
            with pytest.raises(tensorrpc.InvalidArgumentError, match=r"req\.a: expected int"):
                await client.call_by_name("add", {"a": "x"})


async def test_streaming_mismatch_is_refused_before_sending(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with (
        engine(Calculator("e1"), ipc(tmp_path, "e1"), "e1") as server,
        Client.dynamic(connect=server.endpoint) as client,
    ):
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            with pytest.raises(TypeError, match="stream_by_name"):
                await client.call_by_name("count", {"n": 1})
            with pytest.raises(TypeError, match="call_by_name"):
                client.stream_by_name("add", {"a": 1})


async def test_admits_engines_of_any_service_and_targets_them(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with (
        engine(Calculator("v1"), ipc(tmp_path, "v1"), "v1") as first,
        engine(CalculatorV2(), ipc(tmp_path, "v2"), "v2") as second,
        Client.dynamic(connect=[first.endpoint or "", second.endpoint or ""]) as client,
    ):
        with anyio.fail_after(WAIT):
            engines = await client.wait_for_engines(2)
            assert engines["v1"].fingerprint != engines["v2"].fingerprint
            v2 = client.with_options(engine="v2")
            assert await v2.call_by_name("add", {"a": 1, "b": 2, "c": 3}) == 6
            v1 = client.with_options(engine="v1")
            assert await v1.call_by_name("whoami") == "v1"
            with pytest.raises(tensorrpc.MethodNotFoundError, match=r"offers: add$"):
                await v2.call_by_name("whoami")


async def test_typed_client_calls_by_name_with_its_schema(
    tensorrpc_engines: EnginesFactory,
) -> None:
    # tensorrpc.testing's fixture: an engine in this process, a typed client connected.
    client = await tensorrpc_engines(Calculator, start_timeout=WAIT)
    assert not client.schemaless
    with anyio.fail_after(WAIT):
        assert await client.call_by_name("add", {"a": 1}) == 2
        assert [i async for i in client.stream_by_name("count", {"n": 2})] == [0, 1]
        with pytest.raises(tensorrpc.ValidationError, match="unexpected keyword"):
            await client.call_by_name("add", {"z": 1})
        with pytest.raises(tensorrpc.MethodNotFoundError, match="has no method 'nope'"):
            await client.call_by_name("nope")


async def test_schemaless_client_has_no_typed_calls(anyio_backend: str, tmp_path: Path) -> None:
    async with Client.dynamic(bind=ipc(tmp_path, "c")) as client:
        with pytest.raises(TypeError, match="not an rpc method"):
            await client.call(Calculator.add, 1, 2)
        with pytest.raises(tensorrpc.EngineNotFoundError):
            await client.call_by_name("add", {"a": 1})
