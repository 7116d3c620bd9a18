"""Memory plumbing for the ``torch_shm`` transport: mappings, memfd segments, buffer reuse.

Three pieces, none of which knows about handles or the wire:

* `map_shared` maps a file descriptor with ``mmap(2)`` through ctypes and returns a
  ``uint8`` tensor over the mapping. The mapping is unmapped when the last tensor viewing
  it dies, and it holds **no file descriptor** (Python's `mmap.mmap` keeps a
  ``dup()`` of the descriptor open for as long as it lives, which would cost one
  descriptor per received tensor).
* `SegmentPool` owns ``memfd_create(2)`` segments (nothing is ever named in
  ``/dev/shm``, so nothing can be left there, even after ``kill -9``) and hands out
  64-byte aligned regions of them with a first-fit free list. Segments are kept and reused:
  creating and faulting in a fresh segment per transfer costs several times the copy.
  **Each segment belongs to one peer** (its *owner*): a receiver maps whole segments, so
  a segment that ever held one peer's region is never given to another; a peer's mapping
  reaches its own regions only, never those leased to other peers.
* `fill` copies into a region. Pages the segment has never had are written with
  ``pwrite(2)``: the kernel allocates them already filled (a page fault per 4 KiB page
  instead zeroes each page, then copies; about twice the cost for 64 MiB). A background
  thread then maps those pages into our own mapping (``MADV_POPULATE_WRITE``), off the
  caller's path, so the next copy into them is a plain ``memmove`` with no fault.
* `BufferCache` recycles the receiver's private destination buffers for large
  tensors: when the user drops a received tensor its pages go back to a free list instead
  of to the kernel, so the next copy-out writes to pages that are already faulted in.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import threading
from typing import TYPE_CHECKING

from tensorrpc._background import lower_this_thread
from tensorrpc._lazy import LazyModule
from tensorrpc._release import later_if_large

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    import torch

    from tensorrpc.transports._shm_copy import Copier
else:
    torch = LazyModule("torch", globals())

__all__ = [
    "PAGE_SIZE",
    "REGION_ALIGN",
    "REGION_HEADER",
    "BufferCache",
    "Segment",
    "SegmentPool",
    "Warmer",
    "map_shared",
    "cold",
    "fill",
    "mark_warm",
    "map_shared_owned",
    "memfd_device",
    "pid",
    "privatize",
]

#: Memory page size; window mappings start on a page boundary.
PAGE_SIZE = mmap.PAGESIZE
#: Every pool region starts and ends on this boundary (a cache line).
REGION_ALIGN = 64
#: Bytes in front of each pool region's data: a little-endian u64 tag, then padding.
REGION_HEADER = 64

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def pid() -> int:
    """This process's id, without a system call (``getpid`` is one on every call, and the
    transport asks on every tensor whether it was forked; refreshed in a forked child)."""
    return _pid


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
]
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): fault pages in writable, in one call.
_MADV_POPULATE_WRITE = 23
#: Granule of a segment's record of which pages our mapping has faulted in.
WARM_CHUNK = 2 << 20


def _mmap(fd: int, length: int, offset: int, flags: int) -> int:
    addr = _libc.mmap(None, length, _PROT_RW, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return int(addr)


class _Unmapper:
    """Unmaps (or recycles) one mapping when the ctypes array holding it dies."""

    __slots__ = ("addr", "length", "recycle")

    def __init__(self, addr: int, length: int, recycle: Callable[[int, int], bool] | None) -> None:
        self.addr = addr
        self.length = length
        self.recycle = recycle

    def __del__(self) -> None:
        try:
            if self.recycle is not None and self.recycle(self.addr, self.length):
                return
            _libc.munmap(self.addr, self.length)
        except Exception:  # pragma: no cover - interpreter shutdown: the OS unmaps anyway
            pass


def _tensor_over(
    addr: int, length: int, recycle: Callable[[int, int], bool] | None = None
) -> torch.Tensor:
    """A uint8 tensor over ``length`` bytes at ``addr`` that owns the mapping."""
    array = (ctypes.c_char * length).from_address(addr)
    # The tensor keeps `array` alive and `array` keeps the unmapper alive: the memory goes
    # away exactly when the last view of it does, never earlier.
    array._tensorrpc_unmapper = _Unmapper(addr, length, recycle)  # type: ignore[attr-defined]
    return torch.frombuffer(array, dtype=torch.uint8)


def map_shared(
    fd: int, length: int, offset: int = 0, *, populate: bool = False, unmap_later: bool = False
) -> torch.Tensor:
    """Map ``length`` bytes of ``fd`` from ``offset`` (a page multiple), shared and writable.

    Args:
        fd: an open file descriptor; it may be closed as soon as this returns.
        length: bytes to map (> 0).
        offset: file offset, a multiple of `PAGE_SIZE`.
        populate: fault every page in now (one system call instead of one fault per page).
        unmap_later: when the last view dies, a mapping of at least the release
            threshold is unmapped by the release thread (`tensorrpc._release`), not
            by the thread that dropped it.

    Returns:
        A ``uint8`` tensor over the mapping; the mapping lives as long as it or any view.

    Raises:
        OSError: the kernel refused the mapping.
    """
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
    return _tensor_over(_mmap(fd, length, offset, flags), length, _later if unmap_later else None)


def _later(addr: int, length: int) -> bool:
    # (an unmapper of its own, handed to the release thread: it unmaps when dropped there)
    return later_if_large(_Unmapper(addr, length, None), length)


def map_shared_owned(fd: int, length: int, *, on_unmap: Callable[[int, int], None]) -> torch.Tensor:
    """Map all ``length`` bytes of ``fd`` and give the descriptor to the mapping.

    When the last view of the mapping dies, ``on_unmap(addr, fd)`` runs (it must close
    ``fd``), then the memory is unmapped.
    """
    addr = _mmap(fd, length, 0, mmap.MAP_SHARED)

    def recycle(addr: int, _length: int) -> bool:
        on_unmap(addr, fd)
        return False

    return _tensor_over(addr, length, recycle)


def privatize(addr: int, length: int) -> None:
    """Give the pages under ``addr .. addr+length`` private copies of their bytes, in place.

    The pages of a shared mapping are replaced by anonymous pages holding the same bytes,
    in one step for concurrent readers (``mremap`` onto them): tensors viewing them keep
    their values, and later writes to the shared file no longer show there. Bytes of
    neighbours in the first and last page are copied too (they keep their values as well).

    Raises:
        OSError: the kernel refused (out of memory).
    """
    start = addr - addr % PAGE_SIZE
    n = _round_up(addr + length, PAGE_SIZE) - start
    new = _mmap(-1, n, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ctypes.memmove(new, start, n)
    got = _libc.mremap(new, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        _libc.munmap(new, n)
        raise OSError(err, f"mremap failed: {os.strerror(err)}")


def memfd_device() -> int:
    """The ``st_dev`` shared by every (non-hugetlb) memfd on this kernel."""
    fd = os.memfd_create("tensorrpc-probe", os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Segment:
    """One sealed memfd, mapped once, carved into regions by a first-fit free list.

    Args:
        name: the memfd's name.
        size: its size in bytes (sealed: it never changes).
        owner: the one peer whose regions it holds (see `SegmentPool`).
    """

    __slots__ = ("dev", "fd", "free", "ino", "name", "owner", "size", "used", "view", "warm")

    def __init__(self, name: str, size: int, owner: Hashable = None) -> None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # A peer that maps this segment must never see it shrink under its feet
            # (SIGBUS): seal the size for good.
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            st = os.fstat(fd)
            view = map_shared(fd, size)
        except BaseException:
            os.close(fd)
            raise
        #: memfd name (shown as ``/memfd:<name> (deleted)`` in ``/proc/<pid>/fd``).
        self.name = name
        self.fd = fd
        self.size = size
        self.dev = st.st_dev
        self.ino = st.st_ino
        #: ``uint8`` tensor over the whole segment.
        self.view = view
        #: Free ranges as ``[offset, size]`` pairs, sorted by offset, never adjacent.
        self.free: list[list[int]] = [[0, size]]
        self.used = 0
        self.owner = owner
        #: Per `WARM_CHUNK` of the segment: 1 once our mapping has its pages (a ``memmove``
        #: into it faults nothing); 0 while they may be absent (`fill` uses ``pwrite``).
        self.warm = bytearray(-(-size // WARM_CHUNK))

    def alloc(self, n: int) -> int | None:
        """Take ``n`` bytes (a multiple of `REGION_ALIGN`); return the offset or None."""
        for i, block in enumerate(self.free):
            off, size = block
            if size >= n:
                if size == n:
                    del self.free[i]
                else:
                    block[0] = off + n
                    block[1] = size - n
                self.used += n
                return off
        return None

    def release(self, off: int, n: int) -> None:
        """Give back a range taken by `alloc`, merging it with free neighbours."""
        self.used -= n
        i = bisect.bisect_left(self.free, [off, 0])
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:
            self.free[i - 1][1] += n
            if i < len(self.free) and self.free[i - 1][0] + self.free[i - 1][1] == self.free[i][0]:
                self.free[i - 1][1] += self.free[i][1]
                del self.free[i]
        elif i < len(self.free) and off + n == self.free[i][0]:
            self.free[i][0] = off
            self.free[i][1] += n
        else:
            self.free.insert(i, [off, n])

    def close(self) -> None:
        """Close the descriptor; the mapping goes when the last view of it does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        view, self.view = self.view, torch.empty(0, dtype=torch.uint8)
        later_if_large(view, self.size)  # unmapped off the event loop


class _Retired:
    """The owner of segments whose peer is gone: closed as soon as they empty."""

    __slots__ = ()


class SegmentPool:
    """Sender-side pool of reusable memfd segments (not thread-safe: the caller locks).

    Every segment has one owner (the peer its regions are leased to): a region for a peer
    is carved only from that peer's segments, because a receiver maps whole segments and
    would otherwise reach regions leased to other peers. A peer's first segment is small
    (``min_segment_bytes``); each new one doubles what the peer has, up to
    ``segment_bytes``. Pages are only allocated where regions were written, so a large,
    sparsely used segment costs little memory.

    Args:
        prefix: memfd name prefix; segments are named ``<prefix><pid>-<n>``.
        segment_bytes: largest ordinary segment; a larger request gets a segment of its
            own, rounded up to 2 MiB.
        max_bytes: the pool never holds more than this in segments (busy or idle).
        keep_bytes: idle segments beyond this total are closed as soon as they empty,
            except each peer's last ordinary segment (closed under ``max_bytes`` pressure
            or by `close_owner`).
        min_segment_bytes: size of a peer's first ordinary segment.
    """

    def __init__(
        self,
        prefix: str,
        *,
        segment_bytes: int,
        max_bytes: int,
        keep_bytes: int,
        min_segment_bytes: int = 1 << 20,
    ) -> None:
        self.prefix = prefix
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.keep_bytes = keep_bytes
        self.min_segment_bytes = min(min_segment_bytes, segment_bytes)
        self.segments: list[Segment] = []
        self._owned: dict[Hashable, list[Segment]] = {}
        self._seq = 0

    @property
    def total_bytes(self) -> int:
        """Bytes in all segments, busy or idle."""
        return sum(s.size for s in self.segments)

    @property
    def used_bytes(self) -> int:
        """Bytes in regions currently handed out."""
        return sum(s.used for s in self.segments)

    def owned(self, owner: Hashable) -> list[Segment]:
        """The segments of ``owner`` (a copy)."""
        return list(self._owned.get(owner, ()))

    def allocate(self, nbytes: int, owner: Hashable = None) -> tuple[Segment, int, int] | None:
        """A region of one of ``owner``'s segments with room for a header and ``nbytes``.

        Returns:
            ``(segment, region offset, region size)``, or None when the pool is at
            ``max_bytes`` and nothing fits.

        Raises:
            OSError: creating a segment failed (out of memory, descriptor limit).
        """
        n = REGION_HEADER + _round_up(max(nbytes, 1), REGION_ALIGN)
        mine = self._owned.get(owner)
        if mine:
            for seg in mine:
                off = seg.alloc(n)
                if off is not None:
                    return seg, off, n
        size = self._new_size(n, sum(s.size for s in mine) if mine else 0)
        if self.total_bytes + size > self.max_bytes:
            self._trim(0, spare=False)
            if self.total_bytes + size > self.max_bytes:
                return None
        self._seq += 1
        seg = Segment(f"{self.prefix}{os.getpid()}-{self._seq}", size, owner)
        self.segments.append(seg)
        self._owned.setdefault(owner, []).append(seg)
        off = seg.alloc(n)
        assert off is not None
        return seg, off, n

    def _new_size(self, n: int, have: int) -> int:
        if n > self.segment_bytes:
            return _round_up(n, 2 << 20)
        want = max(self.min_segment_bytes, have, 1 << (n - 1).bit_length())
        return _round_up(min(self.segment_bytes, want), PAGE_SIZE)

    def release(self, seg: Segment, off: int, n: int) -> None:
        """Return a region; close idle segments beyond ``keep_bytes``."""
        seg.release(off, n)
        if seg.used == 0:
            if isinstance(seg.owner, _Retired):
                self._close(seg)
            elif self.total_bytes > self.keep_bytes:
                self._trim(self.keep_bytes, spare=True)

    def close_owner(self, owner: Hashable) -> int:
        """``owner`` is gone: close its idle segments now, and its busy ones as soon as
        they empty; none of them is handed out again. Returns how many were closed now."""
        mine = self._owned.pop(owner, [])
        retired = _Retired()
        closed = 0
        for seg in mine:
            if seg.used == 0:
                self._close(seg)
                closed += 1
            else:
                seg.owner = retired
        return closed

    def _close(self, seg: Segment) -> None:
        if seg in self.segments:
            self.segments.remove(seg)
        mine = self._owned.get(seg.owner)
        if mine is not None and seg in mine:
            mine.remove(seg)
            if not mine:
                del self._owned[seg.owner]
        seg.close()

    def _trim(self, keep: int, *, spare: bool) -> None:
        total = self.total_bytes
        for seg in list(self.segments):
            if total <= keep:
                break
            if seg.used or seg not in self.segments:
                continue
            if spare and seg.size <= self.segment_bytes:
                mine = self._owned.get(seg.owner)
                if mine is not None and len(mine) == 1:
                    continue  # the peer's warm segment: its next call needs no new one
            total -= seg.size
            self._close(seg)

    def close(self) -> None:
        """Close every segment (views still held elsewhere keep their mapping)."""
        for seg in self.segments:
            seg.close()
        self.segments.clear()
        self._owned.clear()

    def abandon(self) -> None:
        """After ``fork()``: the child must not allocate from its parent's segments."""
        self.close()


class Warmer:
    """Faults written pages into segments' mappings on a background thread.

    `fill` writes a region's cold pages with ``pwrite`` (our own mapping of them stays
    empty) and hands the range here; the thread maps those pages in
    (``MADV_POPULATE_WRITE``, one `WARM_CHUNK` per call) and marks the segment's chunks
    warm, so the next copy into them is a ``memmove`` that faults nothing. The thread
    lives while there is work and is joined by `close` (with `tensorrpc.set_background_nice`
    it runs below the event loop's priority). Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[Segment, torch.Tensor, int, int]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, seg: Segment, start: int, end: int) -> None:
        """Fault in ``start .. end`` of ``seg``'s mapping (chunk multiples) soon."""
        with self._lock:
            if self._closed:
                return
            self._jobs.append((seg, seg.view, start, end))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tensorrpc-shm-warmer", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        lower_this_thread()
        while True:
            with self._lock:
                if not self._jobs or self._closed:
                    self._jobs.clear()
                    self._thread = None
                    return
                seg, view, start, end = self._jobs.pop(0)
            if view.numel() < end:  # (a closed segment's view is empty: nothing to do)
                continue
            # The job holds `view`, so the mapping outlives this loop. One chunk per call:
            # the kernel holds the process's memory map while it populates, and an
            # mmap or munmap in any other thread (a new segment on the event loop) waits
            # for the whole call, and every page fault behind it. A failure (a kernel
            # without MADV_POPULATE_WRITE) leaves the pages to fault in on the next
            # memmove, as they would without this thread.
            for at in range(start, end, WARM_CHUNK):
                n = min(WARM_CHUNK, end - at)
                _libc.madvise(view.data_ptr() + at, n, _MADV_POPULATE_WRITE)
                mark_warm(seg, at, n)

    def idle(self, timeout: float) -> bool:
        """Wait (bounded) until no job is pending; whether that happened (for tests)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Drop pending jobs and join the thread (bounded)."""
        with self._lock:
            self._closed = True
            self._jobs.clear()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)


def fill(
    seg: Segment,
    view: torch.Tensor,
    off: int,
    src: torch.Tensor,
    fd: int,
    warmer: Warmer,
    copier: Copier | None = None,
) -> None:
    """Copy the contiguous ``src`` into ``seg`` at byte ``off``.

    ``view`` is the segment's mapping and ``fd`` a descriptor of it, both taken by the
    caller while it held the pool's lock (a concurrent close can neither unmap the one nor
    redirect the other); ``fd`` is -1 where every chunk was warm then.

    Where the segment's chunks are warm (our mapping has the pages): a ``memmove``, split
    over ``copier``'s threads when it is large. Otherwise ``pwrite`` through ``fd``, which
    allocates the pages already filled instead of zeroing each in a fault before the copy
    (one thread: the kernel writes a file under its inode lock), and ``warmer`` maps them
    in afterwards.
    """
    nbytes = src.numel() * src.element_size()
    first, last = off // WARM_CHUNK, (off + nbytes - 1) // WARM_CHUNK
    if fd < 0 or all(seg.warm[first : last + 1]):
        if copier is None:
            ctypes.memmove(view.data_ptr() + off, src.data_ptr(), nbytes)
        else:
            copier.copy(view.data_ptr() + off, src.data_ptr(), nbytes)
        return
    data = memoryview((ctypes.c_char * nbytes).from_address(src.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        done += os.pwrite(fd, data[done:], off + done)
    warmer.submit(seg, first * WARM_CHUNK, min(seg.size, (last + 1) * WARM_CHUNK))


def cold(seg: Segment, off: int, nbytes: int) -> bool:
    """Whether some page of ``seg``'s bytes ``off .. off+nbytes`` may be missing from our
    mapping (a copy there would fault)."""
    return not all(seg.warm[off // WARM_CHUNK : (off + max(nbytes, 1) - 1) // WARM_CHUNK + 1])


def mark_warm(seg: Segment, off: int, nbytes: int) -> None:
    """Record that our mapping now has the pages of ``off .. off+nbytes``."""
    first, last = off // WARM_CHUNK, (off + max(nbytes, 1) - 1) // WARM_CHUNK
    seg.warm[first : last + 1] = b"\x01" * (last + 1 - first)


def _size_class(n: int) -> int:
    """Round up to a page, then to the next of 4 steps per power of two (<= 25% waste)."""
    n = _round_up(n, PAGE_SIZE)
    top = 1 << (n.bit_length() - 1)
    step = max(top // 4, PAGE_SIZE)
    return _round_up(n, step)


class BufferCache:
    """Recycled anonymous buffers for the receiver's copies of large tensors.

    A buffer handed out by `empty` belongs to the tensor built on it. When that tensor
    (and every view of it) dies, the pages come back here, up to ``max_idle_bytes``, and the
    next tensor of a similar size reuses them. Thread-safe; buffers may die in any thread.

    Args:
        max_idle_bytes: idle buffers kept for reuse; beyond this they are unmapped.
        min_bytes: smaller tensors use torch's allocator (malloc recycles those already).
    """

    def __init__(self, *, max_idle_bytes: int, min_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.min_bytes = min_bytes
        self._lock = threading.RLock()
        self._free: dict[int, list[int]] = {}
        self._idle = 0
        self._closed = False

    def empty(self, nbytes: int) -> torch.Tensor:
        """A fresh (uninitialised) contiguous ``uint8`` tensor of ``nbytes``."""
        if nbytes < self.min_bytes or self.max_idle_bytes <= 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = _size_class(nbytes)
        addr = None
        with self._lock:
            stack = self._free.get(size)
            if stack:
                addr = stack.pop()
                self._idle -= size
        if addr is None:
            addr = _mmap(-1, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return _tensor_over(addr, size, self._recycle)[:nbytes]

    def _recycle(self, addr: int, length: int) -> bool:
        with self._lock:
            if self._closed or self._idle + length > self.max_idle_bytes:
                return False
            self._free.setdefault(length, []).append(addr)
            self._idle += length
            return True

    def clear(self) -> None:
        """Unmap every idle buffer."""
        with self._lock:
            free, self._free = self._free, {}
            self._idle = 0
        for length, addrs in free.items():
            for addr in addrs:
                _libc.munmap(addr, length)

    def close(self) -> None:
        """Unmap idle buffers; buffers still in use are unmapped when their tensors die."""
        with self._lock:
            self._closed = True
        self.clear()
