"""`bench.interceptor_cpu` runs and reports sane figures (tiny counts: a smoke test only)."""

from __future__ import annotations

import asyncio

from bench import interceptor_cpu


def test_the_micro_benchmark_measures_every_case() -> None:
    rows = asyncio.run(interceptor_cpu._micro(calls=200, rounds=2))
    assert set(rows) == {
        "client plain",
        "client intercepted",
        "engine plain",
        "engine context",
        "engine intercepted",
    }
    assert all(len(values) == 2 and all(v > 0 for v in values) for values in rows.values())


def test_the_end_to_end_benchmark_alternates_both_pairs() -> None:
    rows = asyncio.run(interceptor_cpu.measure(calls=50, inflight=2, rounds=2, warmup=10))
    assert set(rows) == {"plain", "intercepted"}
    assert all(len(values) == 2 and all(v > 0 for v in values) for values in rows.values())
