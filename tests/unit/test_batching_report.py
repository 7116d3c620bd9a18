"""The batching section's report: the Ray Serve lines, their targets, the CPU sentences."""

from __future__ import annotations

from typing import Any

from bench import _report


def _case(per_s: float, median: float, p99: float, **more: Any) -> dict[str, Any]:
    return {"n": 100, "per_s": per_s, "median_ms": median, "p99_ms": p99, **more}


def _section(**serve: dict[str, Any]) -> dict[str, Any]:
    return {
        "unbatched": _case(150.0, 400.0, 500.0, client_cpu_us=240.0, engine_cpu_us=280.0),
        "tensorrpc": _case(
            4000.0, 14.0, 30.0, mean_batch=31.0, client_cpu_us=50.0, engine_cpu_us=60.0
        ),
        "asyncio batcher": _case(2500.0, 18.0, 80.0, mean_batch=30.0),
        _report.SMALL_CASE: _case(20000.0, 3.0, 6.0, client_cpu_us=37.0, engine_cpu_us=36.0),
        "callers": 64,
        "step_ms": 5.0,
        "max_delay_ms": 2.0,
        **serve,
    }


def _targets(bt: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["id"]: t for t in _report._batching_targets(bt)}


def test_each_serve_line_has_its_row_and_its_three_targets() -> None:
    bt = _section(
        **{
            _report.SERVE_CASE: _case(400.0, 160.0, 300.0, mean_batch=4.9, client_cpu_us=1500.0),
            _report.SERVE_FAST_CASE: _case(8000.0, 7.0, 40.0, mean_batch=3.0),
        }
    )
    rows = [line for line in _report._batching_md(bt) if line.startswith("| Ray Serve")]
    assert rows == [
        "| Ray Serve | 400/s | 160.00 ms | 300.00 ms | 4.9 |",
        "| Ray Serve, throughput-optimized | 8,000/s | 7.00 ms | 40.00 ms | 3.0 |",
    ]
    targets = _targets(bt)
    assert targets["batch_serve_per_s"]["value"] == 10.0
    assert targets["batch_serve_median"]["met"] is True
    # the throughput-optimized line is judged on its own: here it wins two of three
    assert [targets[f"batch_serve_fast_{k}"]["met"] for k in ("per_s", "median", "p99")] == [
        False,
        False,
        True,
    ]


def test_an_unavailable_serve_line_says_why_and_its_targets_are_not_measured() -> None:
    why = "ray.serve cannot be imported (No module named 'ray')"
    bt = _section(**{_report.SERVE_CASE: {"unavailable": why}})
    md = _report._batching_md(bt)
    assert f"| Ray Serve | unavailable: {why} | | | |" in md
    targets = _targets(bt)
    for tid in ("batch_serve_per_s", "batch_serve_fast_per_s"):
        assert targets[tid]["met"] is None
        assert targets[tid]["note"] == "not measured"


def test_the_cpu_sentences_put_the_small_call_beside_the_batched_one() -> None:
    bt = _section(**{_report.SERVE_CASE: _case(400.0, 160.0, 300.0, client_cpu_us=1500.0)})
    text = "\n".join(_report._batching_md(bt))
    assert (
        "Per call, a batched call costs the client 50 µs and the engine 60 µs of CPU; a "
        "small call with no step, by the same callers, 37 and 36 µs." in text
    )
    assert "Ray Serve 1500 µs (the driver's; Ray's own processes not counted)" in text
    assert f"{_report.SMALL_CASE} 37 / 36 µs" in text
