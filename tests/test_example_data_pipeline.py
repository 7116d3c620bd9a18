"""examples/data_pipeline.py, a DataLoader with workers feeding an engine, runs as promised.

The example checks every answer against the same computation done in the client, and
exits 0 only if every batch was written into one of `SharedBatches`' slots and went by
alias (the client's torch_shm statistics: tensors sent with no copy). Here it runs
small, as a real program, in its own process, once for both tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from bench._measure import shm_files_of
from tensorrpc.transports.torch_shm import TorchShmTransport
from tests import _forkserver

ROOT = Path(__file__).resolve().parent.parent
BATCHES = 4

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)


class Run(NamedTuple):
    returncode: int
    out: str
    pids: list[int]
    leftovers: list[Path]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("pipeline")
    proc = _forkserver.popen(
        [sys.executable, "-m", "examples.data_pipeline", "--batches", str(BATCHES)],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    engine = re.search(r"\(engine pid (\d+)\)", out)
    pids = [proc.pid] + ([int(engine[1])] if engine else [])
    return Run(proc.returncode, out + err, pids, list(tmp.iterdir()))


def test_the_engine_reads_every_batch_and_nothing_is_left_behind(run: Run) -> None:
    assert f"{BATCHES} DataLoader batches read by the engine, every answer checked" in run.out
    assert len(run.pids) == 2, run.out
    assert run.leftovers == [], "the example left files behind"
    assert shm_files_of(run.pids) == set(), "the example left /dev/shm files behind"


def test_every_batch_goes_by_alias(run: Run) -> None:
    assert f"{BATCHES} of {BATCHES} image batches went by alias" in run.out, run.out
    assert f"{BATCHES} of {BATCHES} batches were written into a slot (0 missed one)" in run.out
    assert run.returncode == 0, run.out
