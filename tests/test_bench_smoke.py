"""`python -m bench --quick` runs end to end and writes sane figures."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import _forkserver

ROOT = Path(__file__).resolve().parents[1]


def _numbers(tree: Any) -> list[float]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _numbers(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in _numbers(v)]
    if isinstance(tree, int | float) and not isinstance(tree, bool):
        return [float(tree)]
    return []


def _bench(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ARGS`` from the repository root (forked from the pre-imported
    interpreter of tests/_forkserver.py); its output, after checking it succeeded."""
    proc = _forkserver.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _quick(out: Path, *args: str, timeout: float = 90) -> tuple[dict[str, Any], str, str]:
    """``python -m bench --quick ARGS --out OUT``: its JSON, its Markdown and its stdout."""
    proc = _bench("bench", "--quick", *args, "--out", str(out), timeout=timeout)
    results = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    return results, (out / "bench.md").read_text(encoding="utf-8"), proc.stdout


def test_quick_roundtrip_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "results"
    results, md, stdout = _quick(
        out, "--only", "roundtrip", "--system", "pyzmq", "--system", "tensorrpc"
    )
    systems = results["roundtrip"]["systems"]
    assert set(systems) == {"pyzmq", "tensorrpc"}
    for entry in systems.values():
        assert "unavailable" not in entry, entry
        small, pipe = entry["small"], entry["pipelined"]
        assert small["n"] > 0
        assert 0 < small["min_us"] <= small["median_us"] <= small["p99_us"] <= small["max_us"]
        assert pipe["calls"] > 0
        assert pipe["calls_per_s"] > 0
        assert all(math.isfinite(x) and x >= 0 for x in _numbers(entry))
    assert results["machine"]["cpus"] >= 1
    assert results["duration_s"] > 0

    assert "| pyzmq |" in md
    assert "## Round trip" in md
    assert "## Targets" in md
    assert "## Round trip" in stdout
    # no transfer section in this run, so no chart
    assert not (out / "latency_vs_size.png").exists()


def test_report_renders_unavailable_systems_without_numbers(tmp_path: Path) -> None:
    from bench import _report

    results: dict[str, Any] = {
        "quick": True,
        "duration_s": 1.0,
        "machine": {"cpus_usable": 2},
        "transfer": {
            "sizes": [4096],
            "notes": {},
            "systems": {
                "tensorrpc frames": {"unavailable": "RuntimeError: boom"},
                "pyzmq": {
                    "small": {"median_us": 100.0},
                    "sizes": {"4096": {"median_us": 150.0, "p99_us": 300.0}},
                },
            },
        },
    }
    paths = _report.write(results, tmp_path)
    md = paths["markdown"].read_text(encoding="utf-8")
    assert "unavailable: RuntimeError: boom" in md
    assert "150 µs" in md
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    frames_target = next(t for t in data["targets"] if t["id"] == "tx_frames_64m")
    assert frames_target["met"] is None
    assert frames_target["value"] is None
    assert paths["chart"].stat().st_size > 0


def test_report_has_the_other_direction_when_measured(tmp_path: Path) -> None:
    from bench import _report

    cell = {"4096": {"median_us": 200.0, "p99_us": 300.0}}
    results: dict[str, Any] = {
        "quick": True,
        "duration_s": 1.0,
        "machine": {"cpus_usable": 2},
        "transfer": {
            "sizes": [4096],
            "notes": {},
            "systems": {
                "Tensor.copy_ (in-process)": {"sizes": cell, "sizes_out": cell},
                "tensorrpc frames": {
                    "small": {"median_us": 100.0},
                    "sizes": cell,
                    "sizes_out": {"4096": {"median_us": 400.0, "p99_us": 500.0}},
                },
                "Ray actor (numpy)": {"unavailable": "RuntimeError: ray is not installed"},
                "pyzmq": {"small": {"median_us": 100.0}, "sizes": cell},  # one way only
            },
        },
    }
    paths = _report.write(results, tmp_path)
    md = paths["markdown"].read_text(encoding="utf-8")
    other = md.split("## Transfer, the other way")[1]
    assert f"| tensorrpc frames | 400 µs (1.00{_report.TIMES}) |" in other
    assert f"| Tensor.copy_ (in-process) | 200 µs (0.50{_report.TIMES}) |" in other
    assert "unavailable: RuntimeError: ray is not installed" in other
    assert "| pyzmq |" not in other
    assert paths["chart"].stat().st_size > 0


@pytest.mark.parametrize(("system", "inflight"), [("tensorrpc", "64"), ("pyzmq", "1")])
def test_call_cpu_reports_client_and_engine_cpu_per_call(system: str, inflight: str) -> None:
    lines = _bench(
        "bench.call_cpu", "--calls", "500", "--runs", "2", "--system", system,
        "--inflight", inflight,
    ).stdout.splitlines()  # fmt: skip
    assert lines[0].startswith(f"500 calls, {inflight} in flight")
    assert lines[0].endswith(f"; {system}")
    runs = [line for line in lines[1:] if not line.startswith("median")]
    assert len(runs) == 2
    for line in [*runs, lines[-1]]:
        words = line.split()
        figures = dict(zip(words[-8::2], map(float, words[-7::2]), strict=True))
        assert set(figures) == {"wall_us", "calls_per_s", "client_cpu_us", "engine_cpu_us"}
        # a call costs the client and the engine some CPU, and not more than its wall time
        # times the machine's cores (the figures are per call, summed over all threads)
        assert figures["wall_us"] > 0
        assert 0 < figures["client_cpu_us"] <= figures["wall_us"] * (os.cpu_count() or 1)
        assert 0 < figures["engine_cpu_us"] <= figures["wall_us"] * (os.cpu_count() or 1)


def test_report_divides_each_tensorrpc_line_by_a_copy_of_its_own_sources(tmp_path: Path) -> None:
    from bench import _report

    results: dict[str, Any] = {
        "quick": True,
        "duration_s": 1.0,
        "machine": {"cpus_usable": 2},
        "transfer": {
            "sizes": [4096, 64 << 20],
            "notes": {},
            "systems": {
                _report.NEW: {
                    "small": {"median_us": 100.0},
                    "sizes": {"4096": {"median_us": 300.0}, str(64 << 20): {"median_us": 6000.0}},
                    "copy_": {"4096": {"median_us": 2.0}, str(64 << 20): {"median_us": 5000.0}},
                },
            },
        },
    }
    paths = _report.write(results, tmp_path)
    md = paths["markdown"].read_text(encoding="utf-8")
    table = md.split("## Transfer ÷ one copy_ of the same source")[1]
    assert f"| {_report.NEW} | 150.00{_report.TIMES} (2 µs) | 1.20{_report.TIMES} (5 ms) |" in table
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    target = next(t for t in data["targets"] if t["id"] == "tx_shm_new_64m_copy")
    assert (target["value"], target["met"]) == (1.2, True)


def test_the_shm_targets_compare_each_line_with_its_paired_small_call(tmp_path: Path) -> None:
    from bench import _report

    big = str(64 << 20)

    def line(median: float, paired: float) -> dict[str, Any]:
        cell = {"median_us": median, "small_paired": {"median_us": paired}}
        return {"small": {"median_us": 100.0}, "sizes": {big: cell}, "sizes_out": {big: cell}}

    results: dict[str, Any] = {
        "quick": True,
        "duration_s": 1.0,
        "machine": {"cpus_usable": 2},
        "transfer": {
            "sizes": [64 << 20],
            "notes": {},
            "systems": {
                # (against the session's small call of 100 µs both would miss)
                _report.SHARED: line(450.0, 400.0),
                _report.SLOTS: line(600.0, 450.0),
                _report.TORCH: {"small": {"median_us": 100.0}, "sizes": {big: {"median_us": 1.0}}},
            },
        },
    }
    data = json.loads(_report.write(results, tmp_path)["json"].read_text(encoding="utf-8"))
    got = {t["id"]: (t["value"], t["met"]) for t in data["targets"]}
    assert got["tx_shm_shared_64m_ms"] == (0.05, True)
    assert got["tx_out_shm_shared_64m_ms"] == (0.05, True)
    assert got["tx_shm_slots_64m_ms"] == (0.15, False)
    assert got[f"tx_shm_shared_{big}"] == (1.125, True)
    assert got["tx_shm_torch_64m_ms"] == (None, None)  # no paired small call: no figure


def test_paired_small_calls_alternate_with_the_line_in_blocks() -> None:
    import asyncio

    from bench._measure import Budget, time_async_paired

    log: list[str] = []

    async def prepare() -> int:
        log.append("p")
        return len(log)

    async def fn(arg: int) -> None:
        log.append("f")

    async def ref() -> None:
        log.append("r")

    samples, refs = asyncio.run(
        time_async_paired(prepare, fn, ref, Budget(warmup=2, count=5, seconds=60.0), block=2)
    )
    assert len(samples) == len(refs) == 5
    assert "".join(log) == "pfpf" + "rr" + "pfpf" + "rr" + "pfpf" + "rr" + "pf" + "r"


def test_dataloader_batches_are_shared_new_each_call_and_of_the_size_asked() -> None:
    from bench.transfer import Batches

    batches = Batches(window=3)
    try:
        seen = []
        for size in (4096, 4096, 4096, 4096, 8192, 4096):
            b = batches.take(size)
            assert b.nbytes == size
            assert b.is_shared()  # type: ignore[no-untyped-call]
            assert float(b[-1]) == size // 4 - 1
            seen.append(b.untyped_storage().data_ptr())
        # every batch handed out is a new one (windows are held until the next window)
        assert len(set(seen[:3])) == 3
    finally:
        batches.close()


def test_dataloader_line_wakes_both_ends_after_each_fetch_only() -> None:
    import asyncio

    from bench.transfer import WAKE_CALLS, Batches, _next_batch

    batches = Batches(window=2)
    woken: list[int] = []

    async def wake() -> None:
        woken.append(len(woken))

    async def five() -> tuple[list[bool], list[bool]]:
        fetched: list[bool] = []
        noted: list[bool] = []
        for _ in range(5):
            fetched.append(batches.needs_fetch(4096))
            await _next_batch(batches, 4096, wake, noted)
        return fetched, noted

    try:
        fetched, noted = asyncio.run(five())
    finally:
        batches.close()
    assert fetched == [True, False, True, False, True]
    assert noted == fetched  # (what splits the line: first after a fetch, the others)
    assert len(woken) == 3 * WAKE_CALLS


def test_a_loader_line_splits_its_samples_by_fetch() -> None:
    from bench.transfer import _by_fetch

    got = _by_fetch([900, 500, 510, 520, 800, 505], [True, False, False, False, True, False])
    assert got["first_after_fetch"]["median_us"] == 0.85
    assert got["others"]["median_us"] == 0.5075
    assert _by_fetch([1, 2], [False, False]) == {}


def test_startup_measures_the_commands_and_none_imports_torch() -> None:
    # Start-up time is measured by bench.startup, never asserted here; what a test can
    # hold is that it runs and that none of the commands imports torch.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.startup", "--runs", "1", "--no-torch-line"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("1 runs each")
    names = ["--version", "call (live engine)", "call (nobody, --timeout 1)"]
    assert [line[:28].rstrip() for line in lines[1:]] == names
    for line in lines[1:]:
        assert "imports torch: no" in line, line


def test_quick_batching_section_measures_every_case(tmp_path: Path) -> None:
    results, md, _ = _quick(tmp_path / "results", "--only", "batching", timeout=180)
    bt = results["batching"]
    assert "unavailable" not in bt, bt
    cases = ["unbatched", "tensorrpc", "tensorrpc, max_delay 5 ms", "tensorrpc, max_delay 10 ms"]
    cases.append("asyncio batcher")
    # the peer is measured wherever ray.serve imports (in a child: it warns on import)
    probe = [sys.executable, "-c", "import ray.serve"]
    if subprocess.run(probe, capture_output=True, timeout=120, check=False).returncode == 0:
        cases += ["Ray Serve", "Ray Serve, throughput-optimized"]
    else:
        assert "unavailable" in bt["Ray Serve"], bt["Ray Serve"]
        assert "unavailable" in bt["Ray Serve, throughput-optimized"]
    for case in cases:
        assert bt[case]["n"] > 0, bt[case]
        assert 0 < bt[case]["median_ms"] <= bt[case]["p99_ms"]
    for case in ("streams one at a time", "streams continuous"):
        assert bt[case]["n"] == bt["streams"] * bt["tokens"]  # every token, each its own
    assert bt["late_ttft_ms"] > 0
    assert bt["running_step_ms"] > 0
    late = bt["late_ttft_steps"]
    assert late["n"] > 0
    assert 0 < late["min"] <= late["median"] <= late["max"]
    for case in ("tensorrpc", "tensorrpc, max_delay 5 ms", "tensorrpc, max_delay 10 ms"):
        assert 0 < bt[case]["device_busy"] <= 1, bt[case]  # each batch logged by the engine
        assert "due_start_ms" in bt[case]  # None when no batch was due as the last ended
    parts = bt["late_parts_ms"]  # every late stream placed against the engine's steps
    assert set(parts) == {"in", "residual", "boundary", "own", "out", "first_output", "ttft"}
    assert 0 < parts["own"]["median"] <= parts["own"]["max"]
    assert parts["boundary"]["max"] == pytest.approx(
        bt["late_join_extra_ms"] + bt["stream_delay_ms"]
    )
    cpu_cases = ("unbatched", "tensorrpc", "tensorrpc, max_delay 10 ms", "asyncio batcher")
    for case in (*cpu_cases, "small call, no step"):
        assert bt[case]["client_cpu_us"] > 0
        assert bt[case]["engine_cpu_us"] > 0
        assert type(bt[case]["engine_full_gc"]) is int  # a count: present, whole
    ids = {t["id"] for t in results["targets"]}
    assert {"batch_speedup", "batch_tokens", "batch_late_ttft_ms", "batch_late_join_ms"} <= ids
    assert {"batch_median_ms", "batch_median_mid_ms", "batch_median_wide_ms"} <= ids
    assert "## Batching" in md
    assert "a small call with no step, by the same callers" in md


def test_shm_held_reports_an_engine_that_unmaps_what_the_client_freed() -> None:
    proc = _bench("bench.shm_held", "--count", "12", "--mib", "1", "--wait", "30", timeout=180)
    lines = proc.stdout.splitlines()
    assert lines[0] == "12 share() tensors of 1 MiB sent and freed; aliased 12 of 12", lines
    # Each new mapping first drops those the client freed, so the engine maps the one just
    # received and those on their way out: its release thread unmaps them (off the loop)
    # once it gets a core, which on a busy machine can take a call or two. Keeping what
    # was freed (the bug this guards) maps one more per call: 12 or more by the end.
    peak = re.fullmatch(r"engine, most during the run: (\d+) mappings, (\d+) MiB", lines[2])
    assert peak is not None, lines
    assert 1 <= int(peak[1]) <= 12 // 2, lines
    assert int(peak[2]) == int(peak[1]), lines  # 1 MiB each
    # The engine's periodic sweep (once per heartbeat interval) drops the last one.
    assert lines[4] == "engine after its sweep (waited up to 30 s): 0 mappings, 0 MiB", lines


def test_quick_mixed_load_reports_tails_and_throughput(tmp_path: Path) -> None:
    tensorrpc_frames = "tensorrpc frames (engine dials in)"
    results, md, _ = _quick(
        tmp_path / "results",
        *("--only", "mixed", "--system", "pyzmq", "--system", tensorrpc_frames),
        timeout=240,
    )
    mixed = results["mixed"]
    assert set(mixed["systems"]) == {"pyzmq", tensorrpc_frames}
    for entry in mixed["systems"].values():
        assert "unavailable" not in entry, entry
        alone = entry["alone"]
        assert alone["n"] > 0
        assert 0 < alone["p50_us"] <= alone["p99_us"] <= alone["p999_us"] <= alone["max_us"]
        assert set(entry["sizes"]) == {str(n) for n in mixed["sizes"]}
        for cell in entry["sizes"].values():
            small = cell["small"]
            assert 0 < small["p50_us"] <= small["p99_us"] <= small["p999_us"]
            assert cell["p99_vs_alone"] > 0
            assert set(cell["large"]) == {"in", "out", "echo"}
            for direction in cell["large"].values():
                assert direction["calls"] > 0
                assert direction["mib_per_s"] > 0
            assert set(cell["first_call_ms"]) == {"in", "out", "echo"}
            for direction in cell["after_large"].values():
                assert 0 < direction["p50_us"] <= direction["max_us"]
        assert all(math.isfinite(x) and x >= 0 for x in _numbers(entry))
    assert "## Small calls under a mixed load" in md
    assert f"| {tensorrpc_frames} | 16 MiB |" in md


def test_mixed_idle_systems_run_last_with_sched_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import mixed

    names = mixed.system_names()
    idle = [n for n in names if " idle (" in n]
    assert len(idle) == 4
    assert names[-4:] == idle  # (they leave the release thread idle: last)
    seen: list[tuple[str, str, bool]] = []

    def fake(cfg: Any, workdir: Any, transport: str, topology: str, idle: bool = False) -> Any:
        seen.append((transport, topology, idle))
        return {}

    monkeypatch.setattr(mixed, "_tensorrpc", fake)
    for name in ("tensorrpc torch_shm idle (client dials)", "tensorrpc frames (engine dials in)"):
        mixed._case(name, None, None)  # type: ignore[arg-type]
    assert seen == [("torch_shm", "client dials", True), ("frames", "engine dials in", False)]


def test_mixed_report_renders_unavailable_systems() -> None:
    from bench import mixed

    lines = mixed.report(
        {"rate_per_s": 500.0, "systems": {"pyzmq": {"unavailable": "RuntimeError: boom"}}}
    )
    assert "| pyzmq | RuntimeError: boom |||||||||" in lines


def test_the_release_gil_bench_drops_every_kind() -> None:
    proc = _bench("bench.release_gil", "--mib", "4", "--runs", "1", "--switch", "0.05")
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ")]
    kinds = {row[0].removeprefix("| "): row for row in rows[1:]}  # past the header
    assert len(kinds) == 6, proc.stdout
    assert "bytearray" in kinds
    for row in kinds.values():  # drop (ms) | final del (ms) | spinner steps | "k of n"
        assert float(row[1]) >= float(row[2]) >= 0
        assert row[4].endswith("of 1 |")


def test_the_tensor_call_cpu_bench_runs_every_kind() -> None:
    from bench.tensor_call_cpu import measure

    got = measure(number=3, rounds=1)
    assert sorted(got) == ["add", "in", "out", "tiny_in", "torch_in", "torch_new"]
    assert all(cli > 0 and eng > 0 for cli, eng in got.values())


def test_the_shm_alias_cpu_bench_reports_both_ends_of_every_alias_kind() -> None:
    proc = _forkserver.run(
        [sys.executable, "-m", "bench.shm_alias_cpu", "--calls", "3", "--rounds", "1",
         "--new-calls", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    assert sorted(rows) == ["share", "small", "tiny", "torch_new", "torch_shared"]
    for row in rows.values():  # client X µs  engine Y µs (CPU per call)  wall Z µs
        assert float(row[2]) > 0
        assert float(row[5]) > 0
        assert float(row[11]) > 0


def test_quick_compression_section_measures_zstd_against_none(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _forkserver.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "compression", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    cases = results["compression"]["cases"]
    assert set(cases) == {"activations", "token ids", "embeddings"}
    for name in ("activations", "token ids"):
        none, zstd = cases[name]["none"], cases[name]["zstd 1"]
        assert none["wire_bytes_per_call"] > 2 * none["tensor_bytes"]  # there and back
        assert zstd["wire_bytes_per_call"] < 0.8 * none["wire_bytes_per_call"]
        assert zstd["client_cpu_ms"] > 0
    assert "## Compression over tcp loopback" in (out / "bench.md").read_text(encoding="utf-8")
