"""Large buffers die off the event loop: one release thread, fed through a bounded queue.

Freeing a large buffer is not free: the last reference to a 64 MiB ZMQ frame, tensor or
mapping unmaps it page by page (5-60 ms on a busy host). When that reference drops on
the event loop, every message behind it waits, and a small call made right after a large
one pays for it. The places where tensorrpc itself holds the last reference of a large
buffer (a received message once it is handled, a worker's decoded arguments once the
handler returned, the objects behind a zero-copy send once ZMQ is done with them (a
stream item's too), stream items nobody will read or take, a pool segment or a cached
mapping it drops) hand that reference to `later` instead, and
a daemon thread drops it. The unmapping itself runs without the GIL (``zmq_msg_close``,
torch's tensor free and ctypes' ``munmap`` release it; a ``bytearray``'s free does not:
``python -m bench.release_gil``), so the loop keeps running meanwhile.

Rules:

1. Only objects of at least `threshold` bytes are handed over; smaller ones keep dying
   inline (a queue put and a thread wake-up cost more than their free).
2. The caller hands over a reference **it owns** (a container of its own, or the object
   itself) and drops its own reference right after. The thread waits (bounded) until its
   reference is the only one left before it drops it, so a caller preempted between the
   hand-over and its own ``del`` does not end up freeing on the loop after all.
3. The queue is bounded (`max_queued`): when the thread falls that far behind, `later`
   refuses and the caller's reference dies inline, as before (memory stays bounded).
4. After ``fork()`` the child starts a thread of its own on first use.
5. The interpreter's exit waits (up to 2 s) for the thread to drop what it was given:
   a daemon thread still freeing a tensor while the interpreter finalizes can abort
   the process in torch's static destructors.
6. With `tensorrpc.set_background_nice`, the thread runs below the event loop's priority
   (`tensorrpc._background`).
7. What dies between `hold_back` and `resume` on a thread is handed over in one batch
   by the caller, later: an engine drops a call's arguments before it replies (so that
   the reply can release their leases) and hands them over once the reply is sent, so
   that the thread's wake-up and its unmapping never delay the reply.

Backend-neutral: nothing here knows about asyncio or trio.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Final

from tensorrpc._background import lower_this_thread

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "DEFAULT_THRESHOLD",
    "held_nbytes",
    "hold_back",
    "later",
    "later_if_large",
    "max_queued",
    "nbytes",
    "release_later",
    "resume",
    "set_release_threshold",
    "threshold",
]

#: Buffers of at least this many bytes are released by the thread (1 MiB).
DEFAULT_THRESHOLD: Final = 1 << 20
_DEFAULT_MAX_QUEUED: Final = 256
# How long the thread keeps an object whose caller still holds a reference (rule 2), and
# how often it looks again meanwhile, in seconds. Held objects wait beside each other, so
# one caller that keeps its reference delays no other release.
_PATIENCE: Final = 5.0
_POLL: Final = 0.002
_THREAD_NAME: Final = "tensorrpc-release"
# How long the interpreter's exit waits for the thread to drop what it was given.
_EXIT_WAIT: Final = 2.0

_threshold = DEFAULT_THRESHOLD
_max_queued = _DEFAULT_MAX_QUEUED
_lock = threading.Lock()
_queue: queue.Queue[object] | None = None
_thread: threading.Thread | None = None
_local = threading.local()  # .held: this thread's hand-overs held back (rule 7), or None


def threshold() -> int:
    """The current size (bytes) from which tensorrpc releases buffers off the loop."""
    return _threshold


def max_queued() -> int:
    """How many hand-overs may wait for the release thread before `later` refuses."""
    return _max_queued


def set_release_threshold(nbytes: int, *, max_queued: int | None = None) -> None:
    """Tune which buffers tensorrpc frees on its release thread instead of the event loop.

    Args:
        nbytes: Buffers of at least this many bytes (received messages, decoded
            arguments, sent tensors once ZMQ is done with them, dropped shared-memory
            segments and mappings) are released by the thread; smaller ones die where
            their last reference drops. ``0`` hands over every such buffer; a very
            large value (``sys.maxsize``) turns the thread off. The same size decides
            which torch_shm copies (into the sender's pool, and the private pages of an
            argument an engine still holds when it replies) run on a worker thread
            rather than on the event loop.
        max_queued: Hand-overs that may wait for the thread (default 256); beyond this
            a buffer is freed inline again, so memory stays bounded.

    Raises:
        ValueError: A negative size, or ``max_queued`` below 1.
    """
    global _threshold, _max_queued
    if nbytes < 0:
        raise ValueError(f"the release threshold must be >= 0 bytes, not {nbytes}")
    if max_queued is not None and max_queued < 1:
        raise ValueError(f"max_queued must be >= 1, not {max_queued}")
    with _lock:
        _threshold = nbytes
        if max_queued is not None:
            _max_queued = max_queued
            q = _queue
            if q is not None:
                with q.mutex:  # `Queue.put_nowait` reads `maxsize` under this lock
                    q.maxsize = max_queued


def nbytes(buffers: Iterable[object]) -> int:
    """Total size of ``buffers`` (anything with the buffer protocol)."""
    sizes: list[int] = [memoryview(b).nbytes for b in buffers]  # type: ignore[arg-type]
    return sum(sizes)


def held_nbytes(objects: Iterable[object]) -> int:
    """Total ``nbytes`` of ``objects`` (tensors, arrays, memoryviews; others count 0)."""
    sizes = [getattr(obj, "nbytes", 0) for obj in objects]
    return sum([size for size in sizes if type(size) is int])


def _run(q: queue.Queue[object]) -> None:
    get = q.get
    getrefcount = sys.getrefcount
    monotonic = time.monotonic
    held: list[list[object]] = []  # [give-up time, object], in no order
    markers: list[_Drained] = []
    while True:
        try:
            item = get(timeout=_POLL) if held else get()
        except queue.Empty:
            pass
        else:
            if type(item) is _Drained:
                markers.append(item)
            else:
                held.append([monotonic() + _PATIENCE, item])
                lower_this_thread()  # (a no-op unless set_background_nice asked for it)
            del item
        now = monotonic()
        i = 0
        while i < len(held):
            entry = held[i]
            # The list slot and getrefcount's argument: 2 once the caller dropped its own.
            if getrefcount(entry[1]) <= 2 or entry[0] <= now:  # type: ignore[operator]
                held[i] = held[-1]
                held.pop()
                entry[1] = None  # the free (unmapping) happens here, off the event loop
            else:
                i += 1
        if markers and not held:
            for marker in markers:
                marker.set()
            markers.clear()


def _start() -> queue.Queue[object]:
    global _queue, _thread
    with _lock:
        q = _queue
        if q is None:
            q = _queue = queue.Queue(_max_queued)
            _thread = threading.Thread(target=_run, args=(q,), name=_THREAD_NAME, daemon=True)
            _thread.start()
        return q


class _Drained(threading.Event):
    """A marker: set by the thread once everything queued before it was dropped."""


def drained(timeout: float) -> bool:
    """Wait (at most ``timeout`` seconds) until everything handed over so far was dropped.

    The thread sets a marker put now once it has taken everything queued before it and
    holds nothing back for a caller's reference (tests and shutdown checks use it).
    Returns False on timeout.
    """
    q = _queue
    if q is None:
        return True
    marker = _Drained()
    try:
        q.put(marker, timeout=timeout)
    except queue.Full:
        return False
    return marker.wait(timeout)


def later(obj: object) -> bool:
    """Hand ``obj`` to the release thread (rule 2: drop your own reference right after).

    Returns:
        True when the thread took it; False when its queue is full (then ``obj`` dies
        wherever its last reference drops, as if this had not been called).
    """
    held: list[object] | None = getattr(_local, "held", None)
    if held is not None:
        held.append(obj)
        return True
    q = _queue
    if q is None:
        q = _start()
    try:
        q.put_nowait(obj)
    except queue.Full:
        return False
    return True


def hold_back() -> list[object]:
    """Hold this thread's hand-overs back (rule 7) until `resume`.

    Returns:
        The list they are appended to; the caller hands it to `later` when the moment
        is right (and drops its own reference right after, as rule 2 asks).
    """
    held: list[object] = []
    _local.held = held
    return held


def resume() -> None:
    """Hand-overs on this thread go to the release thread again (see `hold_back`)."""
    _local.held = None


def later_if_large(obj: object, size: int) -> bool:
    """`later` when ``size`` (the bytes ``obj`` keeps alive) reaches the threshold."""
    if size >= _threshold:
        return later(obj)
    return False


def release_later(obj: object) -> bool:
    """Drop ``obj`` on tensorrpc's release thread instead of the caller's thread.

    A large tensor (or array, or buffer) freed on an event loop stalls every task on it
    while its pages are unmapped (milliseconds for tens of MiB). Hand it over instead
    and drop your own references right after:

    ```python
    result = await stub.embed(batch)
    use(result)
    tensorrpc.release_later(result)
    del result
    ```

    The thread drops its reference once it holds the only one (it waits up to
    5 s for yours to go). Any size is taken; the threshold of
    `set_release_threshold` only applies to tensorrpc's own buffers.

    Args:
        obj: Any object; a list of several is fine.

    Returns:
        True when the thread took it; False when its queue was full (then ``obj`` dies
        where its last reference drops).
    """
    return later(obj)


def _after_fork_in_child() -> None:
    global _queue, _thread, _lock
    _lock = threading.Lock()  # the parent's may have been held by a thread gone here
    _queue = None  # the parent's thread does not exist here
    _thread = None


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(drained, _EXIT_WAIT)  # rule 5
