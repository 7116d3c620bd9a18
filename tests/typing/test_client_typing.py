"""Static checks (mypy) of the client's typing: stubs typed as the service, exact `call`.

mypy verifies the ``assert_type`` calls and the ``type: ignore`` codes (strict mode flags an
unused ignore, so each one proves that mypy still rejects a wrong call). At run time the
checks only build the objects; nothing is sent (the clients are never opened).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, assert_type

import pytest
import torch

from tensorrpc import BlockingClient, BlockingStream
from tensorrpc._batching import Batching, Continuous
from tensorrpc._client import CallStream, CallView, Client, ClientStatistics, EngineInfo
from tensorrpc._exceptions import ClosedError
from tensorrpc._service import rpc, service
from tensorrpc._stub import Stub


@service
class Calc:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    @rpc
    async def upload(self, chunks: AsyncIterator[bytes]) -> int:
        return len([c async for c in chunks])

    @rpc
    async def chat(self, msgs: AsyncIterator[str]) -> AsyncIterator[int]:
        async for m in msgs:
            yield len(m)


async def _lines() -> AsyncIterator[str]:
    yield "a"


async def request_streams(client: Client[Calc], blocking: BlockingClient[Calc]) -> None:
    """Never run: client streaming and bidirectional methods, typed by the plugin."""
    calc = client.stub()
    assert_type(await calc.upload([b"a", b"b"]), int)  # a plain iterable, or an async one
    assert_type(await calc.upload(_bytes()), int)
    assert_type(calc.chat(_lines()), CallStream[int])
    assert_type(calc.chat(["x"]), CallStream[int])
    assert_type(await client.call(Calc.upload, [b"a"]), int)
    assert_type(client.stream(Calc.chat, _lines()), CallStream[int])
    assert_type(blocking.stub().upload([b"a"]), int)
    assert_type(blocking.stub().chat(["x"]), BlockingStream[int])
    assert_type(blocking.call(Calc.upload, iter([b"a"])), int)
    await calc.upload(["not bytes"])  # type: ignore[list-item]
    await calc.upload([b"a"], [b"b"])  # type: ignore[call-arg]
    calc.chat(_bytes())  # type: ignore[arg-type]


async def _bytes() -> AsyncIterator[bytes]:
    yield b"a"


async def typed_calls(client: Client[Calc]) -> None:
    """Never run: only type-checked."""
    calc = client.stub()
    assert_type(calc, Stub[Calc])
    assert_type(client.with_options(engine="e1", timeout=0.5).stub(), Stub[Calc])
    # The stub's methods (typed by tensorrpc.mypy_plugin): every unary call is awaited,
    # sync handlers included; a streaming method gives a CallStream.
    assert_type(await assert_type(calc.add(1, 2), Coroutine[Any, Any, int]), int)
    assert_type(await calc.add(1, 2), int)
    assert_type(await calc.add(1, b=2), int)
    assert_type(await calc.scale(torch.ones(2), 2.0), torch.Tensor)
    assert_type(calc.count(3), CallStream[int])
    async for i in calc.count(3):
        assert_type(i, int)
    assert_type(await client.call(Calc.add, 1), int)
    assert_type(await client.call(Calc.add, 1, b=2), int)
    assert_type(await client.call(Calc.scale, torch.ones(2), 2.0), torch.Tensor)
    assert_type(client.stream(Calc.count, 5), CallStream[int])
    async for item in client.stream(Calc.count, 5):
        assert_type(item, int)
    view = client.with_options(engine="e1", timeout=1.0, wait=False)
    assert_type(view, CallView[Calc])
    assert_type(await view.call(Calc.add, 1, 2), int)
    md_view = client.with_options(metadata={"authorization": "Bearer t"})
    assert_type(await md_view.call_with_metadata(Calc.add, 1), tuple[int, Mapping[str, str]])
    assert_type(
        await client.call_with_metadata(Calc.scale, torch.ones(2), 2.0),
        tuple[torch.Tensor, Mapping[str, str]],
    )
    await client.call_with_metadata(Calc.add, "x")  # type: ignore[call-overload]
    client.with_options(metadata={"k": 1}).stub()  # type: ignore[dict-item]
    assert_type(await client.broadcast("add", 1, 2), dict[str, Any])
    assert_type(client.engines["e1"], EngineInfo)
    assert_type(client.statistics(), ClientStatistics)
    await client.call(Calc.add, "x")  # type: ignore[arg-type]
    await client.call(Calc.add, 1, c=3)  # type: ignore[call-arg]
    client.stream(Calc.add, 1)  # type: ignore[arg-type]
    client.with_options(transport="pigeon").stub()  # type: ignore[arg-type]


async def streaming_method_through_call_is_an_error(client: Client[Calc]) -> None:
    """Never run: `call` on a streaming method raises TypeError; mypy says to stream it."""
    await client.call(Calc.count, 3)  # type: ignore[misc]


def test_client_is_generic_in_the_service() -> None:
    client = Client(Calc, bind="ipc:///nonexistent/never-bound.sock")
    assert_type(client, Client[Calc])
    assert client.service.name == "Calc"


async def test_unopened_client_refuses_calls(anyio_backend: str) -> None:
    client = Client(Calc, connect="tcp://127.0.0.1:1")
    with pytest.raises(ClosedError):
        await client.call(Calc.add, 1)
    with pytest.raises(TypeError, match="streaming"):
        await client.call(Calc.count, 1)  # type: ignore[misc]
    with pytest.raises(TypeError, match="not a streaming"):
        client.stream(Calc.add, 1)  # type: ignore[arg-type]


@service
class Batched:
    @rpc(batch=Batching(max_size=8, max_delay=0.001))
    async def embed(self, text: list[str], scale: list[float]) -> list[torch.Tensor]:
        return [torch.ones(2) * s for s in scale]

    @rpc(batch=Batching(max_size=8))
    def tag(self, x: list[int]) -> list[str]:
        return [str(v) for v in x]

    @rpc(batch=Continuous(max_size=8))
    async def generate(self, prompt: list[str]) -> list[int]:
        return [len(p) for p in prompt]


async def batched_calls(client: Client[Batched]) -> None:
    """Never run: callers see one item of a batched method (typed by the plugin)."""
    stub = client.stub()
    assert_type(await stub.embed("a", 1.0), torch.Tensor)
    assert_type(await stub.tag(3), str)
    assert_type(stub.generate("hi"), CallStream[int])
    assert_type(await client.call(Batched.embed, "a", 2.0), torch.Tensor)
    assert_type(await client.call(Batched.tag, 1), str)
    assert_type(client.stream(Batched.generate, "hi"), CallStream[int])
    await stub.embed(["a"], [1.0])  # type: ignore[arg-type]
    await client.call(Batched.tag, [1])  # type: ignore[arg-type]


def batched_blocking(client: BlockingClient[Batched]) -> None:
    """Never run: the blocking stub sees one item too."""
    stub = client.stub()
    assert_type(stub.embed("a", 1.0), torch.Tensor)
    assert_type(stub.tag(3), str)
    assert_type(stub.generate("hi"), BlockingStream[int])
