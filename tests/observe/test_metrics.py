"""Prometheus metrics: scraped over HTTP and parsed, on both backends."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tensorrpc._client import Client
from tensorrpc._exceptions import RemoteError
from tensorrpc._observe import Observer
from tensorrpc._server import Server
from tensorrpc.metrics import PrometheusObserver, bound_port, exporter

from ..integration.services import Calculator


def _fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_engine_metrics_over_http_and_client_metrics_on_a_registry(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    client_metrics = PrometheusObserver(registry)
    address = f"ipc://{tmp_path}/e.sock"
    # the engine exports on the global registry, shared by every test in this process
    eid = f"e-{tmp_path.name}"
    async with Server(Calculator(eid), bind=address, engine_id=eid, observer=exporter(0)) as server:
        port = bound_port(server)
        assert port is not None
        async with Client(
            Calculator, connect=address, observer=client_metrics, heartbeat_interval=0.05
        ) as client:
            stub = client.stub()
            with anyio.fail_after(20):
                await client.wait_for_engines(1)
                for i in range(3):
                    assert await stub.add(i) == i + 1
                with pytest.raises(RemoteError):
                    await stub.fail("no")
                assert [i async for i in stub.count(4)] == [0, 1, 2, 3]
                x = torch.arange(1024, dtype=torch.float32)
                assert torch.equal(await stub.scale(x, 2.0), x * 2)
                # A stream the engine keeps running while it is scraped: one call in flight.
                async with client.stream(Calculator.forever, f"m-{eid}") as stream:
                    assert await stream.__anext__() == 0
                    engine_text = await anyio.to_thread.run_sync(_fetch, port)
                    client_text = generate_latest(registry).decode()
    assert bound_port(server) is None  # the exporter stopped with the engine
    c = _samples(client_text)
    assert _value(c, "tensorrpc_client_calls_started_total", method="add", engine=eid) == 3
    assert _value(c, "tensorrpc_client_calls_total", method="add", engine=eid, outcome="ok") == 3
    assert (
        _value(c, "tensorrpc_client_calls_total", method="fail", engine=eid, outcome="REMOTE") == 1
    )
    assert _value(c, "tensorrpc_client_call_duration_seconds_count", method="add", engine=eid) == 3
    assert _value(c, "tensorrpc_client_call_duration_seconds_sum", method="add", engine=eid) > 0
    assert (
        _value(
            c, "tensorrpc_client_call_duration_seconds_bucket", method="add", engine=eid, le="+Inf"
        )
        == 3
    )
    assert _value(c, "tensorrpc_client_stream_items_total", method="count", engine=eid) == 4
    assert _value(c, "tensorrpc_client_engine_events_total", engine=eid, event="joined") == 1
    assert _value(c, "tensorrpc_client_engine_up", engine=eid) == 1
    assert _value(c, "tensorrpc_client_engines", state="live") == 1
    assert _value(c, "tensorrpc_client_calls_in_flight", engine=eid) == 1
    assert _value(c, "tensorrpc_client_bytes_total", engine=eid, direction="sent") > 4096
    assert _value(c, "tensorrpc_client_tensors_total", transport="frames", direction="sent") == 1
    assert (
        _value(c, "tensorrpc_client_tensor_bytes_total", transport="frames", direction="received")
        == 4096
    )
    assert (
        "tensorrpc_client_transport_fallbacks_total",
        frozenset({("transport", "torch_shm")}),
    ) in c
    # no label but method, engine and the fixed small sets
    allowed = {"method", "engine", "outcome", "transport", "direction", "event", "state", "le"}
    assert all(dict(labels).keys() <= allowed for _, labels in c)
    e = _samples(engine_text)
    assert _value(e, "tensorrpc_engine_calls_started_total", method="add", engine=eid) == 3
    assert _value(e, "tensorrpc_engine_calls_total", method="add", engine=eid, outcome="ok") == 3
    assert (
        _value(e, "tensorrpc_engine_calls_total", method="fail", engine=eid, outcome="REMOTE") == 1
    )
    assert _value(e, "tensorrpc_engine_queue_wait_seconds_count", method="add", engine=eid) == 3
    assert _value(e, "tensorrpc_engine_handler_seconds_count", method="count", engine=eid) == 1
    assert _value(e, "tensorrpc_engine_stream_items_total", method="count", engine=eid) == 4
    assert _value(e, "tensorrpc_engine_calls_in_flight", engine=eid) == 1
    assert _value(e, "tensorrpc_engine_clients", engine=eid) == 1
    assert _value(e, "tensorrpc_engine_bytes_total", engine=eid, direction="received") > 4096
    assert (
        _value(e, "tensorrpc_engine_tensors_total", transport="frames", direction="received") == 1
    )


class _Signal(Observer):
    """Sets an event on each heartbeat and engine event, to wait on without polling."""

    __slots__ = ("events", "woken")

    def __init__(self) -> None:
        self.events: list[str] = []
        self.woken: anyio.Event | None = None

    def _wake(self, what: str) -> None:
        self.events.append(what)
        if self.woken is not None:
            self.woken.set()

    def heartbeat(self, client: str, engine: str, rtt: float) -> None:
        self._wake("heartbeat")

    def engine_event(self, client: str, engine: str, event: str) -> None:
        self._wake(event)

    async def wait_for(self, what: str) -> None:
        while what not in self.events:
            self.woken = anyio.Event()
            await self.woken.wait()


async def test_heartbeat_round_trips_and_lost_engines_are_counted(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = PrometheusObserver(registry, buckets=[0.5, 0.1])
    signal = _Signal()
    address = f"ipc://{tmp_path}/e.sock"
    server = Server(Calculator("e1"), bind=address, engine_id="e1")
    async with (
        server,
        Client(
            Calculator, connect=address, observer=[metrics, signal], heartbeat_interval=0.02
        ) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            assert await client.stub().add(1) == 2
            await signal.wait_for("heartbeat")
            await server.aclose()
            await signal.wait_for("lost")
            s = _samples(generate_latest(registry).decode())
    # a closed client is no longer read
    assert "tensorrpc_client_engine_up" not in {
        n for n, _ in _samples(generate_latest(registry).decode())
    }
    assert _value(s, "tensorrpc_client_heartbeat_rtt_seconds_count", engine="e1") >= 1
    assert _value(s, "tensorrpc_client_engine_events_total", engine="e1", event="lost") == 1
    assert _value(s, "tensorrpc_client_engine_up", engine="e1") == 0
    assert _value(s, "tensorrpc_client_engines", state="dead") == 1
    # latency buckets are sorted whatever order they were given in
    buckets = [
        dict(labels)["le"]
        for name, labels in s
        if name == "tensorrpc_client_call_duration_seconds_bucket"
    ]
    assert sorted(buckets) == ["+Inf", "0.1", "0.5"]


def test_one_observer_per_registry() -> None:
    registry = CollectorRegistry()
    PrometheusObserver(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusObserver(registry)


async def test_a_client_exporter_serves_the_default_registry(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/e.sock"
    eid = f"c-{tmp_path.name}"
    async with (
        Server(Calculator(eid), bind=address, engine_id=eid),
        Client(Calculator, connect=address, observer=exporter(0)) as client,
    ):
        port = bound_port(client)
        assert port is not None
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            assert await client.stub().add(1) == 2
            text = await anyio.to_thread.run_sync(_fetch, port)
    assert bound_port(client) is None
    s = _samples(text)
    assert _value(s, "tensorrpc_client_calls_total", method="add", engine=eid, outcome="ok") == 1
    with pytest.raises(ValueError, match="metrics port"):
        exporter(70000)


async def test_each_side_exports_only_its_own_families(tmp_path: Path) -> None:
    # Issue 24 item 4: an engine's /metrics had tensorrpc_client_engines{state="live"} 0.
    engine_registry, client_registry = CollectorRegistry(), CollectorRegistry()
    engine_metrics = PrometheusObserver(engine_registry)
    client_metrics = PrometheusObserver(client_registry)
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Calculator("e"), bind=address, engine_id="e", observer=engine_metrics),
        Client(Calculator, connect=address, observer=client_metrics) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            assert await client.stub().add(1) == 2
        engine_text = generate_latest(engine_registry).decode()
        client_text = generate_latest(client_registry).decode()
    assert "tensorrpc_engine_calls_total" in engine_text
    assert "tensorrpc_client_" not in engine_text
    assert "tensorrpc_client_engines" in client_text
    assert "tensorrpc_engine_" not in client_text


async def test_a_metrics_port_in_use_names_the_port(tmp_path: Path) -> None:
    import socket

    from tensorrpc._exceptions import ConnectError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        address = f"ipc://{tmp_path}/e.sock"
        with pytest.raises(ConnectError, match=f"metrics port {port}: .*own metrics port"):
            async with Server(Calculator("e"), bind=address, observer=exporter(port)):
                pass
        # Nothing was bound: the address is free for the next engine.
        async with Server(Calculator("e"), bind=address) as server:
            assert server.endpoint == address
