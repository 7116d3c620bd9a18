"""The codec benchmark runs and reports every case and system (figures are not judged).

A quick run is about a second of timed loops, so it sits with the benchmark smoke tests
rather than in tests/unit.
"""

from __future__ import annotations

import math

from bench import codec_bench
from bench._report import compute_targets


def test_quick_codec_bench_reports_every_case_and_system() -> None:
    result = codec_bench.run(quick=True)
    assert result["unit"] == "us"
    assert set(result["cases"]) == {"ids-list", "ids-tensor", "embeds"}
    for row in result["cases"].values():
        assert {"tensorrpc", "msgspec", "pickle5", "tensorrpc+recv", "tensorrpc+schema"} <= set(row)
        assert row["msgspec"]["ratio_to_msgspec"] == 1.0
        for figures in row.values():
            assert figures["encode"] > 0
            assert figures["decode"] > 0
            assert math.isclose(figures["total"], figures["encode"] + figures["decode"])
    table = codec_bench.format_table(result)
    assert "tensorrpc" in table
    assert "pickle5" in table


def test_the_codec_target_is_judged_on_codec_plus_validation() -> None:
    row = {
        "msgspec": {"ratio_to_msgspec": 1.0},
        "tensorrpc": {"ratio_to_msgspec": 1.3},
        "tensorrpc+schema": {"ratio_to_msgspec": 2.1},
    }
    results = {"codec": {"target_ratio": 1.5, "cases": {"ids-list": row}}}
    (target,) = [t for t in compute_targets(results) if t["id"] == "codec_ids-list"]
    assert target["value"] == 2.1
    assert target["met"] is False
