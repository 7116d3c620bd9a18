"""examples/shared_memory.py, the zero-copy recipe, runs and its checks hold.

The example asserts the recipe itself (results and a reused input buffer travel by alias,
by content and by the client's torch_shm statistics; a reused engine buffer is seen to
change under the client). Here it runs small, as a real program, in its own process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from bench._measure import shm_files_of
from tests import _forkserver

ROOT = Path(__file__).resolve().parent.parent


def test_shared_memory_recipe_runs(tmp_path: Path) -> None:
    proc = _forkserver.popen(
        [sys.executable, "-m", "examples.shared_memory", "--mib", "4", "--calls", "3"],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
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
    assert "4 MiB results born in shared memory" in out
    assert "input buffer reused by alias" in out
    engine = re.search(r"\(engine pid (\d+)\)", out)
    assert engine is not None, out
    assert list(tmp_path.iterdir()) == [], "the example left files behind"
    # the example's and its engine's files (tests beside this one may have files of their own)
    pids = [proc.pid, int(engine[1])]
    assert shm_files_of(pids) == set(), "the example left /dev/shm segments behind"
