"""With `set_background_nice("idle")`, libzmq's bulk I/O thread runs under
``SCHED_IDLE`` once a bulk connection is up, and its control I/O thread never does.

Run in a child process: the policy of a libzmq thread stays for the process's life,
and a test worker's own context must keep its threads at the normal priority.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's"
)

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import anyio, torch
    import tensorrpc
    from tensorrpc import rpc, service
    from tensorrpc import _bulk_io
    from tensorrpc.testing import serve_engines

    @service
    class Sizes:
        @rpc
        async def size(self, t: torch.Tensor) -> int:
            return t.numel()

    def policies():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            if name.startswith("ZMQbg/IO/"):
                out.setdefault(name, set()).add(os.sched_getscheduler(int(tid)))
        return out

    bound = []
    lower = _bulk_io.lower_zmq_bulk_thread

    def lower_and_note():  # called as a bulk connection is bound, on either end
        bound.append(lower())

    _bulk_io.lower_zmq_bulk_thread = lower_and_note

    async def main():
        if sys.argv[2] == "idle":
            tensorrpc.set_background_nice("idle")
        big = torch.zeros(1 << 19)  # 2 MiB: a bulk message
        async with serve_engines(Sizes, address=f"ipc://{sys.argv[1]}/c.sock") as client:
            frames = client.with_options(transport="frames")
            deadline = time.monotonic() + 20
            while len(bound) < 2 and time.monotonic() < deadline:  # both ends attached
                assert await frames.call(Sizes.size, big) == big.numel()
        print(len(bound), sorted((k, sorted(v)) for k, v in policies().items()))

    anyio.run(main)
    """
)


@pytest.mark.parametrize("nice", ["idle", "none"])
def test_the_bulk_io_thread_alone_goes_idle(tmp_path: Path, nice: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), nice],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    idle, other = 5, 0  # os.SCHED_IDLE, os.SCHED_OTHER
    want = [("ZMQbg/IO/0", [other]), ("ZMQbg/IO/1", [idle if nice == "idle" else other])]
    assert done.stdout.strip() == f"2 {want!r}"
