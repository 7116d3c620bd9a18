"""The receiver's typed views of kept mappings (issue 12: per-call CPU of a tensor in).

A handle into a mapped segment is resolved on a view of the mapping as the handle's
dtype, made once per (mapping, dtype) and kept with the mapping's entry. These tests pin
down that the cached views die with their mapping: a mapping evicted (or replaced, or
forgotten) must never be read again through a view cached before.
"""

from __future__ import annotations

import pytest
import torch

from tensorrpc.transports._shared import share
from tensorrpc.transports._shm_handle import unpack
from tensorrpc.transports._shm_pool import privatize
from tensorrpc.transports._shm_recv import SegmentMaps
from tensorrpc.transports.torch_shm import TorchShmTransport
from tests.transports._shm_local import send_local

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

KEY = (1234, 5, 6)


def _typed_ptr(maps: SegmentMaps, dtype: torch.dtype = torch.float32) -> int:
    got = maps.typed(KEY, dtype)
    assert got is not None
    _view, cached = got
    assert cached is not None
    return cached[0].data_ptr()


def test_typed_views_are_made_once_per_dtype_and_on_the_mapping() -> None:
    maps = SegmentMaps(max_segments=4, max_bytes_per_peer=1 << 20)
    a = torch.zeros(4096, dtype=torch.uint8)
    assert maps.put(KEY, a)
    got = maps.typed(KEY, torch.float32)
    assert got is not None
    view, cached = got
    assert cached is not None
    typed, offset = cached
    assert view is a
    assert typed.dtype == torch.float32
    assert typed.numel() == 1024
    assert typed.data_ptr() == a.data_ptr()
    assert offset == 0
    again = maps.typed(KEY, torch.float32)
    assert again is not None
    assert again[1] is not None
    assert again[1][0] is typed
    other = maps.typed(KEY, torch.int16)
    assert other is not None
    assert other[1] is not None
    assert other[1][0].numel() == 2048
    assert maps.typed((1234, 5, 7), torch.float32) is None


def test_a_mapping_whose_size_is_no_multiple_of_the_item_size_has_no_typed_view() -> None:
    maps = SegmentMaps(max_segments=4, max_bytes_per_peer=1 << 20)
    assert maps.put(KEY, torch.zeros(4098, dtype=torch.uint8))
    got = maps.typed(KEY, torch.float32)
    assert got is not None
    assert got[1] is None


@pytest.mark.parametrize("how", ["evict", "replace", "forget", "clear", "lru"])
def test_a_new_mapping_under_the_same_key_never_reuses_the_old_typed_view(how: str) -> None:
    maps = SegmentMaps(max_segments=2, max_bytes_per_peer=1 << 20)
    old = torch.zeros(4096, dtype=torch.uint8)
    new = torch.zeros(4096, dtype=torch.uint8)
    assert maps.put(KEY, old)
    assert _typed_ptr(maps) == old.data_ptr()
    if how == "evict":
        maps.evict(KEY)
    elif how == "forget":
        assert maps.forget(KEY[0]) == 1
    elif how == "clear":
        maps.clear()
    elif how == "lru":  # pushed out by two other segments
        assert maps.put((1, 1, 1), torch.zeros(16, dtype=torch.uint8))
        assert maps.put((1, 1, 2), torch.zeros(16, dtype=torch.uint8))
    if how != "replace":
        assert maps.typed(KEY, torch.float32) is None
    assert maps.put(KEY, new)  # (the same inode number, a new segment)
    assert _typed_ptr(maps) == new.data_ptr()


def test_a_handle_resolved_after_its_mapping_was_evicted_sees_the_shared_pages() -> None:
    # The receiver evicts a mapping when it gives pages under it private copies (detach):
    # a later handle must be built on a fresh mapping of the shared file, never on a view
    # cached over the privatized pages, or it would miss the sender's later writes.
    sender, receiver = TorchShmTransport(), TorchShmTransport()
    try:
        t = share(torch.zeros(4096, dtype=torch.float32))

        def send() -> torch.Tensor:
            return send_local(sender, receiver, t)

        send()  # maps the segment
        first = send()  # on its typed view
        assert first.data_ptr() != t.data_ptr()
        assert float(first[0]) == 0.0
        placed = sender.placer("client").place(t)
        assert placed is not None
        h = unpack(placed[1])
        key = (h.pid, h.dev, h.ino)
        mapping = receiver._receiver.maps.get(key)
        assert mapping is not None
        privatize(mapping.data_ptr(), mapping.numel())
        receiver._receiver.maps.evict(key)
        t.fill_(7.0)
        assert float(first[0]) == 0.0  # the old mapping's pages are private now
        second = send()  # maps the segment again
        third = send()  # on the new mapping's typed view
        for got in (second, third):
            assert float(got[0]) == 7.0
            assert float(got[-1]) == 7.0
        t.fill_(9.0)
        assert float(second[5]) == 9.0
        assert float(third[5]) == 9.0
    finally:
        sender.close()
        receiver.close()
