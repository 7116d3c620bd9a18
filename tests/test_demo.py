from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from bench._measure import shm_files_of
from tests import _forkserver

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_small_and_leaves_nothing_behind(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = _forkserver.popen(
        [sys.executable, "-m", "examples.multi_engine_demo", "--engines", "2", "--requests", "24"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    # Not a terminal: rich draws plain text (no escape codes, tables without borders).
    assert "\x1b" not in out + err
    assert "Per engine" in out
    rows = re.findall(r"^\s*(engine-\d+)\s+(\d+)\s+(\d+)\s+(\d+)", out, flags=re.MULTILINE)
    assert {r[0] for r in rows} == {"engine-0", "engine-1"}
    assert sum(int(r[3]) for r in rows) > 0  # tokens were streamed
    assert "24 requests in" in out
    for engine in ("engine-0", "engine-1"):
        # Its latency histogram: one row per bucket, the calls in them add up to its requests.
        section = out.split(f"Latency histogram: {engine}")[1].split("Latency histogram")[0]
        buckets = re.findall(r"^\s*(\d+-\d+|≥\d+)\s+(\d+)", section, flags=re.MULTILINE)
        assert buckets, section
        calls = next(int(r[2]) for r in rows if r[0] == engine)
        assert sum(int(n) for _, n in buckets) == calls
    assert "24/24" in err  # the progress bar, drawn once at the end
    # Issue 24 item 12: what it will do first, a legend, and the verdict last.
    assert err.splitlines()[0].startswith("tensorrpc multi-engine demo: 2 engine processes")
    assert "'timeouts' column" in err
    assert re.search(r"^load: 24 requests, 8 in flight: \d+ text", err, flags=re.MULTILINE)
    assert "timeouts: the calls that timed out on purpose" in out
    planned = int(re.search(r"timed out \(on purpose\)\s+(\d+)", out)[1])  # type: ignore[index]
    timeouts = [int(line.split()[-1]) for line in out.splitlines() if line.startswith("engine-")]
    assert sum(timeouts) == planned  # the column is the planned timeouts
    last = out.strip().splitlines()[-1]
    assert last.startswith("verdict: PASS: all 24 requests ended as planned (")
    assert last.endswith(
        "continuous batching gave every stream the tokens of one at a time; exit status 0"
    )
    # Continuous batching beside one stream at a time (the demo exits 1 if their tokens
    # differ); tokens/s and first-token latency of both.
    comparison = out.split("Continuous batching: 32 streams of 16 tokens")[1]
    figures = dict(
        re.findall(
            r"^\s*(one stream at a time|continuous batching)\s+([\d,]+)\s+[\d.]+\s+[\d.]+",
            comparison,
            flags=re.MULTILINE,
        )
    )
    assert set(figures) == {"one stream at a time", "continuous batching"}
    assert all(int(v.replace(",", "")) > 0 for v in figures.values())
    assert re.search(r"continuous batching: [\d.]+x the tokens/s", comparison)
    for _engine, pid, _requests, _tokens in rows:
        assert not Path(f"/proc/{pid}").exists(), f"engine process {pid} left running"
    assert list(tmp_path.iterdir()) == [], "the demo left files (socket files) behind"
    # the demo's and its engines' files (tests beside this one may have files of their own)
    pids = [proc.pid, *(int(r[1]) for r in rows)]
    assert shm_files_of(pids) == set(), "the demo left /dev/shm segments behind"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_demo_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    # A fresh interpreter, not the zygote: forked from the zygote the demo reached "engines
    # up" sooner, and once in a full run its SIGINT was absorbed by the starting load (exit
    # timed out after 60 s). What is under test is a user's Ctrl-C on a real `python -m`.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "examples.multi_engine_demo",
            "--engines",
            "2",
            "--requests",
            "100000",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    engines: list[int] = []
    try:
        assert proc.stderr is not None
        # Wait (bounded by the demo's own 60 s engine start-up timeout) until the load runs.
        for line in proc.stderr:
            if "engines up" in line:
                engines = _children(proc.pid)
            if line.startswith("load:"):
                break
        assert len(engines) == 2
        proc.send_signal(signal.SIGINT)
        # Ctrl-C in the middle of the load stops it within seconds (1.1 s here). With one
        # task per request (100,000 of them) cancelling took ~47 s on a quiet machine, and
        # over 60 s beside other tests.
        assert proc.wait(timeout=30) == 130
        assert "interrupted" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            # the engines run in their own session: a killed demo cannot stop them
            for pid in engines:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if proc.stderr is not None:
            proc.stderr.close()
    for pid in engines:
        assert not Path(f"/proc/{pid}").exists(), f"engine process {pid} left running"
    assert list(tmp_path.iterdir()) == [], "the demo left files (socket files) behind"


def test_demo_says_what_it_does_before_importing_torch() -> None:
    # A fresh interpreter in which importing torch fails: the first line must already be
    # out (the demo used to start with 5.4 s of silence, most of it torch's import).
    code = (
        "import runpy, sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            raise ImportError('torch imported here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "sys.argv = ['demo', '--engines', '2', '--requests', '5']\n"
        "runpy.run_module('examples.multi_engine_demo', run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    first = done.stderr.splitlines()[0]
    assert first.startswith("tensorrpc multi-engine demo: 2 engine processes"), done.stderr
    assert "torch imported here" in done.stderr


def test_tiny_lm_batched_decode_gives_the_tokens_of_one_sequence_at_a_time() -> None:
    from examples.tiny_lm import Sequence, TinyLM

    model = TinyLM(0)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [42] * 20, [7]]
    expected = [list(model.generate(p, 10)) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    states: dict[int, Sequence] = {}
    for step in range(30):  # sequences join at steps 0..3, as in continuous batching
        decoding = [i for i in states if len(got[i]) < 10]
        if step < len(prompts):
            token, states[step] = model.prefill(prompts[step], 10)
            got[step].append(token)
        if decoding:
            for i, token in zip(decoding, model.decode([states[i] for i in decoding]), strict=True):
                got[i].append(token)
    assert got == expected
