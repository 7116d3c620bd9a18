"""The engine's built-in statistics method (what ``tensorrpc top`` reads)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tensorrpc import _observe
from tensorrpc._client import Client
from tensorrpc._exceptions import MethodNotFoundError
from tensorrpc._security import CurveClientConfig, CurveServerConfig, generate_keypair
from tensorrpc._server import Server

from ..integration.services import Calculator

STATS = _observe.STATISTICS_METHOD


async def test_an_engine_answers_its_statistics_and_counts_methods_from_then_on(
    tmp_path: Path,
) -> None:
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Calculator("e1"), bind=address, engine_id="e1"),
        Client(Calculator, connect=address) as typed,
        Client.dynamic(connect=address) as tool,
    ):
        with anyio.fail_after(10):
            await typed.wait_for_engines(1)
            await tool.wait_for_engines(1)
            assert await typed.stub().add(1) == 2  # before anyone watched: not recorded
            first = await tool.call_by_name(STATS)
            for i in range(5):
                assert await typed.stub().add(i) == i + 1
            with pytest.raises(Exception, match="boom"):
                await typed.stub().fail("boom")
            second = await tool.call_by_name(STATS, {})
    assert first["engine_id"] == "e1"
    assert first["service"] == "Calculator"
    assert first["calls"] == 1
    assert first["methods"] == {}
    assert first["clients"] == 2
    assert set(first["transports"]) == {"frames", "torch_shm"}
    assert first["transports"]["torch_shm"]["releases_refused"] == 0  # §10's map, as §4 says
    assert second["calls"] == 7
    assert second["errors"] == 1
    assert second["bytes_in"] > first["bytes_in"]
    add = second["methods"]["add"]
    assert add["calls"] == 5
    assert add["errors"] == 0
    assert sum(n for _, n in add["latency"]) == 5
    assert second["methods"]["fail"]["errors"] == 1
    assert second["latency_buckets_per_octave"] == _observe.LATENCY_BUCKETS_PER_OCTAVE
    assert second["uptime_s"] >= first["uptime_s"]


async def test_a_curve_engine_that_accepts_any_key_refuses_statistics(tmp_path: Path) -> None:
    engine_keys, client_keys = generate_keypair(), generate_keypair()
    open_curve = CurveServerConfig(engine_keys, allowed_clients=None)
    closed_curve = CurveServerConfig(engine_keys, allowed_clients=[client_keys.public_key])
    client_curve = CurveClientConfig(client_keys, engine_keys.public_key)
    for curve, allowed in ((open_curve, False), (closed_curve, True)):
        async with (
            Server(
                Calculator("e1"), bind="tcp://127.0.0.1:0", engine_id="e1", curve=curve
            ) as server,
            Client.dynamic(connect=server.endpoint, curve=client_curve) as tool,
        ):
            with anyio.fail_after(10):
                await tool.wait_for_engines(1)
                if allowed:
                    assert (await tool.call_by_name(STATS))["engine_id"] == "e1"
                else:
                    with pytest.raises(MethodNotFoundError, match="authenticated"):
                        await tool.call_by_name(STATS)


def test_latency_buckets_cover_microseconds_to_hours() -> None:
    assert _observe.latency_bucket(0.0) == 0
    assert _observe.latency_bucket(1e-6) == 0
    assert _observe.latency_bucket(1e9) == _observe.LATENCY_BUCKETS - 1
    for seconds in (3e-6, 1e-4, 0.02, 1.5, 30.0):
        i = _observe.latency_bucket(seconds)
        assert _observe.bucket_upper_seconds(i - 1) < seconds <= _observe.bucket_upper_seconds(i)
    assert _observe.statistics_allowed(None)
