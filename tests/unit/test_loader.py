"""tensorrpc.loader.SharedBatches in one process (``num_workers=0``: this process is the
only worker): batches collated into slots, rebuilt on them, and slots reused only once
everything that views a batch is gone."""

from __future__ import annotations

import gc
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils.data

from tensorrpc.loader import SharedBatches
from tensorrpc.transports._shared import lookup


class Pair(NamedTuple):
    image: torch.Tensor
    label: int


class Samples(torch.utils.data.Dataset[Any]):
    """Sample ``i``: a dict of a 4x8 tensor filled with ``i``, ``i`` and a name."""

    def __init__(self, n: int = 12, kind: str = "dict") -> None:
        self.n = n
        self.kind = kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        x = torch.full((4, 8), float(i))
        if self.kind == "pair":
            return Pair(x, i)
        if self.kind == "tensor":
            return x
        return {"x": x, "y": i, "name": f"s{i}", "t": (x[0].to(torch.int64), [i * 0.5])}


def loader(batches: SharedBatches, **kw: Any) -> torch.utils.data.DataLoader[Any]:
    kw.setdefault("batch_size", 3)
    dataset = kw.pop("dataset", Samples())
    return torch.utils.data.DataLoader(dataset, collate_fn=batches.collate, **kw)


def on_one_slot(*tensors: torch.Tensor) -> bool:
    """Whether every tensor views one slot's storage, which ``torch_shm`` sends by alias."""
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    return len(storages) == 1 and lookup(tensors[0].untyped_storage()) is not None


def states(batches: SharedBatches) -> list[int]:
    assert batches._state is not None
    return [int(s) for s in batches._state]


def test_batches_equal_the_default_collate_and_lie_on_a_slot() -> None:
    slots = SharedBatches(1 << 16)
    plain = torch.utils.data.DataLoader(Samples(), batch_size=3)
    for got, want in zip(slots.iterate(loader(slots)), plain, strict=True):
        assert got.keys() == want.keys()
        assert torch.equal(got["x"], want["x"])
        assert got["x"].dtype == want["x"].dtype
        assert torch.equal(got["y"], want["y"])
        assert got["y"].dtype == torch.int64
        assert got["name"] == want["name"]
        assert torch.equal(got["t"][0], want["t"][0])
        assert torch.equal(got["t"][1][0], want["t"][1][0])
        assert got["t"][1][0].dtype == torch.float64
        assert on_one_slot(got["x"], got["y"], got["t"][0], got["t"][1][0])
    assert (slots.batches, slots.fallbacks) == (4, 0)


def test_namedtuples_and_batch_size_none_keep_their_shape() -> None:
    slots = SharedBatches(1 << 16)
    pairs = list(slots.iterate(loader(slots, dataset=Samples(kind="pair"))))
    assert type(pairs[0]) is Pair
    assert pairs[1].label.tolist() == [3, 4, 5]
    assert on_one_slot(pairs[1].image, pairs[1].label)
    whole = SharedBatches(1 << 16, hold=12)  # (all of them are kept)
    items = list(whole.iterate(loader(whole, dataset=Samples(kind="tensor"), batch_size=None)))
    assert [t.shape for t in items] == [torch.Size((4, 8))] * 12
    assert [float(t[0, 0]) for t in items] == [float(i) for i in range(12)]
    assert whole.fallbacks == 0
    assert on_one_slot(items[5])


def test_a_slot_is_reused_only_once_every_view_of_its_batch_is_gone() -> None:
    slots = SharedBatches(1 << 12, hold=1)
    it = slots.iterate(loader(slots, dataset=Samples(kind="tensor"), batch_size=2))
    first = next(it)
    row = first[1]  # a view: the batch's storage, not its tensor object
    del first
    gc.collect()
    assert states(slots) == [2, 0]
    second = next(it)
    assert states(slots) == [2, 2]
    del second
    assert states(slots) == [2, 0]  # freed the moment its last view went
    assert float(row[0, 0]) == 1.0
    del row
    assert states(slots) == [0, 0]
    assert [float(b[0, 0, 0]) for b in it] == [4.0, 6.0, 8.0, 10.0]
    assert slots.fallbacks == 0


def test_no_free_slot_and_a_batch_too_large_fall_back_to_the_plain_collate() -> None:
    slots = SharedBatches(3 * 4 * 8 * 4, hold=1)  # one batch of 3 tensors, nothing else
    kept = list(slots.iterate(loader(slots, dataset=Samples(kind="tensor"))))
    assert (slots.batches, slots.fallbacks) == (2, 2)  # two slots, both still held
    assert [float(b[0, 0, 0]) for b in kept] == [0.0, 3.0, 6.0, 9.0]
    assert [lookup(b.untyped_storage()) is not None for b in kept] == [True, True, False, False]
    big = SharedBatches(100, hold=1)
    got = list(big.iterate(loader(big, dataset=Samples(kind="tensor"))))
    assert (big.batches, big.fallbacks) == (0, 4)
    assert torch.equal(got[0], torch.stack([torch.full((4, 8), float(i)) for i in range(3)]))
    assert states(big) == [0, 0]  # every slot taken for a batch too large went back


def test_what_cannot_go_in_a_slot_takes_the_plain_collate_and_its_errors() -> None:
    calls = []

    def first(samples: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(samples))
        return samples[0]

    slots = SharedBatches(1 << 12, collate_fn=first)
    sparse = torch.eye(3).to_sparse()
    got = next(slots.iterate(loader(slots, dataset=[sparse, sparse], batch_size=2)))
    assert got.is_sparse
    assert torch.equal(got.to_dense(), torch.eye(3))
    assert slots.fallbacks == 1
    assert calls == [2]  # the user's collate ran once: its batch is the fallback
    ragged = SharedBatches(1 << 12)
    odd = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(RuntimeError, match="equal size"):
        next(ragged.iterate(loader(ragged, dataset=odd, batch_size=2)))
    assert states(ragged) == [0, 0, 0]  # the slot went back before the error


def test_a_collate_fn_of_the_user_has_its_tensors_copied_into_the_slot() -> None:
    def mine(samples: list[torch.Tensor]) -> dict[str, Any]:
        return {"sum": torch.stack(samples).sum(0), "n": len(samples)}

    slots = SharedBatches(1 << 12, hold=4, collate_fn=mine)
    got = list(slots.iterate(loader(slots, dataset=Samples(kind="tensor"))))
    assert [float(b["sum"][0, 0]) for b in got] == [3.0, 12.0, 21.0, 30.0]
    assert got[0]["n"] == 3
    assert on_one_slot(got[0]["sum"])
    assert slots.fallbacks == 0


def test_a_pass_left_unfinished_gives_its_taken_slots_back() -> None:
    slots = SharedBatches(1 << 12, hold=2)
    it = slots.iterate(loader(slots, dataset=Samples(kind="tensor")))
    kept = next(it)
    assert slots._take() is not None  # a batch a worker collated that never arrived
    assert sorted(states(slots)) == [0, 1, 2]
    it.close()  # (a `break` out of the loop, once the generator is collected)
    assert sorted(states(slots)) == [0, 0, 2]  # the held batch keeps its slot
    del kept
    assert states(slots) == [0, 0, 0]


def test_bad_arguments_and_a_foreign_loader_are_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_bytes"):
        SharedBatches(0)
    with pytest.raises(ValueError, match="hold"):
        SharedBatches(1024, hold=0)
    slots = SharedBatches(1024)
    with pytest.raises(ValueError, match="collate_fn"):
        slots.iterate(torch.utils.data.DataLoader(Samples(), batch_size=2))
    first = loader(slots)
    running = slots.iterate(first)
    next(running)
    with pytest.raises(ValueError, match="still running"):
        slots.iterate(first)  # (its workers would take the running pass's slots)
    with pytest.raises(ValueError, match="another DataLoader"):
        slots.iterate(loader(slots))
    running.close()
    assert len(list(slots.iterate(first))) == 4  # once the pass is over
    slots.close()
    with pytest.raises(ValueError, match="closed"):
        slots.iterate(first)


def test_after_close_batches_come_by_the_plain_collate_and_held_ones_stay() -> None:
    slots = SharedBatches(1 << 12)
    it = slots.iterate(loader(slots, dataset=Samples(kind="tensor")))
    first = next(it)
    written = slots.collate([torch.ones(2), torch.ones(2)])  # in a worker, not yet here
    assert slots._state is not None
    state = slots._state
    slots.close()
    assert sorted(int(s) for s in state) == [1, 2, 3]  # taken, out, closed to workers
    assert lookup(next(it).untyped_storage()) is None  # the plain collate's
    assert slots.fallbacks == 1
    with pytest.raises(ValueError, match="closed during a pass"):
        slots._rebuild(written)
    assert float(first[2, 0, 0]) == 2.0  # its storage keeps the slot's memory mapped
