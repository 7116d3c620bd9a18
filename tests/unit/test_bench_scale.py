"""The scale section's pure parts: the selection micro-benchmark and its report table."""

from __future__ import annotations

from bench import _report, scale


def test_select_cost_is_measured_with_every_engine_busy() -> None:
    for n in (1, 8):
        assert scale.select_cost_us(n, 50) > 0


def test_scale_table_has_one_row_per_engine_count() -> None:
    entry = {
        "join_ms": 12.0,
        "rss_per_engine_kib": 32.0,
        "call": {"median_us": 500.0, "p99_us": 900.0, "client_cpu_us": 200.0},
        "busy": {"calls_per_s": 4000.0, "client_cpu_us": 90.0},
        "broadcast": {"median_us": 3000.0},
        "select_us": 0.5,
    }
    lines = _report._scale_md(
        {"engines": {"1": entry, "64": {"unavailable": "skipped"}}, "busy_inflight": 128}
    )
    rows = [line for line in lines if line.startswith(("| 1 ", "| 64 "))]
    assert rows[0].startswith("| 1 | 12 ms | 32 KiB | 500 µs | 900 µs | 200 µs | 4,000/s")
    assert rows[1] == "| 64 | skipped |||||||||"
    assert "## Scale" in _report.markdown({"scale": {"engines": {"1": entry}}})
