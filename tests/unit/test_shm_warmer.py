"""The pool's warmer never holds the process's memory map for long (issue 20, speed).

After a ``pwrite`` into a segment's new pages, `Warmer` maps them into our own mapping
with ``MADV_POPULATE_WRITE`` on a background thread. The kernel holds the process's
memory map (``mmap_lock``) while it populates a range, so an ``mmap`` or ``munmap`` in
any other thread waits for the whole call: one call over a 64 MiB segment stalled the
next call's new segment, made on the event loop, for 50-100 ms on a loaded 2-core
machine. The warmer therefore populates one `WARM_CHUNK` per call. Nothing is timed: the
test records the calls.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import pytest

from tensorrpc.transports import _shm_pool
from tensorrpc.transports._shm_pool import WARM_CHUNK, Segment, Warmer, cold
from tensorrpc.transports.torch_shm import TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

WAIT = 30.0


class _Recording:
    """``_libc`` with its ``madvise`` calls recorded (and made)."""

    def __init__(self, libc: Any) -> None:
        self._libc = libc
        self.madvised: list[tuple[int, int, int]] = []

    def madvise(self, addr: int, n: int, advice: int) -> int:
        self.madvised.append((addr, n, advice))
        return int(self._libc.madvise(addr, n, advice))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._libc, name)


def test_a_large_range_is_populated_one_chunk_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _Recording(_shm_pool._libc)
    monkeypatch.setattr(_shm_pool, "_libc", libc)
    size = 5 * WARM_CHUNK + 8192  # (a last chunk shorter than the others)
    seg = Segment("tensorrpc-test-warm", size)
    warmer = Warmer()
    try:
        ctypes.memset(seg.view.data_ptr(), 1, 16)
        warmer.submit(seg, 0, size)
        assert warmer.idle(WAIT)
        assert not cold(seg, 0, size)
    finally:
        warmer.close()
        seg.close()
    spans = [(addr, n) for addr, n, _ in libc.madvised]
    assert all(n <= WARM_CHUNK for _, n in spans)
    assert sum(n for _, n in spans) == size  # every byte of the range, once
    starts = [addr for addr, _ in spans]
    assert starts == sorted(starts)
    assert all(b - a == WARM_CHUNK for a, b in itertools.pairwise(starts))
