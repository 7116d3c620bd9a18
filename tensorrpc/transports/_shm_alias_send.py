"""The alias half of sending with ``torch_shm``: tensors already in shared memory.

A tensor in tensorrpc shared memory (`tensorrpc.share`), in torch's own shared memory
(``share_memory_()``, to a peer past the unsealed-alias gate) or on a CUDA device goes by
a handle that names its storage: no byte is copied. `AliasSending` is a base class of
`TorchShmTransport`, which provides the leases, the per-process budget and the
statistics these methods charge; every other tensor goes through the transport's pool.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Final

from tensorrpc._lazy import LazyModule
from tensorrpc.transports import _shared
from tensorrpc.transports._shm_handle import (
    CUDA_TAIL,
    U16,
    Handle,
    HandleKind,
    non_overlapping,
    pack,
    pack_fields,
)

if TYPE_CHECKING:
    import weakref
    from collections.abc import Hashable

    import torch

    from tensorrpc.transports._shm_budget import PeerBudget
    from tensorrpc.transports.torch_shm import ShmPlacer, _Lease
else:
    torch = LazyModule("torch", globals())

__all__ = ["LIMITED", "AliasSending"]

_SHARED = HandleKind.SHARED
_TORCH_FD = HandleKind.TORCH_FD
_TORCH_FILE = HandleKind.TORCH_FILE
#: `AliasSending._place_shared_cpu`'s answer for a shared tensor over the peer's cap.
LIMITED: Final = b"limited"


class AliasSending:
    """Handles for tensors whose storage is already shared (a base class: the transport
    provides the attributes and methods declared here)."""

    _pid: int
    _budget: PeerBudget
    _stats: dict[str, int]
    #: Peers that may get torch's unsealed shared files by alias.
    _alias: set[Hashable]
    #: torch shared storages sent by alias -> their file (`_place_torch`).
    _torch_files: weakref.WeakKeyDictionary[torch.UntypedStorage, _TorchFile]

    def _account(self, peer: Hashable) -> Hashable:  # pragma: no cover - the transport's
        raise NotImplementedError

    def _needs_lease(self, placer: ShmPlacer) -> bool:  # pragma: no cover - the transport's
        raise NotImplementedError

    def _new_lease(self, placer: ShmPlacer) -> _Lease:  # pragma: no cover - the transport's
        raise NotImplementedError

    def _place_shared_cpu(self, placer: ShmPlacer, t: torch.Tensor) -> bytes | None:
        """The SHARED handle of ``t``; None when it is not in tensorrpc shared memory (or
        cannot be aliased); `LIMITED` when pinning it would put the peer over its cap."""
        if t.is_neg() or t.is_conj():
            return None  # its bits are not its values: copy it (resolving the view)
        storage = t.untyped_storage()
        block = _shared.lookup(storage)
        strides = t.stride()
        if block is None:
            if placer._peer not in self._alias:
                return None  # torch's own shared files cannot be sealed: they go by the pool
            return self._place_torch(placer, t, storage, strides)
        if not (t.is_contiguous() or non_overlapping(tuple(t.shape), strides)):
            return None
        shared = (_SHARED, block.fd, block.dev, block.ino, 0, None)
        return self._pin(placer, t, storage, storage.nbytes(), strides, shared)

    def _place_torch(
        self,
        placer: ShmPlacer,
        t: torch.Tensor,
        storage: torch.UntypedStorage,
        strides: tuple[int, ...],
    ) -> bytes | None:
        """The handle of a tensor in torch's own shared memory, to a peer past the gate.

        Never moves the caller's storage: ``_share_filename_cpu_`` is only asked of a
        storage that is shared and not by descriptor (torch's ``file_system`` files),
        where it returns the existing name. What the file is (``_torch_file``) is looked
        up once per storage and kept while the storage lives: a shared storage never
        changes its file, and sending one tensor again costs no ``fstat``.
        """
        if not storage.is_shared():
            return None  # private memory: the pool
        if not (t.is_contiguous() or non_overlapping(tuple(t.shape), strides)):
            return None
        nbytes = storage.nbytes()
        facts = self._torch_files.get(storage)
        if facts is None:
            facts = _torch_file(storage, nbytes)
            if facts is None:
                return None  # not one of torch's shared files after all: the pool
            self._torch_files[storage] = facts
        return self._pin(placer, t, storage, nbytes, strides, facts)

    def _pin(
        self,
        placer: ShmPlacer,
        t: torch.Tensor,
        storage: torch.UntypedStorage,
        nbytes: int,
        strides: tuple[int, ...],
        file: _TorchFile,
    ) -> bytes:
        """Charge ``storage`` (``nbytes``, in ``file``) to the peer's process and pin it
        under the message's lease; its handle, or `LIMITED` when the peer is over its cap."""
        kind, fd, dev, ino, base, owned = file
        key = (dev, ino)
        account = self._account(placer._peer)
        if not self._budget.try_pin(account, key, nbytes, new_lease=self._needs_lease(placer)):
            self._stats["peer_limited"] += 1
            return LIMITED
        lease = self._new_lease(placer)
        lease.keep.append(storage)
        if owned is not None:
            lease.keep.append(owned)
        lease.pins.append(key)
        return pack_fields(
            kind,
            self._pid,
            fd,
            dev,
            ino,
            lease.id,
            0,
            base,
            nbytes,
            int(t.storage_offset()),
            strides,
            b"",
        )

    def _place_cuda(self, placer: ShmPlacer, t: torch.Tensor) -> bytes | None:  # pragma: no cover
        if not non_overlapping(tuple(t.shape), tuple(t.stride())):
            return None
        try:
            (
                device,
                handle,
                size_bytes,
                offset_bytes,
                ref_handle,
                ref_offset,
                event_handle,
                event_sync,
            ) = t.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
        except RuntimeError:
            return None
        if handle is None:
            return None
        parts = [bytes(handle), bytes(ref_handle), bytes(event_handle)]
        tail = CUDA_TAIL.pack(device, size_bytes, offset_bytes, ref_offset, bool(event_sync))
        tail += b"".join(U16.pack(len(p)) + p for p in parts)
        lease = self._new_lease(placer)
        lease.keep.append(t)
        h = Handle(
            HandleKind.CUDA,
            self._pid,
            -1,
            0,
            0,
            lease.id,
            0,
            0,
            size_bytes,
            int(t.storage_offset()),
            tuple(t.stride()),
            tail,
        )
        return pack(h)


#: What `_place_torch` needs of a storage's file: kind, descriptor, st_dev, st_ino, data
#: offset in the file, and the descriptor we opened for it (file_system files), if any.
_TorchFile = tuple[HandleKind, int, int, int, int, "_OwnedFd | None"]


def _torch_file(storage: torch.UntypedStorage, nbytes: int) -> _TorchFile | None:
    """The file of a storage in torch's shared memory; None if it is not one of them."""
    owned: _OwnedFd | None = None
    try:
        try:
            fd = storage._get_shared_fd()  # type: ignore[attr-defined]
            kind = _TORCH_FD
        except RuntimeError:  # file_system: open its file, held while the storage lives
            _manager, name, _size = storage._share_filename_cpu_()
            path = "/dev/shm/" + bytes(name).decode("ascii").lstrip("/")
            owned = _OwnedFd(os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW))
            fd = owned.fd
            kind = _TORCH_FILE
        st = os.fstat(fd)
    except (OSError, RuntimeError, UnicodeDecodeError, ValueError, TypeError):
        return None
    # torch's file_system files start with a 64-byte reference count; the data follows.
    base = st.st_size - nbytes if kind == _TORCH_FILE else 0
    if base not in (0, 64) or st.st_size < nbytes:
        return None
    return kind, fd, st.st_dev, st.st_ino, base, owned


class _OwnedFd:
    """A descriptor a lease holds open (a torch ``file_system`` file named in a handle);
    closed when the lease lets go of it."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
