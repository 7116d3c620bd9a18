"""The engine's per-method counters, sans-I/O: durations in, snapshots out.

The only per-method counters there are: the engine's statistics (``Server.statistics``),
the built-in statistics method (``tensorrpc top``) and Prometheus (``tensorrpc.metrics``)
all read these. Latency histograms share one bucket scale: bucket ``i`` holds durations
up to ``2 ** (i / LATENCY_BUCKETS_PER_OCTAVE)`` microseconds.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Final

__all__ = [
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
        if started:
            self.queue_wait.add(started - received)
            self.run_time.add(now - started)
        else:
            self.queue_wait.add(now - received)
        self.latency.add(now - received)

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
