"""The sender's pool gives each peer segments of its own (issue 20, item 4).

A receiver maps whole pool segments, so a segment that held one peer's region must never
hold another's: then an engine's mappings reach only the regions leased to it, never a
region the same client leased to another engine. The first copy into pages a segment has
never had goes by ``pwrite`` (no zero-fill fault per page) and a background thread maps
them in for the next copy.
"""

from __future__ import annotations

import os

import pytest
import torch

from tensorrpc.transports._shm_handle import unpack
from tensorrpc.transports._shm_pool import (
    WARM_CHUNK,
    Segment,
    SegmentPool,
    Warmer,
    cold,
    fill,
)
from tensorrpc.transports.torch_shm import TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

MIB = 1 << 20


def _pool(**kw: int) -> SegmentPool:
    conf = {"segment_bytes": 16 * MIB, "max_bytes": 256 * MIB, "keep_bytes": 64 * MIB, **kw}
    return SegmentPool("tensorrpc-test-", **conf)


def test_an_engine_cannot_reach_a_region_the_same_client_leased_to_another_engine() -> None:
    secret = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    with TorchShmTransport() as client, TorchShmTransport() as a, TorchShmTransport() as b:
        to_a = client.placer("engine-a").place(torch.zeros(1 << 16, dtype=torch.uint8))
        to_b = client.placer("engine-b").place(secret)
        assert to_a is not None
        assert to_b is not None
        got_a = a.resolver(os.getpid()).resolve(*to_a, torch.uint8, (1 << 16,))
        got_b = b.resolver(os.getpid(), keep=("client", 1)).resolve(*to_b, torch.uint8, (4096,))
        assert torch.equal(got_b, secret)
        assert int(got_a.sum()) == 0
        assert unpack(to_a[1]).ino != unpack(to_b[1]).ino
        # Everything engine A maps of the client's memory: its cached segment mappings.
        held = [m.view for m in a._receiver.maps._maps.values()]
        assert held, "engine A keeps its segment mapped"
        for view in held:
            assert bytes(secret.numpy()) not in view.numpy().tobytes()


def test_each_owner_allocates_only_from_its_own_segments() -> None:
    pool = _pool()
    try:
        a1 = pool.allocate(1000, "a")
        b1 = pool.allocate(1000, "b")
        a2 = pool.allocate(1000, "a")
        assert a1 is not None
        assert b1 is not None
        assert a2 is not None
        assert a1[0] is a2[0]  # packed into a's segment
        assert b1[0] is not a1[0]
        assert (a1[0].owner, b1[0].owner) == ("a", "b")
        assert pool.owned("a") == [a1[0]]
    finally:
        pool.close()


def test_a_peers_segments_grow_from_small_up_to_the_ordinary_size() -> None:
    pool = _pool(min_segment_bytes=MIB)
    try:
        for _ in range(8):  # each new segment doubles what the peer has: 1, 1, 2, 4 MiB
            assert pool.allocate(MIB - 4096, "a") is not None
        assert [s.size for s in pool.owned("a")] == [MIB, MIB, 2 * MIB, 4 * MIB]
        big = pool.allocate(40 * MIB, "a")
        assert big is not None
        assert big[0].size == 40 * MIB + 2 * MIB  # its own segment, rounded up to 2 MiB
    finally:
        pool.close()


def test_close_owner_closes_idle_segments_and_retires_busy_ones() -> None:
    pool = _pool()
    try:
        busy = pool.allocate(1000, "a")
        idle = pool.allocate(40 * MIB, "a")
        assert busy is not None
        assert idle is not None
        pool.release(*idle)
        assert pool.close_owner("a") == 1
        assert idle[0].fd == -1
        assert busy[0].fd >= 0  # a lease still on it
        again = pool.allocate(1000, "a")  # a new peer under the same id: a new segment
        assert again is not None
        assert again[0] is not busy[0]
        pool.release(*busy)
        assert busy[0].fd == -1  # closed as soon as it emptied
        assert busy[0] not in pool.segments
    finally:
        pool.close()


def test_trimming_keeps_each_peers_last_ordinary_segment() -> None:
    pool = _pool(keep_bytes=0)
    try:
        got = pool.allocate(1000, "a")
        other = pool.allocate(1000, "b")
        assert got is not None
        assert other is not None
        pool.release(*got)
        assert got[0].fd >= 0  # a's next call needs no new segment
        big = pool.allocate(40 * MIB, "a")
        assert big is not None
        pool.release(*big)
        assert big[0].fd == -1  # not an ordinary segment: closed when it empties
    finally:
        pool.close()


def test_the_first_copy_into_cold_pages_is_written_and_then_warmed() -> None:
    seg = Segment("tensorrpc-test-fill", 3 * WARM_CHUNK)
    warmer = Warmer()
    try:
        src = torch.arange(WARM_CHUNK // 4 + 100, dtype=torch.float32)  # spans two chunks
        off = WARM_CHUNK - 4096
        assert cold(seg, off, src.nbytes)
        fd = os.dup(seg.fd)
        try:
            fill(seg, seg.view, off, src, fd, warmer)
        finally:
            os.close(fd)
        got = seg.view[off : off + src.nbytes].view(torch.float32)
        assert torch.equal(got, src)
        assert warmer.idle(30.0)
        assert not cold(seg, off, src.nbytes)
        assert list(seg.warm) == [1, 1, 0]
        fill(seg, seg.view, off, src + 1, -1, warmer)  # warm: a plain memmove
        assert torch.equal(got, src + 1)
    finally:
        warmer.close()
        seg.close()
