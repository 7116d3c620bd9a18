"""Optionally, tensorrpc's bulk background threads run below the event loop's priority.

A large call keeps threads of tensorrpc's own busy for milliseconds: the copies of a
tensor into the shared-memory pool (`tensorrpc.transports._shm_copy.Copier`'s
helpers), the pool's page warmer, and the release thread that unmaps large buffers
(`tensorrpc._release`). On a host with few cores these threads take the cores that a
small call's wake-up on an event loop needs. `set_background_nice` makes each of them
lower its own scheduling priority (Linux: a per-thread nice value, or the ``SCHED_IDLE``
policy with ``"idle"``), so the kernel runs an event loop that wakes before them. A nice
value only weighs the share: a waking loop may still wait a slice for a core. A
``SCHED_IDLE`` thread gives its core up at once to any other thread that wakes, so the
loop never waits for it; measured on the 2-core benchmark machine it took the client's
wake-up lag under a 64 MiB torch_shm load from 5 ms to the idle machine's 1.2 ms. Only
threads tensorrpc starts for bulk work are lowered: never the caller's, the user's,
anyio's worker threads or libzmq's.

Off by default: the kernel shares the CPU between cgroups (and sessions' autogroups) by
the weight of their runnable threads, so a process whose only runnable threads are
lowered ones gets next to no CPU against other groups' work, and its large copies slow
down whenever anything else runs on the host (with ``"idle"``, to a crawl: such a thread
weighs 3 against a normal thread's 1024) (docs/transports.md, "Tail latency under a
mixed load", has the figures: on the 2-core benchmark machine, quiet, it took a tenth
to a quarter off the small calls' p99 under a 64 MiB load for 10-20 % of the large
calls' throughput; shared with other sessions' work, no consistent gain for half).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Final, Literal

__all__ = ["IDLE", "LOWEST", "background_nice", "lower_this_thread", "set_background_nice"]

#: The lowest nice value.
LOWEST: Final = 19
#: Below every nice value: the ``SCHED_IDLE`` policy.
IDLE: Final = "idle"

_nice: int | Literal["idle"] | None = None


def background_nice() -> int | Literal["idle"] | None:
    """The nice value (or ``"idle"``) bulk threads take when they start (None: they are
    left as started: turned off, or not Linux)."""
    return _nice if sys.platform.startswith("linux") else None


def set_background_nice(nice: int | Literal["idle"] | None) -> None:
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
        nice: ``0`` to ``19`` (`LOWEST`, the lowest nice value); ``"idle"`` (`IDLE`):
            the ``SCHED_IDLE`` policy, below every nice value (a thread that runs only
            on a core nothing else wants, and leaves it the moment an event loop
            wakes: the lowest tail latency for small calls beside large ones, and the
            slowest large calls on a busy host); None (the default) leaves the threads
            at the priority of the thread that started them.

    Raises:
        ValueError: A value outside ``0 .. 19``, ``"idle"`` and None.
    """
    global _nice
    if nice is not None and nice != IDLE and (type(nice) is not int or not 0 <= nice <= LOWEST):
        raise ValueError(
            f"the background nice value must be 0 .. {LOWEST}, {IDLE!r} or None, not {nice!r}"
        )
    _nice = nice


def lower_this_thread() -> int | Literal["idle"] | None:
    """Lower the calling thread to `background_nice` (each bulk thread calls this).

    Linux only (elsewhere ``setpriority`` would apply to the whole process): returns the
    thread's nice value afterwards (``"idle"`` once it runs under ``SCHED_IDLE``), or
    None where nothing was changed (turned off, not Linux, or refused).
    """
    nice = background_nice()
    if nice is None:
        return None
    try:
        if isinstance(nice, str):  # IDLE
            # (pid 0: the calling thread alone; lowering a policy needs no privilege)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return IDLE
        tid = threading.get_native_id()
        # (PRIO_PROCESS with a thread id: that thread alone, on Linux)
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # pragma: no cover - a seccomp profile that refuses setpriority
        return None
