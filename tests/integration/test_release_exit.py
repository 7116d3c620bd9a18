"""The release thread at interpreter exit, in a fresh interpreter of its own."""

from __future__ import annotations

import subprocess
import sys

_EXIT_SCRIPT = """
import time
from tensorrpc import _release

class Slow:
    def __del__(self):
        time.sleep(0.3)  # a slow free (a large unmap), running on the release thread
        print("freed", flush=True)

obj = Slow()
assert _release.later(obj)
del obj
"""


def test_the_interpreter_exit_waits_for_what_the_thread_was_given() -> None:
    # A daemon thread still freeing when the interpreter finalizes is frozen there (or,
    # freeing a tensor, can run into torch's static destructors and abort the process).
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "freed\n"
