"""Prometheus metrics of tensorrpc clients and engines (the ``metrics`` extra).

```python
# sketch: needs a running engine
from prometheus_client import CollectorRegistry, generate_latest
from tensorrpc.metrics import PrometheusObserver

registry = CollectorRegistry()
metrics = PrometheusObserver(registry)
async with Client(Calculator, connect=..., observer=metrics) as client:
    ...
print(generate_latest(registry).decode())
```

Or ``observer=exporter(9464)`` to serve the default registry over HTTP on 127.0.0.1. This
module counts nothing: every family is read from the clients' and engines'
``statistics()`` at scrape time. Names, units and the bounded labels are listed in
docs/observability.md."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

try:
    from prometheus_client import REGISTRY, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tensorrpc.metrics needs prometheus_client: pip install 'tensorrpc[metrics]'"
    ) from exc

from tensorrpc._exceptions import ConnectError
from tensorrpc._observe import Observer
from tensorrpc._statistics import bucket_upper_seconds
from tensorrpc._text import peer_text
from tensorrpc._views import ClientStatistics, EngineStatistics

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from tensorrpc._client import Client
    from tensorrpc._server import Server

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "DEFAULT_BUCKETS",
    "FORGET_AFTER_S",
    "MAX_ENGINE_LABELS",
    "MAX_METHOD_LABELS",
    "OTHER",
    "RTT_BUCKETS",
    "PrometheusObserver",
    "bound_port",
    "exporter",
]

#: Most engine ids with series of their own in one observer; others count as `OTHER`.
MAX_ENGINE_LABELS: Final = 128
#: Most method names with series of their own in one observer; others count as `OTHER`.
MAX_METHOD_LABELS: Final = 256
#: Seconds after an engine is lost before its series are removed.
FORGET_AFTER_S: Final = 600.0
#: The label value of engines (and methods) beyond the bounds.
OTHER: Final = "other"
#: Longest engine label value (characters, escapes included).
_ENGINE_LABEL_CHARS: Final = 64

#: Latency histogram buckets (seconds): RPC round trips start at tens of microseconds.
# fmt: off
DEFAULT_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
)
# fmt: on
#: Heartbeat round-trip buckets (seconds).
RTT_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class _Store:
    """What all views of one observer share: the watched targets and the label slots.

    Engine ids get label values of their own in the order scrapes first see them (live
    engines first), at most `MAX_ENGINE_LABELS`; an engine seen when every slot is held by
    a live one is counted under `OTHER` from then on. An engine not live at a scrape (or
    no longer reported, its client closed) is gone from then; the series of one gone for
    `FORGET_AFTER_S`, or gone the longest when a slot is needed, are removed (until it is
    live again).
    """

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.targets: dict[int, Any] = {}
        self.lock = threading.Lock()
        #: Engine id -> its label value, for the ids with series of their own.
        self.engines: dict[str, str] = {}
        #: Ids among `engines` that were not live at a scrape -> when (oldest first).
        self.gone: OrderedDict[str, float] = OrderedDict()
        #: Ids without a slot -> `OTHER`, or None for those whose series were removed.
        self.folded: dict[str, str | None] = {}
        self.methods: set[str] = set()
        #: The sides this process has been ("client", "engine"): only their families are
        #: exported, so an engine's /metrics has no client families (an alert on "a
        #: client has no live engines" must not fire on every engine) and vice versa.
        self.sides: set[str] = set()

    def assign(self, seen: dict[str, bool], now: float) -> None:
        """Give slots to the engine ids ``seen`` (id -> live) at a scrape at ``now``."""
        engines, gone, folded = self.engines, self.gone, self.folded
        for engine_id in engines:  # those no open client reports any more are gone too
            if seen.get(engine_id, False):
                gone.pop(engine_id, None)
            elif engine_id not in gone:
                gone[engine_id] = now
        for engine_id in sorted(seen, key=lambda e: not seen[e]):  # live ones first
            live = seen[engine_id]
            if engine_id in engines:
                continue
            was = folded.get(engine_id, "")  # "": new; None: removed; OTHER: no slot
            if engine_id == OTHER or was == OTHER or (was is None and not live):
                continue
            if len(engines) >= MAX_ENGINE_LABELS and gone:
                self.forget(next(iter(gone)))
            if len(engines) >= MAX_ENGINE_LABELS:
                folded[engine_id] = OTHER
                continue
            folded.pop(engine_id, None)
            engines[engine_id] = peer_text(engine_id, _ENGINE_LABEL_CHARS)
            if not live:
                gone[engine_id] = now
        self._expire(now)
        for engine_id in [e for e in folded if e not in seen]:
            del folded[engine_id]

    def _expire(self, now: float) -> None:
        """Remove the series of the engines gone for `FORGET_AFTER_S`."""
        while self.gone and now - next(iter(self.gone.values())) >= FORGET_AFTER_S:
            self.forget(next(iter(self.gone)))

    def forget(self, engine_id: str) -> None:
        """Remove the series of ``engine_id`` and free its slot."""
        self.gone.pop(engine_id, None)
        del self.engines[engine_id]
        self.folded[engine_id] = None

    def label(self, engine_id: str) -> str | None:
        """The label value of ``engine_id`` (None: its series were removed)."""
        label = self.engines.get(engine_id)
        return label if label is not None else self.folded.get(engine_id, OTHER)

    def method_key(self, method: str) -> str:
        """``method`` while fewer than `MAX_METHOD_LABELS` have series, else `OTHER`."""
        if method not in self.methods:
            if len(self.methods) >= MAX_METHOD_LABELS:
                return OTHER
            self.methods.add(method)
        return method


class PrometheusObserver(Observer):
    """An [`Observer`][tensorrpc.Observer] that exports Prometheus metrics.

    It counts nothing itself: each scrape reads the ``statistics()`` of the clients and
    engines it watches (those it was given to, while they are open).

    Args:
        registry: Where to register the metrics (default: prometheus_client's global
            ``REGISTRY``). One observer per registry: register it once and pass it to as
            many clients and engines as you like; their series add up per label set.
        buckets: Latency histogram buckets, in seconds.

    Raises:
        ValueError: The registry already holds tensorrpc metrics.
    """

    __slots__ = ("_port", "_store")

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        self._store = _Store(tuple(sorted(float(b) for b in buckets)))
        self._port: int | None = None
        (REGISTRY if registry is None else registry).register(_Collector(self._store))

    def _view(self, port: int) -> PrometheusObserver:
        # The same metrics, plus an HTTP server on `port` while a target it opened is open.
        view: PrometheusObserver = object.__new__(PrometheusObserver)
        view._store = self._store
        view._port = port
        return view

    def opened(self, target: Any) -> None:
        store = self._store
        # A client's or an engine's statistics tell which it is (this module imports
        # neither shell: the import graph stays acyclic, tests/unit/test_import_graph.py).
        side = "client" if isinstance(target.statistics(), ClientStatistics) else "engine"
        with store.lock:
            store.targets[id(target)] = target
            store.sides.add(side)
        if self._port is not None:
            _http.acquire(target, self._port)

    def closed(self, target: Any) -> None:
        store = self._store
        with store.lock:
            store.targets.pop(id(target), None)
        if self._port is not None:
            _http.release(target)


# -- scrape time --------------------------------------------------------------------------


class _Collector:
    """Builds every family at scrape time from the targets' ``statistics()``."""

    def __init__(self, store: _Store) -> None:
        self._store = store

    def describe(self) -> list[Metric]:
        return list(self._families(with_samples=False))

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        store = self._store
        with store.lock:
            targets = list(store.targets.values()) if with_samples else []
            # describe() (registration) names every family; a scrape only those of the
            # sides this process has been.
            sides = set(store.sides) if with_samples else {"client", "engine"}
        snapshots = [t.statistics() for t in targets]
        clients = [s for s in snapshots if isinstance(s, ClientStatistics)]
        engines = [s for s in snapshots if not isinstance(s, ClientStatistics)]
        if "client" in sides:
            per_engine = [e for stats in clients for e in stats.engines.values()]
            seen = _seen(per_engine)
            with store.lock:
                store.assign(seen, time.monotonic())
                labels = {e: store.label(e) for e in seen}
                methods = {m: store.method_key(m) for e in per_engine for m in e.methods}
            yield from _client_families(per_engine, labels, methods, store.buckets)
            yield from _client_state_families(clients, with_samples, per_engine, labels)
            yield from _transport_families("client", [s.transports for s in clients], with_samples)
        if "engine" in sides:
            yield from _engine_call_families(engines)
            yield from _engine_state_families(engines)
            yield from _batch_families(engines)
            yield from _transport_families("engine", [s.transports for s in engines], with_samples)


_ME: Final = ["method", "engine"]


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


class _Sum:
    """Counters and sparse histograms of several engine ids (or clients) added up."""

    __slots__ = ("duration", "items", "outcomes", "started", "total")

    def __init__(self) -> None:
        self.started = self.items = 0
        self.outcomes: dict[str, int] = {}
        self.duration: dict[int, int] = {}
        self.total = 0.0

    def add_pairs(self, pairs: Sequence[Sequence[int]], total: float) -> None:
        for index, n in pairs:
            self.duration[index] = self.duration.get(index, 0) + n
        self.total += total

    def buckets(self, bounds: tuple[float, ...]) -> list[Any]:
        return _rebin(list(self.duration.items()), bounds, bucket_upper_seconds)


def _seen(engines: list[EngineStatistics]) -> dict[str, bool]:
    """Engine id -> live (in any client)."""
    seen: dict[str, bool] = {}
    for e in engines:
        seen[e.engine_id] = seen.get(e.engine_id, False) or e.live
    return seen


def _client_families(
    engines: list[EngineStatistics],
    labels: dict[str, str | None],
    methods: dict[str, str],
    bounds: tuple[float, ...],
) -> Iterator[Metric]:
    """Client calls, engine events and heartbeats, from the clients' counters."""
    calls: dict[tuple[str, str], _Sum] = {}
    events: dict[tuple[str, str], int] = {}
    rtt: dict[str, _Sum] = {}
    for e in engines:
        label = labels[e.engine_id]
        if label is None:
            continue  # its series were removed
        for method, m in e.methods.items():
            acc = calls.setdefault((methods[method], label), _Sum())
            acc.started += m["calls"]
            acc.items += m["items"]
            for outcome, n in m["outcomes"].items():
                acc.outcomes[outcome] = acc.outcomes.get(outcome, 0) + n
            acc.add_pairs(m["duration"], m["duration_sum_s"])
        for event, n in e.events.items():
            events[label, event] = events.get((label, event), 0) + n
        if e.heartbeat_rtt:
            rtt.setdefault(label, _Sum()).add_pairs(e.heartbeat_rtt, e.heartbeat_rtt_sum_s)
    started = _counter("tensorrpc_client_calls_started", "Calls (and streams) a client sent.", _ME)
    finished = _counter(
        "tensorrpc_client_calls",
        "Calls (and streams) that ended, by outcome: ok, cancelled, or the error code's name.",
        [*_ME, "outcome"],
    )
    duration = _histogram(
        "tensorrpc_client_call_duration_seconds",
        "Client-side latency of unary calls and whole streams, sending to result "
        "(bucketed by the statistics' latency buckets: within a quarter octave).",
        _ME,
    )
    items = _counter("tensorrpc_client_stream_items", "Stream items taken by callers.", _ME)
    for key, acc in sorted(calls.items()):
        started.add_metric(list(key), acc.started)
        for outcome, n in acc.outcomes.items():
            finished.add_metric([*key, outcome], n)
        duration.add_metric(list(key), acc.buckets(bounds), acc.total)
        if acc.items:
            items.add_metric(list(key), acc.items)
    engine_events = _counter(
        "tensorrpc_client_engine_events",
        "Engines that joined, rejoined (seen before) or were lost (dead, BYE, refused).",
        ["engine", "event"],
    )
    for (label, event), n in sorted(events.items()):
        engine_events.add_metric([label, event], n)
    rtts = _histogram(
        "tensorrpc_client_heartbeat_rtt_seconds", "Heartbeat PING round trips.", ["engine"]
    )
    for label, acc in sorted(rtt.items()):
        rtts.add_metric([label], acc.buckets(RTT_BUCKETS), acc.total)
    yield from (started, finished, duration, items, engine_events, rtts)


def _client_state_families(
    clients: list[ClientStatistics],
    with_samples: bool,
    engines: list[EngineStatistics],
    labels: dict[str, str | None],
) -> Iterator[Metric]:
    """Client state, from ``statistics()``."""
    in_flight = _gauge("tensorrpc_client_calls_in_flight", "Calls in flight.", ["engine"])
    up = _gauge(
        "tensorrpc_client_engine_up", "1 while the engine is live, 0 once lost.", ["engine"]
    )
    engines_by_state = _gauge(
        "tensorrpc_client_engines", "Engines seen, by state (live, dead).", ["state"]
    )
    waiting = _gauge("tensorrpc_client_calls_waiting", "Callers waiting for an in-flight slot.", [])
    retries = _counter("tensorrpc_client_overload_retries", "Calls retried after OVERLOADED.", [])
    nbytes = _counter(
        "tensorrpc_client_bytes",
        "Bytes sent to and received from engines (all frames).",
        ["engine", "direction"],
    )
    seen = _seen(engines)
    live = sum(seen.values())
    shown: dict[str, list[int]] = {}  # engines without a label value of their own add up
    for e in engines:
        label = labels[e.engine_id]
        if label is not None:
            acc = shown.setdefault(label, [0, 0, 0, 0])
            acc[0] += e.in_flight
            acc[1] = max(acc[1], int(e.live))
            acc[2] += e.bytes_sent
            acc[3] += e.bytes_received
    for label, (flying, is_live, sent, received) in sorted(shown.items()):
        in_flight.add_metric([label], flying)
        up.add_metric([label], is_live)
        nbytes.add_metric([label, "sent"], sent)
        nbytes.add_metric([label, "received"], received)
    if with_samples:
        engines_by_state.add_metric(["live"], live)
        engines_by_state.add_metric(["dead"], len(seen) - live)
        waiting.add_metric([], sum(stats.waiting_for_capacity for stats in clients))
        retries.add_metric([], sum(stats.overload_retries for stats in clients))
    yield from (in_flight, up, engines_by_state, waiting, retries, nbytes)


def _engine_call_families(engines: list[Any]) -> Iterator[Metric]:
    """Engine calls, from ``statistics()``."""
    e_started = _counter("tensorrpc_engine_calls_started", "Calls an engine accepted.", _ME)
    e_finished = _counter(
        "tensorrpc_engine_calls",
        "Calls that ended, by outcome: ok, cancelled, or the ERROR code sent.",
        [*_ME, "outcome"],
    )
    queue = _histogram(
        "tensorrpc_engine_queue_wait_seconds",
        "Time from accepting a CALL to its handler starting (bucketed by the statistics "
        "method's latency buckets: within a quarter octave).",
        _ME,
    )
    handler = _histogram(
        "tensorrpc_engine_handler_seconds", "Time handlers ran (streams: whole stream).", _ME
    )
    e_items = _counter("tensorrpc_engine_stream_items", "Stream items engines sent.", _ME)
    for es in engines:
        for method, m in es.methods.items():
            if not m["calls"]:
                continue
            labels = [method, es.engine_id]
            e_started.add_metric(labels, m["calls"])
            for outcome, n in m["outcomes"].items():
                e_finished.add_metric([*labels, outcome], n)
            queue.add_metric(labels, _latency(m["queue_wait"]), m["queue_wait_sum_s"])
            handler.add_metric(labels, _latency(m["run_time"]), m["run_time_sum_s"])
            if m["items"]:
                e_items.add_metric(labels, m["items"])
    yield from (e_started, e_finished, queue, handler, e_items)


#: The engine gauges and counters of `_engine_state_families`: kind, name, help, value.
_ENGINE_STATE: Final = (
    (GaugeMetricFamily, "calls_in_flight", "Calls queued or running.", "in_flight"),
    (GaugeMetricFamily, "calls_queued", "Calls waiting for a worker.", "queued"),
    (CounterMetricFamily, "overloaded", "Calls refused as OVERLOADED.", "overloaded"),
    (
        CounterMetricFamily,
        "dropped_messages",
        "Messages dropped: malformed, unexpected or undeliverable.",
        "dropped",
    ),
)


def _engine_state_families(engines: list[Any]) -> Iterator[Metric]:
    """Engine state, from ``statistics()``."""
    for kind, name, doc, attribute in _ENGINE_STATE:
        family = kind(f"tensorrpc_engine_{name}", doc, labels=["engine"])
        for es in engines:
            family.add_metric([es.engine_id], getattr(es, attribute))
        yield family
    e_clients = _gauge("tensorrpc_engine_clients", "Clients in session.", ["engine"])
    e_bytes = _counter(
        "tensorrpc_engine_bytes",
        "Bytes received from and sent to clients (all frames).",
        ["engine", "direction"],
    )
    for es in engines:
        eid = es.engine_id
        e_clients.add_metric([eid], sum(1 for c in es.clients if c.state == "live"))
        e_bytes.add_metric([eid, "received"], sum(c.bytes_in for c in es.clients))
        e_bytes.add_metric([eid, "sent"], sum(c.bytes_out for c in es.clients))
    yield from (e_clients, e_bytes)


#: Batch size histogram buckets (items per batch, or per step of a continuous batch).
BATCH_SIZE_BUCKETS: Final = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)


def _rebin(pairs: Sequence[Sequence[float]], bounds: tuple[float, ...], upper: Any) -> list[Any]:
    """Cumulative Prometheus buckets from sparse ``[index, count]`` pairs, each counted
    under the first bound at or above ``upper(index)``."""
    counts = [0] * (len(bounds) + 1)
    for index, n in pairs:
        counts[bisect_left(bounds, upper(index))] += int(n)
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip(bounds, counts, strict=False):
        running += n
        out.append((repr(float(bound)), running))
    out.append(("+Inf", running + counts[-1]))
    return out


def _latency(pairs: Sequence[Sequence[float]]) -> list[Any]:
    """`_rebin` of a statistics latency histogram into `DEFAULT_BUCKETS`."""
    return _rebin(pairs, DEFAULT_BUCKETS, bucket_upper_seconds)


def _batch_families(engines: list[Any]) -> Iterator[Metric]:
    """Batched methods, from ``statistics()``: sizes, queue wait and run time."""
    sizes = _histogram(
        "tensorrpc_engine_batch_size", "Items per batch (continuous: per step).", _ME
    )
    wait = _histogram(
        "tensorrpc_engine_batch_queue_wait_seconds",
        "Time a batched call waited for its batch (bucketed by the statistics method's "
        "latency buckets: within a quarter octave).",
        _ME,
    )
    run = _histogram(
        "tensorrpc_engine_batch_run_seconds",
        "Time a batch handler (continuous: one step) ran.",
        _ME,
    )
    queued = _gauge("tensorrpc_engine_batch_queued", "Batched calls waiting for a batch.", _ME)
    for es in engines:
        for method, b in es.batching.items():
            labels = [method, es.engine_id]
            total = sum(k * n for k, n in b["sizes"])
            sizes.add_metric(labels, _rebin(b["sizes"], BATCH_SIZE_BUCKETS, float), total)
            wait.add_metric(labels, _latency(b["queue_wait"]), b["queue_wait_sum_s"])
            run.add_metric(labels, _latency(b["run_time"]), b["run_time_sum_s"])
            queued.add_metric(labels, b["queued"])
    yield from (sizes, wait, run, queued)


def _transport_families(side: str, stats: list[Any], with_samples: bool) -> Iterator[Metric]:
    way = ["transport", "direction"]
    tensors = _counter(
        f"tensorrpc_{side}_tensors", "Out-of-band tensors moved, by transport and direction.", way
    )
    tensor_bytes = _counter(
        f"tensorrpc_{side}_tensor_bytes",
        "Bytes of out-of-band tensors moved, by transport and direction.",
        way,
    )
    fallbacks = _counter(
        f"tensorrpc_{side}_transport_fallbacks",
        "Tensors meant for a transport that went as frames instead.",
        ["transport"],
    )
    for transport in ("frames", "torch_shm") if with_samples else ():
        counters = [getattr(s, transport) for s in stats]
        for direction in ("sent", "received"):
            n = sum(getattr(c, f"tensors_{direction}") for c in counters)
            tensors.add_metric([transport, direction], n)
            n = sum(getattr(c, f"bytes_{direction}") for c in counters)
            tensor_bytes.add_metric([transport, direction], n)
        fallbacks.add_metric([transport], sum(c.fallbacks for c in counters))
    yield from (tensors, tensor_bytes, fallbacks)


# -- exporter(port) -----------------------------------------------------------------------


class _HttpServers:
    """HTTP exporters started for `exporter`: one per requested port, ref-counted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._by_port: dict[int, tuple[WSGIServer, threading.Thread, set[int]]] = {}
        self.target_port: dict[int, int] = {}

    def acquire(self, target: Any, port: int) -> None:
        with self.lock:
            entry = self._by_port.get(port) if port else None
            if entry is None:
                try:
                    server, thread = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
                except OSError as exc:
                    raise ConnectError(
                        f"metrics port {port}: cannot export metrics on 127.0.0.1:{port}: "
                        f"{exc.strerror or exc}. Another process (another engine on this "
                        "host?) has that port: give each process its own metrics port "
                        "(tensorrpc serve --metrics-port, TENSORRPC_METRICS_PORT), or 0 "
                        "for a free one"
                    ) from exc
                entry = (server, thread, set())
                self._by_port[port or server.server_port] = entry
            entry[2].add(id(target))
            self.target_port[id(target)] = entry[0].server_port

    def release(self, target: Any) -> None:
        with self.lock:
            # Servers are kept under their bound port (a requested 0 included).
            bound = self.target_port.pop(id(target), None)
            entry = None if bound is None else self._by_port.get(bound)
            if entry is None:
                return
            server, thread, users = entry
            users.discard(id(target))
            if users:
                return
            del self._by_port[server.server_port]
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


_http = _HttpServers()
_default: PrometheusObserver | None = None
_default_lock = threading.Lock()


def default_observer() -> PrometheusObserver:
    """The process-wide observer on the global registry (made on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PrometheusObserver()
        return _default


def exporter(port: int) -> Observer:
    """An observer that exports a client's or engine's metrics over HTTP:
    ``Client(..., observer=exporter(9464))``, ``serve(..., observer=exporter(9464))``.

    The default observer's metrics (global registry), and an HTTP exporter on
    ``127.0.0.1:port`` that runs while the client or engine is open (shared by all that
    ask for the same port; ``0`` starts one on a free port, see
    [`bound_port`][tensorrpc.metrics.bound_port]). To export on other interfaces, use
    prometheus_client's ``start_http_server(port, addr=...)`` with a
    [`PrometheusObserver`][tensorrpc.metrics.PrometheusObserver]. Give the result as
    ``observer=`` (alone or with others).

    Raises:
        ValueError: ``port`` is out of range.

    The exporter starts when the client or engine opens, which raises
    [`ConnectError`][tensorrpc.ConnectError] naming the metrics port when another
    process holds the port (one port per process: see docs/observability.md).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"the metrics port must be 0..65535, not {port}")
    return default_observer()._view(port)


def bound_port(target: Client[Any] | Server) -> int | None:
    """The port of the HTTP `exporter` started for an open client or engine (None when it
    has none: closed, or no `exporter`)."""
    with _http.lock:
        return _http.target_port.get(id(target))
