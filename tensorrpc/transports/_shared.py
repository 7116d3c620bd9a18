"""Tensors born in tensorrpc shared memory: sent by ``torch_shm`` by alias, with no copy.

`shared_empty` and `share` make CPU tensors whose storage is a sealed
``memfd`` (``memfd_create(2)`` with ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): its
size can never change, so a peer that maps it can never be hit by ``SIGBUS``. The
``torch_shm`` transport sends such a tensor (or any non-overlapping view of it) by
handle: the receiver maps the same memory and writes are visible to both sides.

Tensors that torch itself put in shared memory (``share_memory_()``,
``torch.multiprocessing``) live in files torch cannot seal; ``torch_shm`` copies those
into its pool like any other tensor.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorrpc._lazy import LazyModule
from tensorrpc.transports._shm_pool import PAGE_SIZE, map_shared_owned, pid as current_pid

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())

__all__ = ["SharedBlock", "lookup", "share", "shared_empty"]

#: memfd name prefix of shared tensors (``/memfd:tensorrpc-shared-<pid>-<n>``).
SHARED_PREFIX = "tensorrpc-shared-"

_lock = threading.Lock()
_blocks: dict[int, SharedBlock] = {}
_seq = itertools.count(1)


@dataclass(frozen=True, slots=True)
class SharedBlock:
    """One sealed memfd under a shared tensor's storage."""

    #: Its descriptor (open for as long as the storage lives).
    fd: int
    #: ``st_dev`` and ``st_ino`` of the memfd.
    dev: int
    ino: int
    #: Its size in bytes (a page multiple).
    size: int
    #: The process that created it (a forked child must not send its parent's blocks).
    pid: int


def lookup(storage: torch.UntypedStorage) -> SharedBlock | None:
    """The shared block a CPU storage lives in, or None for any other storage."""
    with _lock:
        block = _blocks.get(storage.data_ptr())
    if block is None or block.pid != current_pid() or storage.nbytes() > block.size:
        return None
    return block


def _forget(addr: int, fd: int) -> None:
    with _lock:
        _blocks.pop(addr, None)
    with contextlib.suppress(OSError):  # closed at interpreter shutdown
        os.close(fd)


def shared_empty(
    *size: int | tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor in tensorrpc shared memory.

    Sent through ``torch_shm`` (``transport="torch_shm"``, or ``"auto"`` at or above the
    threshold) it travels by alias: the receiver's tensor is this memory, no byte is
    copied, and writes are seen on both sides. Its memory is freed when the last tensor
    viewing it, here or in any receiver, is gone.

    Args:
        *size: The shape, as integers or one sequence (like ``torch.empty``).
        dtype: The element type; None (the default) is torch's default dtype
            (``torch.get_default_dtype()``, float32 unless changed), as for ``torch.empty``.

    Returns:
        A C-contiguous tensor (its bytes are zero on creation).

    Raises:
        OSError: The kernel refused the memory (``memfd_create``, ``mmap``).
        ValueError: A negative dimension.
    """
    if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size):
        shape = tuple(int(n) for n in size[0])
    else:
        shape = tuple(int(n) for n in size)  # type: ignore[arg-type]
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimension in {shape}")
    if dtype is None:
        dtype = torch.get_default_dtype()
    nbytes = math.prod(shape) * dtype.itemsize
    length = max(PAGE_SIZE, -(-nbytes // PAGE_SIZE) * PAGE_SIZE)
    pid = os.getpid()
    fd = os.memfd_create(
        f"{SHARED_PREFIX}{pid}-{next(_seq)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    )
    try:
        os.ftruncate(fd, length)
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        )
        st = os.fstat(fd)
        view = map_shared_owned(fd, length, on_unmap=_forget)
    except BaseException:
        os.close(fd)
        raise
    with _lock:
        _blocks[view.data_ptr()] = SharedBlock(fd, st.st_dev, st.st_ino, length, pid)
    return view[:nbytes].view(dtype).view(shape)


def share(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor in tensorrpc shared memory (see `shared_empty`).

    Copy once, then send it (and reuse it) by alias as often as you like.
    """
    out = shared_empty(tuple(tensor.shape), dtype=tensor.dtype)
    with torch.no_grad():
        out.copy_(tensor.detach())
    return out
