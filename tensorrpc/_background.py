"""Optionally, tensorrpc's bulk background threads run below the event loop's priority.

A large call keeps threads of tensorrpc's own busy for milliseconds: the copies of a
tensor into the shared-memory pool (`tensorrpc.transports._shm_copy.Copier`'s
helpers), the pool's page warmer, and the release thread that unmaps large buffers
(`tensorrpc._release`). On a host with few cores these threads take the cores that a
small call's wake-up on an event loop needs. `set_background_nice` makes each of them
lower its own scheduling priority (Linux: a per-thread nice value), so the kernel runs
an event loop that wakes before them. Only threads tensorrpc starts for bulk work are
lowered: never the caller's, the user's, anyio's worker threads or libzmq's.

Off by default: the kernel shares the CPU between cgroups (and sessions' autogroups) by
the weight of their runnable threads, so a process whose only runnable threads are
lowered ones gets next to no CPU against other groups' work, and its large copies slow
down whenever anything else runs on the host (docs/transports.md, "Tail latency under a
mixed load", has the figures: on the 2-core benchmark machine, quiet, it took a tenth
to a quarter off the small calls' p99 under a 64 MiB load for 10-20 % of the large
calls' throughput; shared with other sessions' work, no consistent gain for half).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Final

__all__ = ["LOWEST", "background_nice", "lower_this_thread", "set_background_nice"]

#: The nice value `set_background_nice` suggests (the lowest priority).
LOWEST: Final = 19

_nice: int | None = None


def background_nice() -> int | None:
    """The nice value bulk threads take when they start (None: they are left as started:
    turned off, or not Linux)."""
    return _nice if sys.platform.startswith("linux") else None


def set_background_nice(nice: int | None) -> None:
    """Run tensorrpc's bulk background threads at the nice value ``nice`` (Linux).

    tensorrpc copies large tensors into shared memory, warms pool pages and frees large
    buffers on threads of its own, so that an event loop never waits for them. At the
    normal priority those threads still take the cores a small call's wake-up needs; at
    a higher nice value the kernel runs the event loop first. The price: against other
    processes' work on the host the lowered threads get little CPU, and large calls slow
    down (docs/transports.md, "Tail latency under a mixed load"): for a host or cpuset
    the service has to itself. Process-wide: the copy helpers and the pool warmer take
    the value when they start (call this before the first large call), the release
    thread with its next buffer. A thread is only ever lowered: back to None, threads
    already lowered stay so (raising a priority takes a privilege).

    Args:
        nice: ``0`` to ``19`` (`LOWEST`, the lowest priority); None (the default) leaves
            the threads at the priority of the thread that started them.

    Raises:
        ValueError: A value outside ``0 .. 19``.
    """
    global _nice
    if nice is not None and (type(nice) is not int or not 0 <= nice <= LOWEST):
        raise ValueError(f"the background nice value must be 0 .. {LOWEST} or None, not {nice!r}")
    _nice = nice


def lower_this_thread() -> int | None:
    """Lower the calling thread to `background_nice` (each bulk thread calls this).

    Linux only (elsewhere ``setpriority`` would apply to the whole process): returns the
    thread's nice value afterwards, or None where nothing was changed (turned off, not
    Linux, or refused).
    """
    nice = background_nice()
    if nice is None:
        return None
    try:
        tid = threading.get_native_id()
        # (PRIO_PROCESS with a thread id: that thread alone, on Linux)
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # pragma: no cover - a seccomp profile that refuses setpriority
        return None
