"""Batched methods in statistics(), the statistics method, Prometheus, top and traces."""

from __future__ import annotations

from pathlib import Path

import anyio
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest

from tensorrpc import Batching, Client, Continuous, Server, rpc, service
from tensorrpc._observe import STATISTICS_METHOD
from tensorrpc.metrics import PrometheusObserver
from tensorrpc.top import EngineView, check_statistics, table
from tensorrpc.tracing import TracingObserver

from .test_tracing import _Ended, spans  # noqa: F401 - the fixture

N = 12


@service
class Embed:
    @rpc(batch=Batching(max_size=4, max_delay=0.05))
    async def embed(self, x: list[int]) -> list[int]:
        await anyio.sleep(0.001)
        return [v * 2 for v in x]

    @rpc(batch=Continuous(max_size=4))
    async def gen(self, n: list[int]) -> list[int]:
        return list(n)


async def _calls(client: Client[Embed]) -> None:
    async with anyio.create_task_group() as tg:
        for i in range(N):
            tg.start_soon(client.stub().embed, i)


async def test_statistics_and_the_statistics_method_hold_the_histograms(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Embed(), bind=address, engine_id="e1") as server,
        Client(Embed, connect=address) as client,
        Client.dynamic(connect=address) as tool,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            await tool.wait_for_engines(1)
            first = check_statistics(await tool.call_by_name(STATISTICS_METHOD))
            await _calls(client)
            body = check_statistics(await tool.call_by_name(STATISTICS_METHOD))
            stats = server.statistics().batching["embed"]
    assert stats["items"] == N
    assert stats["queued"] == 0
    assert stats["running"] == 0
    assert sum(k * n for k, n in stats["sizes"]) == N
    assert all(k <= 4 for k, _ in stats["sizes"])
    assert stats["batches"] == sum(n for _, n in stats["sizes"]) >= 3
    assert sum(n for _, n in stats["queue_wait"]) == N
    assert sum(n for _, n in stats["run_time"]) == stats["batches"]
    assert stats["run_time_sum_s"] > 0
    assert body["batching"]["embed"]["items"] == N
    assert body["batching"]["gen"]["items"] == 0
    view = EngineView("e1")
    view.update(first)
    view.update(body)
    assert view.batch_size == N / stats["batches"]
    assert view.batch_wait is not None
    assert view.batch_wait < 1.0
    assert "batch" in [c.header for c in table([view], "t").columns]


async def test_prometheus_exports_batch_histograms(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Embed(), bind=address, engine_id="pe1", observer=PrometheusObserver(registry)),
        Client(Embed, connect=address) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            await _calls(client)
            text = generate_latest(registry).decode()
    assert f'tensorrpc_engine_batch_size_sum{{engine="pe1",method="embed"}} {float(N)}' in text
    assert 'tensorrpc_engine_batch_size_bucket{engine="pe1",le="4.0",method="embed"}' in text
    count = (
        f'tensorrpc_engine_batch_queue_wait_seconds_count{{engine="pe1",method="embed"}} {float(N)}'
    )
    assert count in text
    assert 'tensorrpc_engine_batch_run_seconds_count{engine="pe1",method="embed"}' in text
    assert 'tensorrpc_engine_batch_queued{engine="pe1",method="embed"} 0.0' in text


async def test_a_batch_span_links_every_item_call(
    tmp_path: Path,
    spans: tuple[TracerProvider, _Ended],  # noqa: F811
) -> None:
    provider, ended = spans
    observer = TracingObserver(provider)
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Embed(), bind=address, engine_id="te1", observer=observer),
        Client(Embed, connect=address, observer=observer) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            await _calls(client)
            await ended.wait_for(1)
    finished = ended.exporter.get_finished_spans()
    batches = [s for s in finished if s.name == "Embed/embed batch"]
    items = [s for s in finished if s.name == "Embed/embed" and s.kind.name == "SERVER"]
    assert len(items) == N
    sizes = [s.attributes["tensorrpc.batch_size"] for s in batches if s.attributes]
    assert sum(v for v in sizes if isinstance(v, int)) == N
    linked = {link.context.span_id for s in batches for link in s.links}
    assert linked == {s.context.span_id for s in items}
