"""What a batched handler sees while it runs, and tensor helpers for batches.

A handler declared ``@rpc(batch=Batching(...))`` or ``@rpc(batch=Continuous(...))`` reads
its batch with [`current_batch`][tensorrpc.batching.current_batch]; `stack`, `split`,
`pad` and `unpad` build one batch tensor from the items' tensors and split a result back,
copying at most once. See docs/batching.md.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from tensorrpc._batching import Batching, Continuous
from tensorrpc._exceptions import TensorRPCError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from tensorrpc._context import CallContext

__all__ = [
    "BatchContext",
    "BatchItem",
    "Batching",
    "Continuous",
    "current_batch",
    "pad",
    "split",
    "stack",
    "unpad",
]


class BatchItem:
    """One item of a running batch, as the handler sees it.

    Attributes:
        state: The handler's own slot for this item (continuous batching: kept from
            step to step; ``None`` at the item's first step).
        steps: Outputs this item produced before this step (0 at its first step).
        context: The item's call ([`CallContext`][tensorrpc.CallContext]: its caller,
            metadata, deadline; set its response metadata here); None outside an engine
            (a batch built by hand).
        waited: Seconds the item waited in the queue, from its arrival to the start of
            its batch (continuous batching: of the step it joined).
    """

    __slots__ = ("context", "state", "steps", "waited")

    def __init__(self, context: CallContext | None = None) -> None:
        self.state: Any = None
        self.steps = 0
        self.context = context
        self.waited = 0.0

    @property
    def first(self) -> bool:
        """Whether this is the item's first step (it just joined)."""
        return self.steps == 0


class BatchContext:
    """The batch (or step) a batched handler is running; from `current_batch`.

    Indices are positions in this batch's argument lists (for continuous batching: in
    this step's lists; an item's position changes as others join and leave, so keep what
    must last in ``items[i].state``).
    """

    __slots__ = ("_cancelled", "_continuous", "_ended", "_failed", "items")

    def __init__(self, items: Sequence[BatchItem], *, continuous: bool) -> None:
        #: The items, in the order of the argument lists.
        self.items = items
        self._continuous = continuous
        self._cancelled: set[int] = set()
        self._failed: dict[int, BaseException] = {}
        self._ended: dict[int, bool] = {}

    @property
    def size(self) -> int:
        """Items in this batch (this step)."""
        return len(self.items)

    def cancelled(self) -> frozenset[int]:
        """The items whose caller cancelled (or whose deadline passed) since the batch
        started: their results are discarded, skip their work if you can."""
        return frozenset(self._cancelled)

    def fail(self, index: int, error: BaseException) -> None:
        """Fail item ``index`` only: its caller gets ``error`` as a
        [`RemoteError`][tensorrpc.RemoteError] (type and traceback); the value returned
        for it is ignored. A continuous item leaves the batch."""
        self._check(index)
        if not isinstance(error, BaseException):
            raise TypeError(f"fail() takes an exception, got {type(error).__name__}")
        self._failed[index] = error

    def end(self, index: int, *, send: bool = True) -> None:
        """Continuous batching: item ``index``'s stream ends after this step.

        Args:
            index: The item.
            send: Whether this step's output for it is sent first (False: it is dropped).
        """
        if not self._continuous:
            raise TensorRPCError(
                "end() is for Continuous batching (a Batching item ends with its result)"
            )
        self._check(index)
        self._ended[index] = send

    def _check(self, index: int) -> None:
        if type(index) is not int or not 0 <= index < len(self.items):
            raise IndexError(f"batch item index {index!r} out of range 0..{len(self.items) - 1}")


_CURRENT: contextvars.ContextVar[BatchContext] = contextvars.ContextVar("tensorrpc_batch")


def current_batch() -> BatchContext:
    """The batch the calling handler is running (also in a sync handler's thread).

    Raises:
        TensorRPCError: Called outside a batched handler.
    """
    try:
        return _CURRENT.get()
    except LookupError:
        raise TensorRPCError("current_batch() is only available inside a batched handler") from None


# ------------------------------------------------------------------------------- tensors


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The items' tensors as one batch tensor, with a new first dimension.

    Tensors that are consecutive rows of one tensor (e.g. what `split` returned) give a
    view of it (no copy); anything else is copied once into the batch tensor.

    Raises:
        ValueError: No tensors, or shapes/dtypes/devices that differ.
    """
    import torch

    if not tensors:
        raise ValueError("stack() needs at least one tensor")
    first = tensors[0]
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"stack() needs tensors of one shape, dtype and device; got {tuple(first.shape)} "
                f"{first.dtype} {first.device} and {tuple(t.shape)} {t.dtype} {t.device}"
            )
    view = _rows_view(tensors)
    if view is not None:
        return view
    return torch.stack(list(tensors))


def _rows_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A view of ``tensors`` as rows of one tensor, when their memory already is that."""
    first = tensors[0]
    if not first.is_contiguous() or first.numel() == 0:
        return None
    storage = first.untyped_storage().data_ptr()
    step = first.numel()
    offset = first.storage_offset()
    for i, t in enumerate(tensors):
        if (
            not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset + i * step
        ):
            return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), offset)


def split(batch: torch.Tensor) -> list[torch.Tensor]:
    """One view per row of ``batch`` (its first dimension): no copy."""
    return list(batch.unbind(0))


def pad(sequences: Sequence[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length sequences (first dimension) as one padded batch and its mask.

    Returns:
        ``(padded, mask)``: ``padded`` is ``(batch, longest, *rest)``, filled with
        ``value`` after each sequence's end; ``mask`` is ``(batch, longest)`` bool, True
        where a position holds data. One copy (into ``padded``).

    Raises:
        ValueError: No sequences, or trailing shapes/dtypes/devices that differ.
    """
    import torch

    if not sequences:
        raise ValueError("pad() needs at least one sequence")
    first = sequences[0]
    rest = first.shape[1:]
    for s in sequences:
        if s.dim() < 1 or s.shape[1:] != rest or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(
                "pad() needs sequences with one trailing shape, dtype and device; got "
                f"{tuple(first.shape)} {first.dtype} and {tuple(s.shape)} {s.dtype}"
            )
    lengths = [int(s.shape[0]) for s in sequences]
    longest = max(lengths)
    padded = torch.full(
        (len(sequences), longest, *rest), value, dtype=first.dtype, device=first.device
    )
    mask = torch.zeros((len(sequences), longest), dtype=torch.bool, device=first.device)
    for i, s in enumerate(sequences):
        padded[i, : lengths[i]] = s
        mask[i, : lengths[i]] = True
    return padded, mask


def unpad(padded: torch.Tensor, lengths: Sequence[int] | torch.Tensor) -> list[torch.Tensor]:
    """Row ``i`` of ``padded`` cut to ``lengths[i]`` (a mask's row sums work): views.

    Raises:
        ValueError: A length out of range, or not one length per row.
    """
    counts = [int(n) for n in lengths]
    if len(counts) != padded.shape[0]:
        raise ValueError(f"unpad(): {len(counts)} lengths for {padded.shape[0]} rows")
    out = []
    for i, n in enumerate(counts):
        if not 0 <= n <= padded.shape[1]:
            raise ValueError(f"unpad(): length {n} of row {i} out of range 0..{padded.shape[1]}")
        out.append(padded[i, :n])
    return out
