"""OpenTelemetry: one trace spans client -> engine A -> nested call -> engine B."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tensorrpc._client import Client
from tensorrpc._exceptions import RemoteError
from tensorrpc._server import Server
from tensorrpc._service import rpc, service
from tensorrpc.tracing import (
    TracingObserver,
    decode_trace_context,
    encode_trace_context,
)

from ..integration.services import Calculator


@service
class Relay:
    """Forwards to a Calculator engine through its own client (set after start)."""

    def __init__(self) -> None:
        self.calc: Client[Calculator] | None = None

    @rpc
    async def relay(self, x: torch.Tensor, n: int) -> int:
        assert self.calc is not None
        return await self.calc.stub().add(int(x.sum()), n)

    @rpc
    async def relay_fail(self) -> int:
        assert self.calc is not None
        return await self.calc.stub().fail("deep")


class _Ended(SpanProcessor):
    """Wakes a waiter whenever a span ends (spans end on the event loop's thread)."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter
        self.changed: anyio.Event | None = None

    def on_end(self, span: ReadableSpan) -> None:
        if self.changed is not None:
            self.changed.set()

    async def wait_for(self, count: int) -> None:
        while len(self.exporter.get_finished_spans()) < count:
            self.changed = anyio.Event()
            await self.changed.wait()


@pytest.fixture
def spans() -> tuple[TracerProvider, _Ended]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ended = _Ended(exporter)
    provider.add_span_processor(ended)
    return provider, ended


async def test_one_trace_spans_client_engine_and_a_nested_call(
    tmp_path: Path, spans: tuple[TracerProvider, _Ended]
) -> None:
    provider, ended = spans
    exporter = ended.exporter
    tracing = TracingObserver(provider)
    relay = Relay()
    a, b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    async with (
        Server(Calculator("b"), bind=b, engine_id="b", observer=tracing),
        Server(relay, bind=a, engine_id="a", observer=tracing),
        Client(Calculator, connect=b, observer=tracing) as inner,
        Client(Relay, connect=a, observer=tracing) as outer,
    ):
        relay.calc = inner
        with anyio.fail_after(20):
            await inner.wait_for_engines(1)
            await outer.wait_for_engines(1)
            tracer = provider.get_tracer("test")
            x = torch.ones(1000)
            with tracer.start_as_current_span("request") as root:
                assert await outer.stub().relay(x, 5) == 1005
            with tracer.start_as_current_span("failing"), pytest.raises(RemoteError):
                await outer.stub().relay_fail()
            # the engines end their spans when their workers let go of the calls
            await ended.wait_for(10)
    finished = exporter.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    ours = [s for s in finished if s.context is not None and s.context.trace_id == trace_id]
    by_name: dict[tuple[str, SpanKind], ReadableSpan] = {(s.name, s.kind): s for s in ours}
    assert set(by_name) == {
        ("request", SpanKind.INTERNAL),
        ("Relay/relay", SpanKind.CLIENT),
        ("Relay/relay", SpanKind.SERVER),
        ("Calculator/add", SpanKind.CLIENT),
        ("Calculator/add", SpanKind.SERVER),
    }

    def parent_of(span: ReadableSpan) -> int | None:
        return None if span.parent is None else int(span.parent.span_id)

    def id_of(key: tuple[str, SpanKind]) -> int:
        context = by_name[key].context
        assert context is not None
        return int(context.span_id)

    assert parent_of(by_name["Relay/relay", SpanKind.CLIENT]) == id_of(
        ("request", SpanKind.INTERNAL)
    )
    assert parent_of(by_name["Relay/relay", SpanKind.SERVER]) == id_of(
        ("Relay/relay", SpanKind.CLIENT)
    )
    assert parent_of(by_name["Calculator/add", SpanKind.CLIENT]) == id_of(
        ("Relay/relay", SpanKind.SERVER)
    )
    assert parent_of(by_name["Calculator/add", SpanKind.SERVER]) == id_of(
        ("Calculator/add", SpanKind.CLIENT)
    )
    client = by_name["Relay/relay", SpanKind.CLIENT].attributes
    assert client is not None
    assert client["rpc.system"] == "tensorrpc"
    assert client["rpc.service"] == "Relay"
    assert client["rpc.method"] == "relay"
    assert client["tensorrpc.engine_id"] == "a"
    assert client["tensorrpc.transport"] == "frames"
    assert int(str(client["tensorrpc.request_bytes"])) >= 4000
    assert int(str(client["tensorrpc.response_bytes"])) > 0
    assert client["tensorrpc.outcome"] == "ok"
    server = by_name["Calculator/add", SpanKind.SERVER]
    assert server.attributes is not None
    assert server.attributes["tensorrpc.engine_id"] == "b"
    assert server.attributes["tensorrpc.outcome"] == "ok"
    assert [e.name for e in server.events] == ["handler.start"]
    assert by_name["Calculator/add", SpanKind.CLIENT].attributes["tensorrpc.transport"] == "inline"  # type: ignore[index]
    # the failing request: every span on the way back is an error
    failing = [s for s in finished if s.name in ("Relay/relay_fail", "Calculator/fail")]
    assert len(failing) == 4
    assert all(s.status.status_code is StatusCode.ERROR for s in failing)
    outcomes = {(s.name, s.kind): s.attributes["tensorrpc.outcome"] for s in failing}  # type: ignore[index]
    assert outcomes == {
        ("Relay/relay_fail", SpanKind.CLIENT): "REMOTE",
        ("Relay/relay_fail", SpanKind.SERVER): "REMOTE",
        ("Calculator/fail", SpanKind.CLIENT): "REMOTE",
        ("Calculator/fail", SpanKind.SERVER): "REMOTE",
    }


async def test_without_an_sdk_or_a_trace_nothing_is_made(tmp_path: Path) -> None:
    tracing = TracingObserver()  # the global provider: no SDK is configured in the tests
    assert tracing.client_call("S", "m", "e", False, 1, "inline") is None
    assert tracing.engine_call("S", "m", "e", "c", False, b"", 1) is None
    # an incoming context is not continued either: without an SDK nothing is recorded
    incoming = b"\x00" + bytes(range(1, 26))
    assert tracing.engine_call("S", "m", "e", "c", False, incoming, 1) is None
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Calculator("e"), bind=address, engine_id="e", observer=tracing),
        Client(Calculator, connect=address, observer=tracing) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            assert await client.stub().add(1) == 2


def test_trace_context_bytes_round_trip() -> None:
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("s") as span:
        context = span.get_span_context()
    data = encode_trace_context(context)
    assert len(data) == 26
    decoded = decode_trace_context(data)
    assert decoded is not None
    assert (decoded.trace_id, decoded.span_id, decoded.trace_flags) == (
        context.trace_id,
        context.span_id,
        context.trace_flags,
    )
    assert decoded.is_remote
    assert decode_trace_context(b"\x01" + data[1:]) is None
    assert decode_trace_context(bytes(26)) is None  # all-zero ids are invalid


def test_instrument_installs_one_observer_for_peers_made_afterwards() -> None:
    from tensorrpc import _observe
    from tensorrpc.tracing import instrument, uninstrument

    provider = TracerProvider()
    first = instrument(provider)
    try:
        assert instrument() is first
        assert first in _observe.installed()
        assert _observe.resolve(None) is first
    finally:
        uninstrument()
    assert first not in _observe.installed()
