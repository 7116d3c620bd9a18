"""tensorrpc.loader.SharedBatches with real workers and with torch_shm: the workers write
into slots made before they started (forked or spawned), the batches go by alias on a
mapping the receiver keeps, and a call in flight keeps its batch's slot."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.utils.data

from tensorrpc import _codec, _release
from tensorrpc.loader import SharedBatches
from tensorrpc.transports._shared import lookup
from tensorrpc.transports.torch_shm import TorchShmTransport
from tests.transports._shm_local import send_local

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)


class Rows(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Sample ``i``: a 16x16 tensor filled with ``i``, and ``i``."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((16, 16), float(i)), i


# (one spawned worker: each imports torch, seconds of a 2-core machine's test time)
@pytest.mark.parametrize(("method", "workers", "count"), [("fork", 2, 6), ("spawn", 1, 4)])
def test_workers_write_every_batch_into_a_slot(method: str, workers: int, count: int) -> None:
    slots = SharedBatches(1 << 14)
    loader = torch.utils.data.DataLoader(
        Rows(),
        batch_size=4,
        num_workers=workers,
        collate_fn=slots.collate,
        multiprocessing_context=method,
    )
    seen = []
    for images, labels in slots.iterate(loader):
        assert images.shape == (4, 16, 16)
        assert torch.equal(images[:, 0, 0], labels.to(torch.float32))
        assert lookup(images.untyped_storage()) is not None
        assert images.untyped_storage().data_ptr() == labels.untyped_storage().data_ptr()
        seen += labels.tolist()
    assert seen == list(range(24))
    assert (slots.slots, slots.batches, slots.fallbacks) == (count, 6, 0)
    slots.close()


class Filled(torch.utils.data.Dataset[torch.Tensor]):
    """``n`` items, each a whole batch: item ``i`` is a 64x64 tensor filled with ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64, 64), float(i))


def batches(slots: SharedBatches, n: int) -> Any:
    loader = torch.utils.data.DataLoader(Filled(n), batch_size=None, collate_fn=slots.collate)
    return slots.iterate(loader)


def test_a_batch_goes_by_alias_on_a_mapping_the_receiver_keeps() -> None:
    slots = SharedBatches(64 * 64 * 4, hold=1)
    with TorchShmTransport() as sender, TorchShmTransport() as receiver:
        kept = []
        for batch in batches(slots, 6):
            received = send_local(sender, receiver, batch)
            assert torch.equal(received, batch)
            assert received.data_ptr() != batch.data_ptr()  # the receiver's own mapping
            kept.append(received)  # (alive: a one-off mapping could not be reused)
            del received, batch
        assert sender.statistics().tensors_aliased == 6
        # Each batch freed its slot before the next was collated: all used slot 0. A
        # file is kept mapped from the second handle naming it on (docs/transports.md),
        # so from the second batch on they all land at one address there...
        assert len({t.data_ptr() for t in kept[1:]}) == 1
        # ...and a receiver that keeps a batch past its call sees the slot's next batch
        # (module docs: a handler that keeps one must clone it).
        assert [float(t[0, 0]) for t in kept] == [5.0] * 6
    assert slots.fallbacks == 0


def test_a_call_in_flight_keeps_its_batch_slot() -> None:
    slots = SharedBatches(64 * 64 * 4, hold=1)
    it = batches(slots, 4)
    with TorchShmTransport() as shm:
        batch = next(it)
        placer = shm.placer("peer")
        encoded = _codec.encode(batch, _codec.CodecConfig(), placer=placer)
        assert encoded.buffers == []  # a handle, no byte of the batch
        del batch, encoded  # sent: only the lease holds the batch now
        gc.collect()
        assert slots._state is not None
        assert list(slots._state) == [2, 0]
        assert placer.lease is not None
        assert shm.release(placer.lease)
        assert _release.drained(10.0)  # (what a lease kept is let go on the release thread)
        assert list(slots._state) == [0, 0]  # the reply came: the slot is free again
    assert [float(b[0, 0]) for b in it] == [1.0, 2.0, 3.0]
