"""``DataLoader`` batches written where an engine already looks.

A ``torch.utils.data.DataLoader`` with workers hands each batch to the training loop in a
new file of torch's shared memory. ``torch_shm`` sends such a batch by alias, but the
engine meets a new file on every call: it takes the descriptor, maps it, and unmaps it
afterwards (about 0.2 ms for each batch, plus the page faults of a new mapping).

`SharedBatches` gives the loader's workers a fixed set of *slots*, tensorrpc shared
memory (`tensorrpc.shared_empty`) made before the workers start. A worker collates each
batch straight into a free slot and hands back only where its tensors lie; this process
rebuilds the batch on the slot, so ``torch_shm`` sends it by alias on a file the engine
has mapped since the slot's first batch: the cost of sending a `tensorrpc.share` tensor.

    batches = SharedBatches(max_batch_bytes=64 << 20)
    loader = DataLoader(dataset, batch_size=64, num_workers=2, collate_fn=batches.collate)
    for images, labels in batches.iterate(loader):
        await client.call(Trainer.step, images, labels)

A slot is reused once every tensor of its batch is gone, here and as a call's argument
(a call in flight keeps its batch). An engine's handler that keeps a batch past the call
must copy it (``.clone()``): the slot's next batch is written over the same memory, as
with any `tensorrpc.share` tensor its owner writes again. When no slot is free (the loop
holds more batches than the slots it was given, see ``hold``) or a batch is larger than
a slot, the worker falls back to the plain collate: the batch is correct and counted in
`SharedBatches.fallbacks`, and goes the way any ``DataLoader`` batch does.

Spawned (or forkserver) workers receive the slots' descriptors when torch pickles the
loader's ``collate_fn`` to start them, between this process and its own children, as it
pickles the dataset; what a worker returns is a plain object naming a slot. Nothing
here unpickles anything a peer sent.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tensorrpc._lazy import LazyModule

if TYPE_CHECKING:
    import numpy as np
    import torch
    import torch.utils.data
else:
    torch = LazyModule("torch", globals())
    np = LazyModule("numpy", globals())

__all__ = ["SharedBatches"]

#: Tensors in a slot start at multiples of this (a cache line; any dtype's alignment).
ALIGN = 64


class _Leaf:
    """Where a worker put one tensor of a batch: its place in the slot."""

    __slots__ = ("dtype", "offset", "shape", "stride")

    def __init__(
        self, offset: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self.offset = offset
        self.shape = shape
        self.stride = stride
        self.dtype = dtype


class _SlotBatch:
    """What a worker returns for a batch collated into slot ``index``: the batch's
    structure with a `_Leaf` for every tensor."""

    __slots__ = ("index", "tree")

    def __init__(self, index: int, tree: Any) -> None:
        self.index = index
        self.tree = tree


class _Overflow(Exception):
    """The batch does not fit in a slot."""


class _Packer:
    """Places the tensors of one batch in one slot, in order (a worker's side)."""

    def __init__(self, slot: torch.Tensor) -> None:
        self.slot = slot
        self.used = 0

    def _region(self, nbytes: int) -> tuple[int, torch.Tensor]:
        offset = -(-self.used // ALIGN) * ALIGN
        if offset + nbytes > self.slot.numel():
            raise _Overflow
        self.used = offset + nbytes
        return offset, self.slot[offset : offset + nbytes]

    def stack(self, batch: Sequence[torch.Tensor], **_kw: Any) -> _Leaf:
        """The collate of a list of tensors: stacked straight into the slot."""
        elem = batch[0]
        _check_placeable(elem)
        shape = (len(batch), *elem.shape)
        offset, region = self._region(elem.numel() * len(batch) * elem.element_size())
        out = region.view(elem.dtype).view(shape)
        torch.stack(list(batch), 0, out=out)
        return _Leaf(offset, shape, tuple(out.stride()), elem.dtype)

    def place(self, t: torch.Tensor | _Leaf) -> _Leaf:
        """A tensor some collate already made: copied into the slot."""
        if isinstance(t, _Leaf):
            return t  # (stacked into the slot already)
        _check_placeable(t)
        offset, region = self._region(t.numel() * t.element_size())
        out = region.view(t.dtype).view(t.shape)
        out.copy_(t)
        return _Leaf(offset, tuple(t.shape), tuple(out.stride()), t.dtype)

    def tree(self, value: Any) -> Any:
        """``value`` with every tensor placed in the slot (containers rebuilt alike)."""
        return _rebuild(value, self.place)


def _check_placeable(t: torch.Tensor) -> None:
    """Raise `_Overflow` for a tensor that cannot lie in a byte buffer as it is (another
    device, a sparse or quantized layout): the plain collate's batch goes as it is."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        raise _Overflow


def _rebuild(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to every tensor or `_Leaf` in its dicts, lists and
    tuples (rebuilt as the same types; anything else is kept as it is)."""
    if isinstance(value, _Leaf | torch.Tensor):
        return leaf(value)
    if isinstance(value, str | bytes):
        return value
    if isinstance(value, Mapping):
        items = {k: _rebuild(v, leaf) for k, v in value.items()}
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_rebuild(v, leaf) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_rebuild(v, leaf) for v in value)
    return value


#: A slot's states, one byte each in the shared state array. Each move has one writer,
#: so no lock is needed: a slot belongs to one worker (slot ``k`` to worker ``k % n``),
#: which alone moves it from free to taken (and back, when its batch does not fit); this
#: process alone moves it to out (its batch arrived) and back to free (the batch died),
#: or from taken to free once the workers are gone (`SharedBatches._reclaim`).
_FREE, _TAKEN, _OUT = 0, 1, 2
#: A slot no worker may take any more (`SharedBatches.close`).
_CLOSED = 3


class SharedBatches:
    """Slots of tensorrpc shared memory for a ``DataLoader``'s batches (see the module).

    Pass `collate` as the loader's ``collate_fn`` and iterate with `iterate`; the slots
    are made by the first `iterate`, before the loader starts its workers (any start
    method: forked workers inherit them, spawned ones receive their descriptors).

    Args:
        max_batch_bytes: The size of a slot: the bytes of one batch's tensors, each
            rounded up to 64 bytes. A larger batch falls back to the plain collate.
        hold: Batches the loop may hold besides those the loader prefetches (the one in
            hand, and one whose call is still in flight by default). Each worker gets
            ``prefetch_factor + ceil(hold / num_workers)`` slots of its own (a batch
            goes back to the slot of the worker that made it); without workers, this
            process collates into ``1 + hold`` slots.
        collate_fn: The collate to use instead of torch's default one; its tensors are
            then copied into the slot (torch's default collate stacks into it directly).

    Raises:
        ValueError: ``max_batch_bytes`` or ``hold`` is not positive.
    """

    def __init__(
        self,
        max_batch_bytes: int,
        *,
        hold: int = 2,
        collate_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        if max_batch_bytes <= 0:
            raise ValueError(f"max_batch_bytes must be positive, not {max_batch_bytes}")
        if hold < 1:
            raise ValueError(f"hold must be at least 1, not {hold}")
        self.max_batch_bytes = max_batch_bytes
        self.hold = hold
        self._collate = collate_fn
        self._slots: list[torch.Tensor] = []
        #: Each slot's state (`_FREE`, `_TAKEN` by a worker, `_OUT` here), shared with the
        #: workers: one byte per slot in tensorrpc shared memory (and its numpy view).
        self._states: torch.Tensor | None = None
        self._state: np.ndarray[Any, Any] | None = None
        #: The loader this serves, and its running pass (`iterate`).
        self._loader: weakref.ref[torch.utils.data.DataLoader[Any]] | None = None
        self._current: weakref.ref[Generator[Any, None, None]] | None = None
        #: Descriptors of the slots and states still to map (`_attach`: a spawned worker).
        self._fds: list[Any] = []
        #: Whether the loader hands over samples one by one (``batch_size=None``: each
        #: is already a batch, placed as it is) rather than lists to collate.
        self._convert = False
        self._batches = 0
        self._fallbacks = 0
        self._closed = False

    # -- this process -------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """How many slots there are (0 before the first `iterate`)."""
        return len(self._slots)

    @property
    def batches(self) -> int:
        """Batches `iterate` rebuilt on a slot."""
        return self._batches

    @property
    def fallbacks(self) -> int:
        """Batches that came from the plain collate (no slot was free, the batch was too
        large, or a tensor in it cannot lie in a slot)."""
        return self._fallbacks

    def iterate(self, loader: torch.utils.data.DataLoader[Any]) -> Generator[Any, None, None]:
        """The batches of one pass over ``loader``, each on its slot.

        Makes the slots (on the first call), then runs ``iter(loader)`` at once, which
        starts the workers (fork them before opening sockets or starting threads). When
        the pass ends, finished or not, a loader without persistent workers has its
        workers stopped and the slots they had taken are free again.

        Raises:
            ValueError: ``loader`` does not use `collate`; another loader was iterated
                with this object (its slots belong to that loader's workers: one
                `SharedBatches` per loader); the last pass is still running (exhaust
                or ``close()`` it: two passes' workers would take the same slots); or
                this is closed.
        """
        if self._closed:
            raise ValueError("SharedBatches is closed")
        if loader.collate_fn != self.collate:
            raise ValueError("the loader's collate_fn must be this SharedBatches' collate")
        if self._loader is not None and self._loader() is not loader:
            raise ValueError("this SharedBatches serves another DataLoader: one per loader")
        last = self._current() if self._current is not None else None
        if last is not None and inspect.getgeneratorstate(last) != inspect.GEN_CLOSED:
            raise ValueError("the last pass is still running: exhaust it or close() it")
        self._make_slots(loader)
        self._loader = weakref.ref(loader)
        self._convert = loader.batch_sampler is None
        current = self._pass(loader, iter(loader))
        self._current = weakref.ref(current)
        return current

    def _pass(
        self, loader: torch.utils.data.DataLoader[Any], it: Iterator[Any]
    ) -> Generator[Any, None, None]:
        try:
            for item in it:
                yield self._rebuild(item)
        finally:
            if not loader.persistent_workers:
                shutdown = getattr(it, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()  # (idempotent: torch calls it at the end of a pass too)
                self._reclaim()

    def close(self) -> None:
        """Stop handing out slots; their memory is freed once their last batch is.

        Workers still running collate by the plain collate from then on; a batch
        already written into a slot and not yet rebuilt makes `iterate` raise
        ValueError."""
        self._closed = True
        for k in range(len(self._slots)):
            self._set(k, _FREE, _CLOSED)  # (a worker taking it meanwhile: see _rebuild)
        self._slots = []
        self._states = self._state = None

    def __enter__(self) -> SharedBatches:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _make_slots(self, loader: torch.utils.data.DataLoader[Any]) -> None:
        if self._slots:
            return
        from tensorrpc.transports._shared import shared_empty

        workers = max(loader.num_workers, 1)  # (none: this process collates, as worker 0)
        prefetch = (loader.prefetch_factor or 2) if loader.num_workers else 1
        count = workers * (prefetch + -(-self.hold // workers))
        states = shared_empty(count, dtype=torch.uint8)
        self._slots = [shared_empty(self.max_batch_bytes, dtype=torch.uint8) for _ in range(count)]
        self._states, self._state = states, states.numpy()

    def _set(self, index: int, old: int, new: int) -> bool:
        """Move slot ``index`` from ``old`` to ``new``; False if it was not ``old``."""
        state = self._state
        if state is None or state[index] != old:
            return False
        state[index] = new
        return True

    def _reclaim(self) -> None:
        """Free the slots taken by workers whose batches never arrived (only while no
        worker of this object runs)."""
        for k in range(len(self._slots)):
            self._set(k, _TAKEN, _FREE)

    def _rebuild(self, item: Any) -> Any:
        if not isinstance(item, _SlotBatch):
            self._fallbacks += 1
            return item
        if self._closed:
            raise ValueError("SharedBatches was closed during a pass")
        slot = self._slots[item.index]
        if not self._set(item.index, _TAKEN, _OUT):
            raise RuntimeError(f"slot {item.index} arrived without being taken")
        # One storage per batch, over the slot: when it dies (every tensor of the batch,
        # here and in calls in flight), the slot is free again.
        array = slot.numpy()[:]
        storage = torch.from_numpy(array).untyped_storage()
        weakref.finalize(array, self._release, item.index).atexit = False
        del array
        self._batches += 1

        def leaf(x: _Leaf) -> torch.Tensor:
            t = torch.empty(0, dtype=x.dtype)
            return t.set_(storage, x.offset // x.dtype.itemsize, x.shape, x.stride)

        return _rebuild(item.tree, leaf)

    def _release(self, index: int) -> None:
        if not self._closed:
            self._set(index, _OUT, _FREE)

    # -- the loader's workers -----------------------------------------------------------

    def collate(self, samples: Any) -> Any:
        """The loader's ``collate_fn``: the batch collated into a free slot (in a worker),
        or by the plain collate when none is free or the batch does not fit."""
        index = self._take()
        if index is None:
            return self._plain(samples)
        packer = _Packer(self._slots[index])
        made: Any = None
        try:
            if self._collate is not None:
                # (run once: its batch is the fallback too, and its errors are its own)
                made = self._collate(samples)
                tree = packer.tree(made)
            elif self._convert:
                tree = packer.tree(samples)
            else:
                from torch.utils.data._utils.collate import collate, default_collate_fn_map

                fns: dict[type | tuple[type, ...], Callable[..., Any]] = dict(
                    default_collate_fn_map
                )
                fns[torch.Tensor] = packer.stack
                tree = packer.tree(collate(samples, collate_fn_map=fns))
        except (_Overflow, RuntimeError):
            # Too large, not placeable, or samples torch cannot stack: the plain collate
            # makes the batch (or raises the error it raises without slots).
            self._set(index, _TAKEN, _FREE)
            if self._collate is not None:
                if made is None:
                    raise  # (the user's collate itself failed)
                return made
            return self._plain(samples)
        except BaseException:
            self._set(index, _TAKEN, _FREE)
            raise
        return _SlotBatch(index, tree)

    def _take(self) -> int | None:
        """A free slot of this worker's, now taken; None if there is none."""
        if self._fds:
            self._attach()
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for k in range(first, len(self._slots), step):
            if self._set(k, _FREE, _TAKEN):
                return k
        return None

    def _plain(self, samples: Any) -> Any:
        if self._collate is not None:
            return self._collate(samples)
        if self._convert:
            return torch.utils.data.default_convert(samples)  # type: ignore[no-untyped-call]
        return torch.utils.data.default_collate(samples)

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned worker gets (the loader pickles ``collate`` to start it): the
        settings, and the slots and their states as descriptors, mapped there on first
        use (`_attach`)."""
        from multiprocessing.reduction import DupFd

        from tensorrpc.transports._shared import lookup

        fds = []
        for t in [*self._slots, *([] if self._states is None else [self._states])]:
            block = lookup(t.untyped_storage())
            if block is None:  # pragma: no cover - our own blocks, made in this process
                raise RuntimeError("a SharedBatches slot is not tensorrpc shared memory")
            fds.append(DupFd(block.fd))
        state = dict(self.__dict__)
        state.update(_slots=[], _states=None, _state=None, _fds=fds, _loader=None, _current=None)
        return state

    def _attach(self) -> None:
        """Map the slots whose descriptors came with this object (a spawned worker)."""
        import os

        from tensorrpc.transports._shm_pool import map_shared_owned

        fds, self._fds = self._fds, []
        maps = []
        for dup in fds:
            fd = dup.detach()
            maps.append(map_shared_owned(fd, os.fstat(fd).st_size, on_unmap=_close_fd))
        if maps:
            states = maps.pop()
            self._slots = [m[: self.max_batch_bytes] for m in maps]
            self._states = states[: len(self._slots)]
            self._state = self._states.numpy()


def _close_fd(_addr: int, fd: int) -> None:
    import os

    with contextlib.suppress(OSError):
        os.close(fd)
