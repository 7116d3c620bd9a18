"""The per-method counters of engines and clients, sans-I/O: durations in, snapshots out.

The only counters there are: the engine's and the client's statistics
(``Server.statistics``, ``Client.statistics``), the built-in statistics method
(``tensorrpc top``) and Prometheus (``tensorrpc.metrics``) all read these. Latency
histograms share one bucket scale: bucket ``i`` holds durations up to
``2 ** (i / LATENCY_BUCKETS_PER_OCTAVE)`` microseconds.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Container

__all__ = [
    "ClientCounters",
    "EngineCounters",
    "LATENCY_BUCKETS",
    "LATENCY_BUCKETS_PER_OCTAVE",
    "LatencyHistogram",
    "MethodStatistics",
    "bucket_upper_seconds",
    "latency_bucket",
]

LATENCY_BUCKETS_PER_OCTAVE: Final = 4
LATENCY_BUCKETS: Final = 128


def bucket_upper_seconds(index: int) -> float:
    """The upper bound, in seconds, of histogram bucket ``index``."""
    return float(2.0 ** (index / LATENCY_BUCKETS_PER_OCTAVE) / 1e6)


#: The upper bounds of every bucket but the last (which holds everything longer).
_BOUNDS: Final = tuple(bucket_upper_seconds(i) for i in range(LATENCY_BUCKETS - 1))


def latency_bucket(seconds: float) -> int:
    """The histogram bucket of a duration (see ``LATENCY_BUCKETS_PER_OCTAVE``)."""
    return bisect_left(_BOUNDS, seconds)  # one C call per duration: the engine's hot path


class LatencyHistogram:
    """Counts per latency bucket and their sum in seconds."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * LATENCY_BUCKETS
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.counts[latency_bucket(seconds)] += 1
        self.total += seconds

    def pairs(self) -> list[list[int]]:
        """The sparse ``[bucket, count]`` pairs (non-zero buckets only)."""
        return [[i, n] for i, n in enumerate(self.counts) if n]


class MethodStatistics:
    """One method's calls on an engine, counted when each is accepted and when it ends.

    ``outcomes``: ``"ok"``, ``"cancelled"`` (the client gave up) or the name of the ERROR
    code sent (``"REMOTE"``, ``"DEADLINE_EXCEEDED"``, ...). The durations: ``queue_wait``
    from accepting the CALL to its handler starting (or to its end, for a call that never
    ran), ``run_time`` of the handler (a stream's whole), ``latency`` the two together.
    """

    __slots__ = ("calls", "errors", "items", "latency", "outcomes", "queue_wait", "run_time")

    def __init__(self) -> None:
        self.calls = 0
        self.errors = 0
        self.items = 0
        self.outcomes: dict[str, int] = {}
        self.queue_wait = LatencyHistogram()
        self.run_time = LatencyHistogram()
        self.latency = LatencyHistogram()

    def ended(self, outcome: str, received: float, started: float, now: float) -> None:
        """A call accepted at ``received`` ended at ``now`` (``started`` 0: never ran)."""
        outcomes = self.outcomes
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome != "ok" and outcome != "cancelled":
            self.errors += 1
        # `LatencyHistogram.add`, inline: this runs for every call an engine answers.
        latency = now - received
        wait = started - received if started else latency
        histogram = self.queue_wait
        histogram.counts[bisect_left(_BOUNDS, wait)] += 1
        histogram.total += wait
        if started:
            histogram = self.run_time
            histogram.counts[bisect_left(_BOUNDS, now - started)] += 1
            histogram.total += now - started
        histogram = self.latency
        histogram.counts[bisect_left(_BOUNDS, latency)] += 1
        histogram.total += latency

    def snapshot(self) -> dict[str, Any]:
        """``calls`` accepted, ``errors`` (ERROR replies), ``items`` (stream items sent),
        ``outcomes`` and the sparse histograms ``queue_wait``, ``run_time`` and ``latency``
        (``[bucket, count]`` pairs) with the first two's sums in seconds (``*_sum_s``)."""
        return {
            "calls": self.calls,
            "errors": self.errors,
            "items": self.items,
            "outcomes": dict(self.outcomes),
            "queue_wait": self.queue_wait.pairs(),
            "queue_wait_sum_s": self.queue_wait.total,
            "run_time": self.run_time.pairs(),
            "run_time_sum_s": self.run_time.total,
            "latency": self.latency.pairs(),
        }


class ClientMethodStatistics:
    """One method's calls from a client to one engine id, as the caller saw them."""

    __slots__ = ("duration", "items", "outcomes", "started")

    def __init__(self) -> None:
        self.started = 0
        self.items = 0
        self.outcomes: dict[str, int] = {}
        self.duration = LatencyHistogram()

    def snapshot(self) -> dict[str, Any]:
        """``calls`` started, ``items`` taken, ``outcomes``, ``duration`` (sparse
        ``[bucket, count]`` pairs, sending to result) and ``duration_sum_s``."""
        return {
            "calls": self.started,
            "items": self.items,
            "outcomes": dict(self.outcomes),
            "duration": self.duration.pairs(),
            "duration_sum_s": self.duration.total,
        }


class EngineCounters:
    """A client's counters of one engine id (summed over its sessions)."""

    __slots__ = ("events", "methods", "rtt")

    def __init__(self) -> None:
        self.methods: dict[str, ClientMethodStatistics] = {}
        #: ``"joined"``, ``"rejoined"`` (seen before) and ``"lost"`` -> how often.
        self.events: dict[str, int] = {}
        #: Heartbeat PING round trips.
        self.rtt = LatencyHistogram()

    def snapshot(self) -> dict[str, Any]:
        """The `tensorrpc.EngineStatistics` fields these counters fill."""
        return {
            "methods": {name: m.snapshot() for name, m in self.methods.items()},
            "events": dict(self.events),
            "heartbeat_rtt": self.rtt.pairs(),
            "heartbeat_rtt_sum_s": self.rtt.total,
        }


class ClientCounters:
    """A client's counters per engine id: its calls by method, engine events, heartbeats.

    The client machine counts calls started, items taken and engine events; the shell
    tells it each call's outcome (`ended`) and heartbeat round trips (`heartbeat`).
    Kept for the engine ids the client still reports (`prune`).
    """

    __slots__ = ("engines",)

    def __init__(self) -> None:
        self.engines: dict[str, EngineCounters] = {}

    def of(self, engine_id: str) -> EngineCounters:
        """The counters of ``engine_id`` (made on first use)."""
        counters = self.engines.get(engine_id)
        if counters is None:
            counters = self.engines[engine_id] = EngineCounters()
        return counters

    def started(self, engine_id: str, method: str) -> ClientMethodStatistics:
        """A call of ``method`` went to ``engine_id``: its series, counted."""
        methods = self.of(engine_id).methods
        series = methods.get(method)
        if series is None:
            series = methods[method] = ClientMethodStatistics()
        series.started += 1
        return series

    @staticmethod
    def ended(series: ClientMethodStatistics, outcome: str, seconds: float) -> None:
        """A call of ``series`` ended for its caller after ``seconds``."""
        outcomes = series.outcomes
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        series.duration.add(seconds)

    def event(self, engine_id: str, event: str) -> None:
        """``engine_id`` joined, rejoined or was lost."""
        events = self.of(engine_id).events
        events[event] = events.get(event, 0) + 1

    def heartbeat(self, engine_id: str, seconds: float) -> None:
        """A heartbeat PING to ``engine_id`` came back after ``seconds``."""
        self.of(engine_id).rtt.add(seconds)

    def prune(self, keep: Container[str]) -> None:
        """Forget the engine ids not in ``keep``."""
        for engine_id in [e for e in self.engines if e not in keep]:
            del self.engines[engine_id]
