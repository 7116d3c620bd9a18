"""examples/shared_memory.py, the zero-copy recipe, runs and its checks hold.

The example asserts the recipe itself (results and a reused input buffer travel by alias,
by content and by the client's torch_shm statistics; a reused engine buffer is seen to
change under the client). Here it runs small, as a real program, in its own process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests import _forkserver

ROOT = Path(__file__).resolve().parent.parent


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_shared_memory_recipe_runs(tmp_path: Path) -> None:
    shm_before = _shm_entries()
    proc = _forkserver.run(
        [sys.executable, "-m", "examples.shared_memory", "--mib", "4", "--calls", "3"],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 MiB results born in shared memory" in proc.stdout
    assert "input buffer reused by alias" in proc.stdout
    assert list(tmp_path.iterdir()) == [], "the example left files behind"
    assert _shm_entries() <= shm_before, "the example left /dev/shm segments behind"
