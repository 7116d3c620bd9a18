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
threads that do bulk work are lowered: the threads tensorrpc starts for it, and
libzmq's second I/O thread, to which tensorrpc pins its bulk connections (the large
frames' bytes cross the socket there); never the caller's, the user's, anyio's worker
threads, or libzmq's first I/O thread, which carries the control connections.

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

__all__ = [
    "IDLE",
    "LOWEST",
    "background_nice",
    "lower_this_thread",
    "lower_zmq_bulk_thread",
    "set_background_nice",
]

#: The lowest nice value.
LOWEST: Final = 19
#: Below every nice value: the ``SCHED_IDLE`` policy.
IDLE: Final = "idle"
#: libzmq's name for its second I/O thread, where tensorrpc pins bulk sockets
#: (``ZMQ_AFFINITY`` 2, `tensorrpc._zmq.create_socket`'s ``bulk``).
ZMQ_BULK_THREAD: Final = "ZMQbg/IO/1"

_nice: int | Literal["idle"] | None = None
#: Whether this process lowered libzmq's bulk I/O thread(s) (`lower_zmq_bulk_thread`).
_zmq_lowered = False


def background_nice() -> int | Literal["idle"] | None:
    """The nice value (or ``"idle"``) bulk threads take when they start (None: they are
    left as started: turned off, or not Linux)."""
    return _nice if sys.platform.startswith("linux") else None


def set_background_nice(nice: int | Literal["idle"] | None) -> None:
    """Run tensorrpc's bulk background threads at the nice value ``nice`` (Linux).

    tensorrpc copies large tensors into shared memory, warms pool pages and frees large
    buffers on threads of its own, so that an event loop never waits for them, and
    libzmq moves large frames on its second I/O thread, where tensorrpc pins its bulk
    connections (lowered too, once a bulk connection is bound). At the
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
    return _lower(threading.get_native_id(), nice)


def _lower(tid: int, nice: int | Literal["idle"]) -> int | Literal["idle"] | None:
    """Lower thread ``tid`` of this process to ``nice``; what it runs at afterwards
    (None: refused)."""
    try:
        if isinstance(nice, str):  # IDLE
            # (a thread id: that thread alone; lowering a policy needs no privilege)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return IDLE
        # (PRIO_PROCESS with a thread id: that thread alone, on Linux)
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # pragma: no cover - a seccomp profile that refuses setpriority
        return None


def lower_zmq_bulk_thread(tasks: str = "/proc/self/task") -> bool:
    """Lower libzmq's bulk I/O thread to `background_nice` (the bulk links call this
    when a bulk connection is set up; after the first success it costs a flag test).

    The threads of this process named `ZMQ_BULK_THREAD` (``tasks``: where the
    kernel lists them) are lowered. libzmq serves every socket pinned to its second I/O
    thread there: tensorrpc's bulk sockets, and a socket of your own on the same context
    that libzmq happens to place there. Returns whether such a thread is lowered now
    (False: turned off, not Linux, none found yet, or refused).
    """
    global _zmq_lowered
    nice = background_nice()
    if _zmq_lowered or nice is None:
        return _zmq_lowered
    try:
        names = os.listdir(tasks)
    except OSError:  # pragma: no cover - no /proc
        return False
    found = False
    for name in names:
        try:
            with open(os.path.join(tasks, name, "comm"), encoding="utf-8") as f:
                comm = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue  # (a thread that ended meanwhile)
        if comm == ZMQ_BULK_THREAD and name.isdigit() and _lower(int(name), nice) is not None:
            found = True
    _zmq_lowered = found
    return found


def _after_fork_in_child() -> None:
    global _zmq_lowered
    _zmq_lowered = False  # (a child's libzmq threads are its own, started anew)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
