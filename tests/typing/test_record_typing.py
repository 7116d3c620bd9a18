"""Static checks (mypy) of stubs whose methods take and return the record types.

``NamedTuple``, ``TypedDict``, msgspec ``Struct``, pydantic models and ``dict[int, T]``
keep their own types through ``client.stub()`` and ``client.call`` (tensorrpc.mypy_plugin):
``assert_type`` proves the result types, and each ``type: ignore`` (strict mode flags an
unused one) proves that mypy rejects a wrong argument. Nothing is sent: the functions are
only type-checked; the one test builds the service.
"""

from __future__ import annotations

from typing import NamedTuple, NotRequired, assert_type

import msgspec
import pydantic
from typing_extensions import TypedDict

from tensorrpc import describe
from tensorrpc._client import Client
from tensorrpc._service import rpc, service


class Span(NamedTuple):
    start: int
    end: int


class Options(TypedDict):
    temperature: float
    stop: NotRequired[list[str]]


class Request(msgspec.Struct):
    text: str
    spans: list[Span]


class Reply(pydantic.BaseModel):
    text: str
    bias: dict[int, float]


@service
class Tagger:
    @rpc
    async def tag(self, request: Request, options: Options, bias: dict[int, float]) -> Reply:
        return Reply(text=request.text, bias=bias)

    @rpc
    async def first(self, spans: list[Span]) -> Span:
        return spans[0]


async def typed_calls(client: Client[Tagger]) -> None:
    """Never run: only type-checked."""
    tagger = client.stub()
    request = Request("t", [Span(0, 1)])
    assert_type(await tagger.tag(request, {"temperature": 1.0}, {1: 0.5}), Reply)
    assert_type(await client.call(Tagger.tag, request, {"temperature": 1.0}, {}), Reply)
    assert_type(await tagger.first([Span(0, 1)]), Span)
    await tagger.tag(request, {"temperature": "hot"}, {})  # type: ignore[typeddict-item]
    await tagger.tag(request, {"temperature": 1.0, "top": 1}, {})  # type: ignore[typeddict-unknown-key]
    await tagger.tag(request, {"temperature": 1.0}, {"a": 1.0})  # type: ignore[dict-item]
    await tagger.first([(0, 1)])  # type: ignore[list-item]
    await tagger.tag({"text": "t"}, {"temperature": 1.0}, {})  # type: ignore[arg-type]


def test_the_service_builds() -> None:
    assert set(describe(Tagger).methods) == {"tag", "first"}
