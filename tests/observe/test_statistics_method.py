"""The engine's built-in statistics method (what ``tensorrpc top`` reads)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tensorrpc import _observe, _statistics
from tensorrpc._client import Client
from tensorrpc._exceptions import MethodNotFoundError
from tensorrpc._security import CurveClientConfig, CurveServerConfig, generate_keypair
from tensorrpc._server import Server

from ..integration.services import Calculator

STATS = _observe.STATISTICS_METHOD


async def test_an_engine_answers_its_statistics_counted_since_it_started(
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
            assert await typed.stub().add(1) == 2  # before anyone watched: counted too
            first = await tool.call_by_name(STATS)
            for i in range(5):
                assert await typed.stub().add(i) == i + 1
            with pytest.raises(Exception, match="boom"):
                await typed.stub().fail("boom")
            second = await tool.call_by_name(STATS, {})
    assert first["engine_id"] == "e1"
    assert first["service"] == "Calculator"
    assert first["calls"] == 1
    assert set(first["methods"]) == {"add"}  # methods never called are left out
    assert first["methods"]["add"]["calls"] == 1
    assert first["clients"] == 2
    assert set(first["transports"]) == {"frames", "torch_shm"}
    assert first["transports"]["torch_shm"]["releases_refused"] == 0  # §10's map, as §4 says
    assert second["calls"] == 7
    assert second["errors"] == 1
    assert second["bytes_in"] > first["bytes_in"]
    add = second["methods"]["add"]
    assert add["calls"] == 6
    assert add["errors"] == 0
    assert sum(n for _, n in add["latency"]) == 6
    assert second["methods"]["fail"]["errors"] == 1
    assert second["latency_buckets_per_octave"] == _statistics.LATENCY_BUCKETS_PER_OCTAVE
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


def test_statistics_are_allowed_without_curve() -> None:
    assert _observe.statistics_allowed(None)


async def test_per_method_times_are_measured_on_one_clock(tmp_path: Path) -> None:
    # Accepted, started and ended are read on the shell's one clock: a 50 ms handler shows
    # at least 50 ms of run time and of latency, and its wait in the queue is no longer.
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Calculator("e1"), bind=address, engine_id="e1") as server,
        Client(Calculator, connect=address) as client,
    ):
        with anyio.fail_after(10):
            await client.wait_for_engines(1)
            assert await client.stub().sleep(0.05, "t") == "t"
            await client.stub().add(1)  # a call after it: the sleep's worker is done
        sleep = server.statistics().methods["sleep"]
    assert sleep["calls"] == 1
    assert sleep["outcomes"] == {"ok": 1}
    assert 0.05 <= sleep["run_time_sum_s"] < 10
    assert 0 <= sleep["queue_wait_sum_s"] < sleep["run_time_sum_s"]
    ((bucket, n),) = sleep["latency"]
    assert n == 1
    assert _statistics.bucket_upper_seconds(bucket) >= 0.05
