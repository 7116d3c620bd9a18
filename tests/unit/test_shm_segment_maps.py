"""The receiver's cache of mapped segments is bounded (issue 12: no per-call mapping).

A receiver keeps peers' segments mapped so that a repeated handle costs no open, mmap or
munmap. The cache must stay bounded however many segments peers send: by count (all
peers together, least recently used first) and by bytes per peer (a peer's oldest go
first, other peers' mappings stay), and a segment larger than a peer's whole budget is
never kept. Tensors built on an evicted mapping stay valid (they hold their own mapping),
and a later handle to that segment maps it afresh.
"""

from __future__ import annotations

import os

import pytest
import torch

from tensorrpc.transports._shared import share
from tensorrpc.transports._shm_recv import SegmentMaps
from tensorrpc.transports.torch_shm import TorchShmTransport
from tests.transports._shm_local import send_local

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)


def _bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_the_count_bound_evicts_the_least_recently_used_of_any_peer() -> None:
    maps = SegmentMaps(max_segments=2, max_bytes_per_peer=1 << 20)
    a, b, c = (1, 9, 1), (2, 9, 2), (3, 9, 3)
    assert maps.put(a, _bytes(64))
    assert maps.put(b, _bytes(64))
    assert maps.get(a) is not None  # a is now the most recently used
    assert maps.put(c, _bytes(64))
    assert len(maps) == 2
    assert maps.get(b) is None  # the least recently used went
    assert maps.get(a) is not None
    assert maps.get(c) is not None
    assert (maps.bytes_of(1), maps.bytes_of(2), maps.bytes_of(3)) == (64, 0, 64)


def test_the_byte_bound_is_per_peer_and_evicts_that_peers_oldest() -> None:
    maps = SegmentMaps(max_segments=16, max_bytes_per_peer=100)
    old, other, new = (1, 9, 1), (2, 9, 2), (1, 9, 3)
    assert maps.put(old, _bytes(60))
    assert maps.put(other, _bytes(60))  # another peer's budget
    assert maps.put(new, _bytes(60))  # 120 > 100 for peer 1: its oldest goes
    assert maps.get(old) is None
    assert maps.get(other) is not None
    assert maps.get(new) is not None
    assert maps.bytes_of(1) == 60
    assert maps.bytes_of(2) == 60


def test_a_segment_over_a_peers_budget_is_never_kept_and_evicts_nothing() -> None:
    maps = SegmentMaps(max_segments=16, max_bytes_per_peer=100)
    kept = (1, 9, 1)
    assert maps.put(kept, _bytes(60))
    assert not maps.put((1, 9, 2), _bytes(101))
    assert len(maps) == 1
    assert maps.get(kept) is not None
    assert not SegmentMaps(max_segments=0, max_bytes_per_peer=100).put(kept, _bytes(1))


def test_replacing_a_key_counts_its_bytes_once() -> None:
    maps = SegmentMaps(max_segments=4, max_bytes_per_peer=100)
    key = (1, 9, 1)
    for _ in range(5):
        assert maps.put(key, _bytes(60))
    assert len(maps) == 1
    assert maps.bytes_of(1) == 60


def test_forget_drops_one_peers_mappings_only() -> None:
    maps = SegmentMaps(max_segments=8, max_bytes_per_peer=1 << 20)
    for key in ((1, 9, 1), (1, 9, 2), (2, 9, 3)):
        assert maps.put(key, _bytes(16))
    assert maps.forget(1) == 2
    assert maps.forget(1) == 0
    assert len(maps) == 1
    assert maps.bytes_of(1) == 0
    assert maps.get((2, 9, 3)) is not None


@pytest.mark.parametrize("bound", ["count", "bytes"])
def test_a_receiver_keeps_at_most_its_bound_of_mappings_and_stays_correct(bound: str) -> None:
    # Five shared tensors: five segments of the same peer (this process), 64 KiB each.
    n = 16 << 10
    if bound == "count":
        receiver = TorchShmTransport(mapped_segments=2)
    else:
        receiver = TorchShmTransport(mapped_bytes_per_peer=3 * n * 4)
    sender = TorchShmTransport()
    try:
        tensors = [share(torch.full((n,), float(i))) for i in range(5)]
        fds = len(os.listdir("/proc/self/fd"))
        kept = []
        for _ in range(3):
            for i, t in enumerate(tensors):
                got = send_local(sender, receiver, t)
                assert float(got[0]) == float(got[-1]) == float(i)
                kept.append(got)
                assert receiver.statistics().mapped_segments <= (2 if bound == "count" else 3)
        assert receiver.statistics().mapped_segments == (2 if bound == "count" else 3)
        # Tensors on evicted mappings still see the sender's memory (aliases, not copies).
        for i, t in enumerate(tensors):
            t.fill_(100.0 + i)
        for j, got in enumerate(kept):
            assert float(got[n // 2]) == 100.0 + j % 5
        assert len(os.listdir("/proc/self/fd")) == fds  # mappings hold no descriptors
    finally:
        receiver.close()
        sender.close()
