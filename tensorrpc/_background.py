"""tensorrpc's bulk background threads run below the event loop's scheduling priority.

A large call keeps threads of tensorrpc's own busy for milliseconds: the copies of a
tensor into the shared-memory pool (`tensorrpc.transports._shm_copy.Copier`'s
helpers), the pool's page warmer, and the release thread that unmaps large buffers
(`tensorrpc._release`). On a host with few cores these threads take every core, and a
small call's wake-up on an event loop waits for one: its latency under a mixed load
grows with the large calls' size. Each of these threads therefore lowers its own
scheduling priority when it starts (Linux: a per-thread nice value, default 19), so the
kernel runs an event loop that wakes before it, and the bulk work takes the cores the
loops leave idle. Only threads tensorrpc starts for bulk work are lowered: never the
caller's, the user's, anyio's worker threads or libzmq's.

Why a nice value and not ``SCHED_IDLE``: a group of threads (a cgroup, or the session's
autogroup) whose runnable threads are all ``SCHED_IDLE`` weighs next to nothing against
other groups, and on a shared host its copies then crawl (measured: half the copy
throughput under other sessions' load); at nice 19 they kept their throughput.

The catch: a lowered thread competes badly with busy threads of the same process at the
normal priority. A process whose own threads keep every core busy (a tokenizer pool, say)
starves its bulk copies; `set_background_nice` with None turns the lowering off.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Final

__all__ = ["DEFAULT_NICE", "background_nice", "lower_this_thread", "set_background_nice"]

#: The nice value tensorrpc's bulk threads take by default (the lowest priority).
DEFAULT_NICE: Final = 19
_MAX_NICE: Final = 19

_nice: int | None = DEFAULT_NICE


def background_nice() -> int | None:
    """The nice value bulk threads take when they start (None: they are left as started:
    turned off, or not Linux)."""
    return _nice if sys.platform.startswith("linux") else None


def set_background_nice(nice: int | None) -> None:
    """Set the scheduling priority of tensorrpc's bulk background threads (Linux).

    tensorrpc copies large tensors into shared memory, warms pool pages and frees large
    buffers on threads of its own, so that an event loop never waits for them. At the
    normal priority those threads still take the cores a small call's wake-up needs; at
    a higher nice value the kernel runs the event loop first (docs/transports.md, "Tail
    latency under a mixed load"). Process-wide; a thread takes the value when it starts,
    so call this before the first large call. A thread is only ever lowered: one that
    already runs at a higher nice value keeps it.

    Args:
        nice: ``0`` to ``19`` (default 19, the lowest priority); None leaves the threads
            at the priority of the thread that started them.

    Raises:
        ValueError: A value outside ``0 .. 19``.
    """
    global _nice
    if nice is not None and (type(nice) is not int or not 0 <= nice <= _MAX_NICE):
        raise ValueError(
            f"the background nice value must be 0 .. {_MAX_NICE} or None, not {nice!r}"
        )
    _nice = nice


def lower_this_thread() -> int | None:
    """Lower the calling thread to `background_nice` (each bulk thread calls this first).

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
