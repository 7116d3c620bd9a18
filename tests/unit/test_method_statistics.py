"""The engine machine's per-method counters: the only ones (statistics, top, Prometheus)."""

from __future__ import annotations

import pytest

from tensorrpc._exceptions import ErrorCode
from tensorrpc._protocol import Flags, MessageKind
from tensorrpc._statistics import (
    LATENCY_BUCKETS,
    bucket_upper_seconds,
    latency_bucket,
)

from .server_helpers import Engine


def _histogram_seconds(pairs: list[list[int]]) -> list[float]:
    return [bucket_upper_seconds(i) for i, n in pairs for _ in range(n)]


def test_accepted_calls_count_with_their_queue_wait_run_time_and_outcome() -> None:
    engine = Engine.make()
    engine.join()
    proto = engine.proto
    ok = engine.call(b"c1", 1)
    failed = engine.call(b"c1", 2)
    assert ok is not None
    assert failed is not None
    assert proto.calls.methods["add"].calls == 2
    engine.now += 0.002  # both wait 2 ms in the queue
    for call in (ok, failed):
        assert proto.next_call() is call
        proto.started(call, engine.now)
    engine.now += 0.010  # and run 10 ms
    proto.result(ok, b"\x90", [])
    proto.done(ok, engine.now)
    assert proto.error_reply(failed, ErrorCode.REMOTE, "boom")
    proto.done(failed, engine.now)
    add = proto.calls.methods["add"].snapshot()
    assert add["calls"] == 2
    assert add["errors"] == 1
    assert add["outcomes"] == {"ok": 1, "REMOTE": 1}
    assert add["queue_wait_sum_s"] == pytest.approx(0.004)
    assert add["run_time_sum_s"] == pytest.approx(0.020)
    for bound in _histogram_seconds(add["queue_wait"]):
        assert 0.002 <= bound < 0.002 * 2**0.25
    for bound in _histogram_seconds(add["run_time"]):
        assert 0.010 <= bound < 0.010 * 2**0.25
    for bound in _histogram_seconds(add["latency"]):
        assert 0.012 <= bound < 0.012 * 2**0.25
    assert proto.calls.methods["count"].snapshot()["calls"] == 0


def test_a_call_that_never_ran_counts_its_wait_and_how_it_ended() -> None:
    engine = Engine.make()
    engine.join()
    proto = engine.proto
    late = engine.call(b"c1", 1, timeout_ms=100)
    cancelled = engine.call(b"c1", 2)
    assert late is not None
    assert cancelled is not None
    engine.control(b"c1", MessageKind.CANCEL, None, 2)
    engine.advance(0.2)  # the first expires in the queue: answered DEADLINE_EXCEEDED
    assert engine.error(1).code == ErrorCode.DEADLINE_EXCEEDED
    assert proto.next_call() is cancelled
    proto.done(cancelled, engine.now)  # its worker ends it quietly, never started
    add = proto.calls.methods["add"].snapshot()
    assert add["outcomes"] == {"DEADLINE_EXCEEDED": 1, "cancelled": 1}
    assert add["errors"] == 1
    assert add["run_time"] == []
    assert add["queue_wait_sum_s"] == pytest.approx(0.4)


def test_stream_items_count_per_method() -> None:
    engine = Engine.make()
    engine.join(stream_window=3)
    call = engine.call(b"c1", 1, "count", int(Flags.STREAM))
    assert call is not None
    proto = engine.proto
    while proto.stream_item(call, b"\x01", []):
        pass
    assert proto.calls.methods["count"].snapshot()["items"] == 3


def test_refused_calls_are_not_counted_as_accepted() -> None:
    engine = Engine.make(max_concurrency=1, max_queued=0)
    engine.join()
    assert engine.call(b"c1", 1) is not None
    assert engine.call(b"c1", 2) is None  # OVERLOADED
    assert engine.call(b"c1", 3, "nope") is None  # METHOD_NOT_FOUND
    assert engine.proto.calls.methods["add"].calls == 1
    assert set(engine.proto.calls.methods) == {"add", "count", "upload", "chat"}


def test_latency_buckets_cover_microseconds_to_hours() -> None:
    assert latency_bucket(0.0) == 0
    assert latency_bucket(1e-6) == 0
    assert latency_bucket(1e9) == LATENCY_BUCKETS - 1
    for seconds in (3e-6, 1e-4, 0.0123, 1.5, 3600.0):
        i = latency_bucket(seconds)
        assert bucket_upper_seconds(i - 1) < seconds <= bucket_upper_seconds(i)
