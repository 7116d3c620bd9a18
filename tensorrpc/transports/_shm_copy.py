"""Large copies split over threads: the sender's copy of a tensor into its pool.

One ``memmove`` of 64 MiB keeps one core busy for several milliseconds while the others
idle, and one core does not reach the machine's memory bandwidth. `Copier` cuts a large
copy into a few pieces that helper threads (and, at times, the calling thread) take in
turn (each piece is one ``memmove``, without the GIL). On an idle machine a copy runs on
up to `Copier.threads` cores at once.

By default the caller copies too, as one of the threads, and takes whatever no helper
has taken yet: a helper the scheduler does not run (a busy host) holds the copy up by
nothing, one that stalls in the middle of its piece by that piece at most. With
`tensorrpc.set_background_nice` the helpers run below the event loop's priority
(`tensorrpc._background`), so that a small call's wake-up does not wait for a core
behind the copy; the caller (a worker thread at the normal priority) then leaves the
pieces to them and joins in only when they copy slower than `SLOWEST` (threads at the
normal priority leave them no core).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
import weakref
from typing import Final

from tensorrpc._background import background_nice, lower_this_thread

__all__ = ["MIN_PIECE", "SLOWEST", "SPLIT_BYTES", "Copier", "default_threads", "set_copy_threads"]

#: Copies smaller than this are one ``memmove`` on the calling thread (waking a helper
#: costs more than it saves).
SPLIT_BYTES: Final = 8 << 20
#: The smallest piece: each piece costs its thread one turn of the GIL.
MIN_PIECE: Final = 4 << 20
#: Pieces per thread: enough for the caller to take over a helper's share that has not
#: started, few enough that the GIL is taken only a handful of times per copy.
PIECES_PER_THREAD: Final = 2
#: Most threads one copy uses: beyond about four, cores share the
#: memory bandwidth and a copy gets no faster.
MAX_THREADS: Final = 4
#: Bytes per second below which lowered helpers are deemed starved: the caller waits for
#: them ``nbytes / SLOWEST`` seconds at most before it takes the pieces left (1 GiB/s:
#: a single core copies several times faster).
SLOWEST: Final = 1 << 30


_threads: int | None = None  # `set_copy_threads`


def set_copy_threads(threads: int | None) -> None:
    """How many threads one large torch_shm copy uses, in every transport made after this.

    A copy into the shared-memory pool of 8 MiB or more is split over several threads,
    by default as many as the cores this process may run on, at most four: one thread's
    ``memmove`` does not reach the memory bandwidth. On a host with few cores those
    threads take every core for the milliseconds of a large copy, and small calls beside
    it wait, even with ``set_background_nice("idle")``: the copies saturate the memory
    bandwidth the loops need too. ``1`` leaves the cores but one to everything else (on
    the 2-core benchmark machine, with ``"idle"``, the small calls' p99 under a 64 MiB
    torch_shm load fell from 4.1-5.2 ms to 2.0-2.4 ms, for 10-25 % of the large calls'
    throughput; docs/transports.md, "Tail latency under a mixed load").

    Process-wide, like `tensorrpc.set_background_nice`: a `Client` or `serve` made
    afterwards uses it; ``TorchShmTransport(copy_threads=...)`` still decides for one
    transport.

    Args:
        threads: ``1`` to `MAX_THREADS` (4); None (the default): the cores, at most four.

    Raises:
        ValueError: Any other value.
    """
    global _threads
    if threads is not None and (type(threads) is not int or not 1 <= threads <= MAX_THREADS):
        raise ValueError(f"copy threads must be 1 .. {MAX_THREADS} or None, not {threads!r}")
    _threads = threads


def default_threads() -> int:
    """Threads a copy may use: what `set_copy_threads` set, else the cores this process
    may run on, at most `MAX_THREADS`.

    Every core: one thread's ``memmove`` does not reach the memory bandwidth, and a new
    64 MiB tensor each call is copied in 0.95x the time of one thread's ``copy_`` with two
    threads on two cores, 1.23x with one. The price is the small calls' tail under a
    mixed load on a small host (docs/transports.md, *Large copies use several cores*);
    ``TorchShmTransport(copy_threads=1)`` pays the other way.
    """
    if _threads is not None:
        return _threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


class _Copy:
    """One copy, cut into ``pieces``; each thread that joins takes pieces until none is
    left. ``done`` is set once every piece is copied."""

    __slots__ = ("done", "dst", "left", "lock", "nbytes", "next", "pieces", "src", "step")

    def __init__(self, dst: int, src: int, nbytes: int, pieces: int) -> None:
        self.dst = dst
        self.src = src
        self.nbytes = nbytes
        self.pieces = pieces
        step = -(-nbytes // pieces)
        self.step = step + (-step % 64)  # pieces start on a cache line of the destination
        self.next = itertools.count()  # (next() on it is atomic: one thread per piece)
        self.left = pieces
        self.lock = threading.Lock()
        self.done = threading.Event()

    def work(self) -> None:
        """Copy pieces until none is left to take."""
        while (i := next(self.next)) < self.pieces:
            off = i * self.step
            try:
                if off < self.nbytes:
                    n = min(self.step, self.nbytes - off)
                    ctypes.memmove(self.dst + off, self.src + off, n)
            finally:  # (counted whatever happens: the caller waits for every piece)
                with self.lock:
                    self.left -= 1
                    if not self.left:
                        self.done.set()


class Copier:
    """Copies large ranges of memory on helper threads and the calling thread (see the
    module docstring). Thread-safe.

    Helpers start with the first large copy and wait for work on a queue: ``threads``
    of them, lowered (`tensorrpc._background`), when the lowering is on as they start,
    else ``threads - 1`` beside the caller. `close` joins them (a copier dropped without
    it stops them too), and a forked child starts its own.

    Args:
        threads: most threads one copy uses (None: `default_threads`; 1: every copy is
            one ``memmove`` on one thread: the caller's, or a lowered helper's).
    """

    def __init__(self, threads: int | None = None) -> None:
        #: Most threads one copy uses.
        self.threads = default_threads() if threads is None else max(1, threads)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Copy | None] = queue.SimpleQueue()
        self._helpers: list[threading.Thread] = []
        #: Whether the caller leaves the pieces to the helpers (they are lowered).
        self._yields = False
        self._pid = os.getpid()
        self._closed = False
        self._stop: weakref.finalize[..., Copier] | None = None

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to address ``dst`` (ranges must not
        overlap, and both must stay mapped until this returns)."""
        pieces = min(self.threads * PIECES_PER_THREAD, nbytes // MIN_PIECE)
        helpers = self._started() if nbytes >= SPLIT_BYTES and pieces > 1 else 0
        if not helpers:
            ctypes.memmove(dst, src, nbytes)
            return
        job = _Copy(dst, src, nbytes, pieces)
        for _ in range(helpers):
            self._queue.put(job)
        if self._yields:  # lowered helpers: theirs, unless they are starved
            job.done.wait(nbytes / SLOWEST)
        job.work()
        # Pieces taken by helpers finish in bounded time (a memmove between mapped pages).
        job.done.wait()

    def _started(self) -> int:
        """The number of helpers, started if need be (0: closed, or the caller alone)."""
        with self._lock:
            if self._closed:
                return 0
            if self._pid != os.getpid():  # a forked child: its parent's helpers are not here
                self._pid = os.getpid()
                self._helpers = []
                self._queue = queue.SimpleQueue()
                self._stop = None
            if not self._helpers:
                yields = background_nice() is not None
                count = self.threads if yields else self.threads - 1
                if not count:
                    return 0
                self._yields = yields
                for _ in range(count):
                    thread = threading.Thread(
                        target=self._help,
                        args=(self._queue,),
                        name="tensorrpc-shm-copy",
                        daemon=True,
                    )
                    thread.start()
                    self._helpers.append(thread)
                # (the helpers hold the queue, not the copier: it may die without `close`)
                self._stop = weakref.finalize(self, _stop, self._queue, len(self._helpers))
            return len(self._helpers)

    @staticmethod
    def _help(jobs: queue.SimpleQueue[_Copy | None]) -> None:
        lower_this_thread()
        while (job := jobs.get()) is not None:
            job.work()  # (a job already done: no piece is left, nothing happens)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the helpers (bounded); later copies run on the caller's thread alone."""
        with self._lock:
            self._closed = True
            helpers, self._helpers = self._helpers, []
            stop, self._stop = self._stop, None
            if self._pid != os.getpid():
                return  # a forked child: none of these threads exists here
        if stop is not None:
            stop()
        for thread in helpers:
            thread.join(timeout)


def _stop(jobs: queue.SimpleQueue[_Copy | None], helpers: int) -> None:
    for _ in range(helpers):
        jobs.put(None)
