"""Metrics labels stay bounded when peers choose the engine ids (issue 21 item 3)."""

from __future__ import annotations

from pathlib import Path

import anyio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tensorrpc._client import Client
from tensorrpc._protocol import Welcome
from tensorrpc._server import Server
from tensorrpc._statistics import ClientCounters
from tensorrpc._views import ClientStatistics, EngineStatistics
from tensorrpc.metrics import (
    DEFAULT_BUCKETS,
    FORGET_AFTER_S,
    MAX_ENGINE_LABELS,
    MAX_METHOD_LABELS,
    OTHER,
    PrometheusObserver,
    _Store,
)

from ..integration.fake_engine import FakeEngine
from ..integration.services import Calculator

#: 256 fake engines that joined and left leave a scrape under this many bytes (3,000 made
#: 2.1 MB before the bound, about 700 bytes each, so 256 would make about 180 KB; an idle
#: client scrapes about 6 KB). 256 is twice the bound (`MAX_ENGINE_LABELS`, 128): an
#: unbounded exporter fails both the size and the label count below; a bounded one lets
#: the series of lost engines go and folds the rest into `OTHER`, as with any larger
#: number (the unit tests below check the bound itself with more engines than that,
#: without handshakes).
SCRAPE_BOUND = 128 * 1024
FAKES = 256
WORKERS = 16


def _engine_labels(text: str) -> set[str]:
    return {
        s.labels["engine"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "engine" in s.labels and family.name.startswith("tensorrpc_client")
    }


class _CountingObserver(PrometheusObserver):
    """Sets `all_lost` once `expected` engines were lost."""

    def __init__(self, registry: CollectorRegistry, expected: int) -> None:
        super().__init__(registry)
        self.lost = 0
        self.expected = expected
        self.all_lost = anyio.Event()

    def engine_event(self, client: str, engine: str, event: str) -> None:
        super().engine_event(client, engine, event)
        if event == "lost":
            self.lost += 1
            if self.lost >= self.expected:
                self.all_lost.set()


async def _fake_engines(address: str, first: int, count: int) -> None:
    for i in range(first, first + count):
        async with FakeEngine(address, f"fake-{i}-" + "x" * 200) as fake:
            assert isinstance(await fake.join(), Welcome)
            await fake.bye()


async def test_256_fake_engines_leave_a_bounded_scrape(tmp_path: Path) -> None:
    assert FAKES >= 2 * MAX_ENGINE_LABELS
    registry = CollectorRegistry()
    metrics = _CountingObserver(registry, FAKES)
    address = f"ipc://{tmp_path}/c.sock"
    async with Client(Calculator, bind=address, observer=metrics) as client:
        stub = client.stub()
        async with Server(Calculator("real"), connect=address, engine_id="real"):
            with anyio.fail_after(30):
                await client.wait_for_engines(1)
                assert await stub.add(1) == 2
            with anyio.fail_after(600):
                async with anyio.create_task_group() as tg:
                    per = FAKES // WORKERS
                    assert per * WORKERS == FAKES
                    for w in range(WORKERS):
                        tg.start_soon(_fake_engines, address, w * per, per)
                await metrics.all_lost.wait()
            with anyio.fail_after(30):
                assert await stub.add(2) == 3
            scrape = generate_latest(registry)
    assert len(scrape) < SCRAPE_BOUND, len(scrape)
    labels = _engine_labels(scrape.decode())
    assert "real" in labels  # a live engine keeps its series
    assert OTHER in labels or len(labels) <= MAX_ENGINE_LABELS
    assert len(labels) <= MAX_ENGINE_LABELS + 1


class _Client:
    """A client as the observer sees it: ``statistics()`` from sans-I/O counters."""

    def __init__(self, observer: PrometheusObserver) -> None:
        self.counters = ClientCounters()
        self.live: dict[str, bool] = {}
        observer.opened(self)

    def event(self, engine_id: str, event: str) -> None:
        self.counters.event(engine_id, event)
        self.live[engine_id] = event != "lost"

    def statistics(self) -> ClientStatistics:
        engines = {
            e: EngineStatistics(e, live, 0, 0, 0, 0, 0, **self.counters.of(e).snapshot())
            for e, live in self.live.items()
        }
        return ClientStatistics(engines, 0, 0, {})


def test_hostile_engine_ids_become_escaped_labels_and_fold_into_other() -> None:
    registry = CollectorRegistry()
    client = _Client(PrometheusObserver(registry))
    hostile = "e\n# HELP fake\x1b[2J"
    client.event(hostile, "joined")
    for i in range(MAX_ENGINE_LABELS + 10):  # live engines: none can be let go
        client.event(f"live-{i}", "joined")
    text = generate_latest(registry).decode()
    labels = _engine_labels(text)
    assert "e\\n# HELP fake\\x1b[2J" in labels
    assert OTHER in labels
    assert len(labels) == MAX_ENGINE_LABELS + 1
    assert "\x1b" not in text


def test_series_of_lost_engines_make_room_for_new_ones() -> None:
    registry = CollectorRegistry()
    client = _Client(PrometheusObserver(registry))
    for i in range(MAX_ENGINE_LABELS):
        client.event(f"old-{i}", "joined")
        client.event(f"old-{i}", "lost")
    assert len(_engine_labels(generate_latest(registry).decode())) == MAX_ENGINE_LABELS
    client.event("new", "joined")
    labels = _engine_labels(generate_latest(registry).decode())
    assert "new" in labels
    assert "old-0" not in labels  # gone the longest: its series were removed
    assert f"old-{MAX_ENGINE_LABELS - 1}" in labels
    assert OTHER not in labels
    client.event("old-0", "joined")  # live again: it may have series again
    labels = _engine_labels(generate_latest(registry).decode())
    assert "old-0" in labels
    assert OTHER not in labels


def test_method_labels_are_bounded() -> None:
    registry = CollectorRegistry()
    client = _Client(PrometheusObserver(registry))
    client.live["e1"] = True
    for i in range(MAX_METHOD_LABELS + 50):
        series = client.counters.started("e1", f"m{i}")
        client.counters.ended(series, "ok", 0.001)
    text = generate_latest(registry).decode()
    methods = {
        s.labels["method"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if family.name == "tensorrpc_client_calls_started"
    }
    assert len(methods) == MAX_METHOD_LABELS + 1
    assert OTHER in methods


def test_series_of_several_clients_add_up_and_a_closed_client_is_not_read() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    one, two = _Client(observer), _Client(observer)
    for client, calls in ((one, 2), (two, 3)):
        client.event("e1", "joined")
        for _ in range(calls):
            client.counters.ended(client.counters.started("e1", "add"), "ok", 0.002)
    one.counters.heartbeat("e1", 0.0003)

    def started() -> float:
        text = generate_latest(registry).decode()
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "tensorrpc_client_calls_started_total" and s.labels["engine"] == "e1"
        )

    assert started() == 5
    text = generate_latest(registry).decode()
    assert 'tensorrpc_client_heartbeat_rtt_seconds_count{engine="e1"} 1.0' in text
    assert 'tensorrpc_client_engine_events_total{engine="e1",event="joined"} 2.0' in text
    observer.closed(two)
    assert started() == 2


def test_engines_of_a_closed_client_give_their_slots_back() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    first = _Client(observer)
    for i in range(MAX_ENGINE_LABELS):
        first.event(f"old-{i}", "joined")
    assert len(_engine_labels(generate_latest(registry).decode())) == MAX_ENGINE_LABELS
    observer.closed(first)  # its engines stay live, but nothing reports them
    second = _Client(observer)
    second.event("new", "joined")
    labels = _engine_labels(generate_latest(registry).decode())
    assert labels == {"new"}


def test_series_of_an_engine_lost_for_forget_after_s_are_removed_until_it_is_back() -> None:
    store = _Store(DEFAULT_BUCKETS)
    store.assign({"a": True, "b": True}, 0.0)
    store.assign({"a": False, "b": True}, 1.0)  # a is lost from this scrape on
    store.assign({"a": False, "b": True}, FORGET_AFTER_S)
    assert store.label("a") == "a"  # not yet
    store.assign({"a": False, "b": True}, FORGET_AFTER_S + 1.0)
    assert store.label("a") is None
    assert store.label("b") == "b"
    store.assign({"a": True, "b": True}, FORGET_AFTER_S + 2.0)
    assert store.label("a") == "a"
