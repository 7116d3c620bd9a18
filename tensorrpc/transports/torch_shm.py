"""``torch_shm``: tensors cross between processes on one host as shared memory; a handle travels.

How a tensor goes (sender: [`ShmPlacer.place`][tensorrpc.transports.torch_shm.ShmPlacer.place];
receiver: [`ShmResolver.resolve`][tensorrpc.transports.torch_shm.ShmResolver.resolve]):

* **Already shared** (its storage is in torch shared memory, under either sharing strategy):
  the handle names the storage and the receiver maps it. No byte is copied and the
  received tensor **aliases the sender's memory**: writes on either side are seen by the
  other. ``file_descriptor`` storages are opened through ``/proc/<pid>/fd/<fd>``;
  ``file_system`` storages by their name in ``/dev/shm``. CUDA tensors go through torch's
  CUDA IPC and alias too.
* **Anything else** is copied once into a region of a ``memfd`` segment that the sender's
  transport owns and reuses, and the receiver copies it out into memory of its own (a
  recycled buffer for large tensors), so one copy on each side: the received tensor is
  private. The caller's tensor is only read; its storage is never moved or re-shared, and
  process-wide torch settings (the sharing strategy) are never touched.

Runtime integration, in five calls (one
[`TorchShmTransport`][tensorrpc.transports.torch_shm.TorchShmTransport] per process or endpoint)::

    shm = TorchShmTransport()                      # close() (or `with`) at shutdown
    # handshake: offer "torch_shm" with shm.probe_handle(); the peer checks it with
    # shm.check_probe(handle, peer_pid) and only uses torch_shm if it passes (same host id).
    placer = shm.placer(peer=engine_id)            # one per outgoing message
    enc = encode(value, placer=placer)             # codec calls placer.place(t)
    lease = placer.lease                           # None: nothing went by handle
    # ... send; when the peer confirms it attached (the reply to a CALL confirms its
    # arguments; for a RESULT/STREAM_ITEM the client sends RELEASE with the lease ids
    # its resolver saw): shm.release(lease, peer=engine_id)
    # if the message is never sent: placer.abort()
    resolver = shm.resolver(peer_pid)              # per incoming message (or per peer)
    value = decode(payload, buffers, resolver=resolver)
    resolver.leases                                # lease ids to send back in RELEASE
    # peer died: shm.release_peer(peer); shm.forget_peer(peer_pid)
    # every few seconds: shm.sweep() (leases older than lease_timeout are dropped)
    # the peer's resolve failed (ERROR TENSOR_TRANSPORT): resend with frames and call
    # shm.record_fallback(n_tensors, nbytes); shm.disable_peer(peer) to stop trying.

Why ``/proc/<pid>/fd`` rather than ``SCM_RIGHTS``: the handle rides inside the normal
message over any ZMQ transport with no side channel, no extra socket and no descriptor
passing race; a descriptor received over ``SCM_RIGHTS`` would also have to be matched to
its message. Opening ``/proc/<pid>/fd/<n>`` needs the kernel's ``PTRACE_MODE_READ`` check:
same uid and a dumpable peer (Yama's ``ptrace_scope`` restricts attaching only, not this),
and a ``/proc`` that shows the peer (same pid namespace, no ``hidepid``). When that fails,
[`TorchShmTransport.check_probe`][tensorrpc.transports.torch_shm.TorchShmTransport.check_probe]
says so at handshake and the runtime uses frames.

Every handle from the wire is checked before any memory is touched: its format and
bounds, that its pid is the peer's, and that the descriptor or name really is a
tensorrpc memfd (``/memfd:tensorrpc-… (deleted)``, on the memfd device, sealed against
shrinking) or a torch segment (``/dev/shm/torch_…``, on the ``/dev/shm`` device, owned by
us); the path is only ``stat``-ed before the checks pass, and the opened file must be the
same inode. A forged handle raises [`TensorTransportError`][tensorrpc.TensorTransportError].
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import os
import random
import re
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, Final

import torch

from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports._shm_pool import (
    PAGE_SIZE,
    REGION_HEADER,
    BufferCache,
    Segment,
    SegmentPool,
    map_shared,
    memfd_device,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable
    from types import TracebackType

__all__ = [
    "TRANSPORT_NAME",
    "HandleKind",
    "ShmPlacer",
    "ShmResolver",
    "TorchShmStatistics",
    "TorchShmTransport",
]

#: The name this transport goes by in descriptors and handshakes.
TRANSPORT_NAME: Final = "torch_shm"

_MAGIC = b"TRSH"
_VERSION = 1
# magic, version, kind, ndim, pid, fd, dev, ino, lease, tag, base, span, elem_offset
_HEAD = struct.Struct("<4sBBHiiQQQQQQq")
_CUDA_TAIL = struct.Struct("<iQQQB")
_U16 = struct.Struct("<H")
_MAX_NDIM = 64
_MAX_HANDLE = 4096
_MAX_FD = 1 << 20  # the kernel's hard ceiling on fs.nr_open
_MAX_SPAN = 1 << 46
_MAX_BASE = 1 << 46
_MAX_TORCH_BASE = 4096  # torch puts at most a small refcount header before the data
_MEMFD_PREFIX = "tensorrpc-"
_MEMFD_RE = re.compile(r"/memfd:tensorrpc-[0-9]+-[0-9]+ \(deleted\)")
_TORCH_FD_RE = re.compile(r"/dev/shm/torch_[0-9]+_[0-9]+_[0-9]+ \(deleted\)")
_TORCH_NAME_RE = re.compile(r"/torch_[0-9]+_[0-9]+_[0-9]+")
_SHM_DIR = "/dev/shm"
_PROBE = b"tensorrpc-torch_shm-probe-v1".ljust(64, b".")


class HandleKind(IntEnum):
    """Where a handle's bytes live (byte 5 of the handle)."""

    #: A tensor with no elements: nothing to map.
    EMPTY = 0
    #: A region of the sender's memfd pool; the receiver copies it out.
    POOL = 1
    #: A torch ``file_descriptor``-strategy storage, opened via ``/proc/<pid>/fd/<fd>``.
    TORCH_FD = 2
    #: A torch ``file_system``-strategy storage, opened by its name in ``/dev/shm``.
    TORCH_FILE = 3
    #: A CUDA storage shared through torch's CUDA IPC.
    CUDA = 4


@dataclass(frozen=True, slots=True)
class TorchShmStatistics:
    """A snapshot of one [`TorchShmTransport`][tensorrpc.transports.torch_shm.TorchShmTransport]'s
    counters."""

    #: Tensors sent by handle (copied into the pool or aliased).
    tensors_sent: int
    #: Bytes of those tensors.
    bytes_sent: int
    #: Of ``tensors_sent``, those sent without a copy (already in shared memory, or CUDA).
    tensors_aliased: int
    #: Tensors received by handle.
    tensors_received: int
    #: Bytes of those tensors.
    bytes_received: int
    #: Tensors that could not go by handle and went (or must go) as frames instead.
    fallbacks: int
    #: Leases not yet released (messages whose receiver has not confirmed).
    leases_active: int
    #: Leases dropped by
    #: [`TorchShmTransport.sweep`][tensorrpc.transports.torch_shm.TorchShmTransport.sweep] or
    #: ``release_peer``.
    leases_expired: int
    #: memfd segments in the sender's pool.
    pool_segments: int
    #: Bytes in those segments.
    pool_bytes: int
    #: Bytes of the pool handed out to leases right now.
    pool_bytes_in_use: int
    #: Peers' pool segments this receiver keeps mapped.
    mapped_segments: int


@dataclass(slots=True)
class _Lease:
    id: int
    peer: Hashable
    created: float
    regions: list[tuple[Segment, int, int]]
    keep: list[object]


@dataclass(frozen=True, slots=True)
class _Handle:
    kind: HandleKind
    pid: int
    fd: int
    dev: int
    ino: int
    lease: int
    tag: int
    base: int
    span: int
    elem_offset: int
    strides: tuple[int, ...]
    tail: bytes


def _fail(message: str) -> TensorTransportError:
    return TensorTransportError(f"torch_shm: {message}")


def _pack(h: _Handle) -> bytes:
    head = _HEAD.pack(
        _MAGIC,
        _VERSION,
        h.kind,
        len(h.strides),
        h.pid,
        h.fd,
        h.dev,
        h.ino,
        h.lease,
        h.tag,
        h.base,
        h.span,
        h.elem_offset,
    )
    return head + struct.pack(f"<{len(h.strides)}q", *h.strides) + h.tail


def _unpack(handle: bytes) -> _Handle:
    if not isinstance(handle, bytes | bytearray | memoryview):
        raise _fail(f"handle must be bytes, not {type(handle).__name__}")
    data = bytes(handle)
    if not _HEAD.size <= len(data) <= _MAX_HANDLE:
        raise _fail(f"handle of {len(data)} bytes (expected {_HEAD.size}..{_MAX_HANDLE})")
    (magic, version, kind, ndim, pid, fd, dev, ino, lease, tag, base, span, elem_offset) = (
        _HEAD.unpack_from(data)
    )
    if magic != _MAGIC:
        raise _fail("not a torch_shm handle (bad magic)")
    if version != _VERSION:
        raise _fail(f"handle version {version} not supported (this side speaks {_VERSION})")
    try:
        kind = HandleKind(kind)
    except ValueError:
        raise _fail(f"unknown handle kind {kind}") from None
    if ndim > _MAX_NDIM:
        raise _fail(f"handle with {ndim} dimensions")
    end = _HEAD.size + 8 * ndim
    if len(data) < end:
        raise _fail("handle truncated in its strides")
    strides = struct.unpack_from(f"<{ndim}q", data, _HEAD.size)
    return _Handle(
        kind, pid, fd, dev, ino, lease, tag, base, span, elem_offset, strides, data[end:]
    )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (0-d tensors included)."""
    return t.reshape(-1).view(torch.uint8)


class ShmPlacer:
    """Places the tensors of one outgoing message (implements the codec's ``TensorPlacer``).

    Made by [`TorchShmTransport.placer`][tensorrpc.transports.torch_shm.TorchShmTransport.placer].
    Everything placed through one placer shares
    one lease, kept by the transport until
    [`TorchShmTransport.release`][tensorrpc.transports.torch_shm.TorchShmTransport.release].
    """

    __slots__ = ("_lease", "_peer", "_transport")

    def __init__(self, transport: TorchShmTransport, peer: Hashable) -> None:
        self._transport = transport
        self._peer = peer
        self._lease: _Lease | None = None

    @property
    def lease(self) -> int | None:
        """The lease id to release once the peer has attached (None: nothing placed)."""
        return None if self._lease is None else self._lease.id

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        """Put ``tensor`` in shared memory and return ``("torch_shm", handle)``.

        Returns:
            None when this tensor cannot go by handle (unsupported layout or device, the
            pool is full, the peer is disabled); the codec then sends it as a frame, and
            the transport counts a fallback.
        """
        return self._transport._place(self, tensor)

    def abort(self) -> None:
        """The message will not be sent: release what was placed at once."""
        if self._lease is not None:
            self._transport.release(self._lease.id)


class ShmResolver:
    """Resolves handles of incoming messages (implements the codec's ``TensorResolver``).

    Made by
    [`TorchShmTransport.resolver`][tensorrpc.transports.torch_shm.TorchShmTransport.resolver] for
    one peer; handles that name any other
    process are refused. Records the lease ids it saw, for the runtime to send back.
    """

    __slots__ = ("_leases", "_peer_pid", "_transport")

    def __init__(self, transport: TorchShmTransport, peer_pid: int | None) -> None:
        self._transport = transport
        self._peer_pid = peer_pid
        self._leases: list[int] = []

    @property
    def leases(self) -> tuple[int, ...]:
        """Distinct lease ids of the handles resolved so far, in order of appearance."""
        return tuple(dict.fromkeys(self._leases))

    def resolve(
        self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Build the tensor a handle describes.

        Returns:
            A private copy for pool handles; a tensor aliasing the sender's memory for
            already-shared storages (CPU or CUDA).

        Raises:
            TensorTransportError: the handle is malformed, does not match ``dtype`` and
                ``shape``, names anything but a tensorrpc/torch segment of the peer, or the
                segment cannot be opened (another host, no ``/proc`` access, sender gone).
        """
        if transport != TRANSPORT_NAME:
            raise _fail(f"cannot resolve a {transport!r} handle")
        h = _unpack(handle)
        tensor = self._transport._resolve(h, dtype, tuple(shape), self._peer_pid)
        self._leases.append(h.lease)
        return tensor


class _MappedSegment:
    __slots__ = ("size", "view")

    def __init__(self, view: torch.Tensor, size: int) -> None:
        self.view = view
        self.size = size


class TorchShmTransport:
    """The ``torch_shm`` tensor transport of one process: a memfd pool, leases, mappings.

    Args:
        segment_bytes: size of an ordinary pool segment (tensors are packed into it).
        pool_max_bytes: the pool never grows beyond this; a tensor that does not fit then
            falls back to frames.
        pool_keep_bytes: idle pool segments beyond this are closed when they empty.
        recv_cache_bytes: idle receive buffers kept for reuse (see ``BufferCache``).
        recv_cache_min_bytes: received copies smaller than this use torch's allocator.
        mapped_segments: how many peers' pool segments a receiver keeps mapped (LRU).
        lease_timeout: seconds after which `sweep` drops an unreleased lease.
        cuda: send CUDA tensors through CUDA IPC (else they fall back to frames).
        clock: monotonic clock, for tests.
    """

    #: Transport name used in descriptors.
    name: ClassVar[str] = TRANSPORT_NAME

    def __init__(
        self,
        *,
        segment_bytes: int = 16 << 20,
        pool_max_bytes: int = 4 << 30,
        pool_keep_bytes: int = 512 << 20,
        recv_cache_bytes: int = 512 << 20,
        recv_cache_min_bytes: int = 1 << 20,
        mapped_segments: int = 64,
        lease_timeout: float = 300.0,
        cuda: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._pool = SegmentPool(
            _MEMFD_PREFIX,
            segment_bytes=segment_bytes,
            max_bytes=pool_max_bytes,
            keep_bytes=pool_keep_bytes,
        )
        self._buffers = BufferCache(max_idle_bytes=recv_cache_bytes, min_bytes=recv_cache_min_bytes)
        self._maps: OrderedDict[tuple[int, int, int, int], _MappedSegment] = OrderedDict()
        self._max_maps = mapped_segments
        self._leases: dict[int, _Lease] = {}
        self._next_lease = 1
        self._disabled: set[Hashable] = set()
        self._lease_timeout = lease_timeout
        self._cuda = cuda
        self._clock = clock
        self._closed = False
        self._probe: tuple[bytes, int] | None = None
        self._memfd_dev = memfd_device()
        self._shm_dev = os.stat(_SHM_DIR).st_dev if os.path.isdir(_SHM_DIR) else -1
        self._rng = random.Random()
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "tensors_sent",
                "bytes_sent",
                "tensors_aliased",
                "tensors_received",
                "bytes_received",
                "fallbacks",
                "leases_expired",
            ),
            0,
        )

    # -- lifecycle -------------------------------------------------------------------------

    @staticmethod
    def available() -> bool:
        """Whether this platform has what torch_shm needs (Linux: memfd and ``/proc``)."""
        return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")

    def close(self) -> None:
        """Release every lease, close every segment and drop every mapping. Idempotent.

        Tensors already received stay valid (they own their memory or mapping).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for entry in self._leases.values():
                entry.regions.clear()
                entry.keep.clear()
            self._leases.clear()
            self._pool.close()
            self._maps.clear()
            self._probe = None
        self._buffers.close()

    def __enter__(self) -> TorchShmTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise _fail("transport is closed")
        if os.getpid() != self._pid:
            # A forked child must not allocate from (or release into) its parent's pool.
            self._pid = os.getpid()
            self._pool.abandon()
            self._leases.clear()
            self._maps.clear()
            self._probe = None

    # -- sender side ----------------------------------------------------------------------

    def placer(self, peer: Hashable = None) -> ShmPlacer:
        """A placer for one message to ``peer`` (any hashable id the runtime uses).

        Raises:
            TensorTransportError: the transport is closed.
        """
        with self._lock:
            self._check_open()
        return ShmPlacer(self, peer)

    def disable_peer(self, peer: Hashable) -> None:
        """Stop placing tensors for ``peer`` (its side cannot open our handles)."""
        with self._lock:
            self._disabled.add(peer)

    def record_fallback(self, tensors: int = 1, nbytes: int = 0) -> None:
        """Count tensors that were resent as frames after the peer failed to resolve them."""
        del nbytes  # kept in the signature for symmetry with the other counters
        with self._lock:
            self._stats["fallbacks"] += tensors

    def release(self, lease: int, *, peer: Hashable = ...) -> bool:
        """The peer has attached to everything under ``lease``: let it go.

        Pool regions become reusable and already-shared storages are no longer pinned.

        Args:
            lease: a lease id from
                [`ShmPlacer.lease`][tensorrpc.transports.torch_shm.ShmPlacer.lease] or a peer's
                RELEASE message.
            peer: when given, only release the lease if it was made for this peer.

        Returns:
            Whether a lease was released (False for unknown ids: released twice, expired,
            or forged).
        """
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or (peer is not ... and entry.peer != peer):
                return False
            del self._leases[lease]
            self._free_lease(entry)
            return True

    def release_peer(self, peer: Hashable) -> int:
        """The peer is gone: release every lease made for it. Returns how many."""
        with self._lock:
            dead = [lid for lid, e in self._leases.items() if e.peer == peer]
            for lid in dead:
                self._free_lease(self._leases.pop(lid))
            self._stats["leases_expired"] += len(dead)
            return len(dead)

    def sweep(self) -> int:
        """Release leases older than ``lease_timeout``. Returns how many.

        A receiver that attaches after its lease expired gets a clear error for pool
        handles (the region's tag no longer matches), never another message's bytes.
        """
        with self._lock:
            limit = self._clock() - self._lease_timeout
            old = [lid for lid, e in self._leases.items() if e.created <= limit]
            for lid in old:
                self._free_lease(self._leases.pop(lid))
            self._stats["leases_expired"] += len(old)
            return len(old)

    def _free_lease(self, entry: _Lease) -> None:
        for seg, off, n in entry.regions:
            if seg.fd >= 0:
                # Zero the tag first: a late reader of this region now fails cleanly.
                _write_u64(seg.view.data_ptr() + off, 0)
                self._pool.release(seg, off, n)
        entry.regions.clear()
        entry.keep.clear()

    def _new_lease(self, placer: ShmPlacer) -> _Lease:
        if placer._lease is None or placer._lease.id not in self._leases:
            # (A placer used again after its lease was released gets a fresh lease.)
            lid = self._next_lease
            self._next_lease += 1
            placer._lease = _Lease(lid, placer._peer, self._clock(), [], [])
            self._leases[lid] = placer._lease
        return placer._lease

    def _place(self, placer: ShmPlacer, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        copy: tuple[torch.Tensor, torch.Tensor] | None = None
        with self._lock:
            self._check_open()
            if placer._peer in self._disabled or not self._placeable(tensor):
                self._stats["fallbacks"] += 1
                return None
            t = tensor.detach()
            nbytes = t.numel() * t.element_size()
            handle: bytes | None
            if t.numel() == 0:
                lease = self._new_lease(placer)
                strides = _contiguous_strides(tuple(t.shape))
                handle = _pack(
                    _Handle(
                        HandleKind.EMPTY, self._pid, -1, 0, 0, lease.id, 0, 0, 0, 0, strides, b""
                    )
                )
                aliased = True
            elif t.is_cuda:
                handle, aliased = self._place_cuda(placer, t), True
            else:
                handle, aliased = self._place_shared_cpu(placer, t), True
                if handle is None:
                    got = self._place_pool(placer, t, nbytes)
                    if got is not None:
                        handle, copy = got
                        aliased = False
            if handle is None:
                self._stats["fallbacks"] += 1
                return None
            self._count_sent(nbytes, aliased=aliased)
        if copy is not None:
            # The region is ours until the lease is released: copy without the lock.
            _copy_into(*copy)
        return TRANSPORT_NAME, handle

    def _count_sent(self, nbytes: int, *, aliased: bool) -> None:
        self._stats["tensors_sent"] += 1
        self._stats["bytes_sent"] += nbytes
        if aliased:
            self._stats["tensors_aliased"] += 1

    def _placeable(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            return False
        if t.device.type == "cuda":
            return self._cuda
        return t.device.type == "cpu"

    def _place_pool(
        self, placer: ShmPlacer, t: torch.Tensor, nbytes: int
    ) -> tuple[bytes, tuple[torch.Tensor, torch.Tensor]] | None:
        try:
            got = self._pool.allocate(nbytes)
        except OSError:
            return None
        if got is None:
            return None
        seg, off, n = got
        lease = self._new_lease(placer)
        lease.regions.append((seg, off, n))
        data = off + REGION_HEADER
        tag = self._rng.getrandbits(63) | 1
        _write_u64(seg.view.data_ptr() + off, tag)
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        dst = seg.view[data : data + nbytes].view(t.dtype).view(t.shape)
        strides = _contiguous_strides(tuple(t.shape))
        h = _Handle(
            HandleKind.POOL,
            self._pid,
            seg.fd,
            seg.dev,
            seg.ino,
            lease.id,
            tag,
            data,
            nbytes,
            0,
            strides,
            b"",
        )
        return _pack(h), (dst, t)

    def _place_shared_cpu(self, placer: ShmPlacer, t: torch.Tensor) -> bytes | None:
        if t.is_conj() or t.is_neg():
            return None  # its bits are not its values: copy it (resolving the view)
        storage = t.untyped_storage()
        if not storage.is_shared():
            return None
        nbytes = storage.nbytes()
        try:
            fd: int | None = storage._get_shared_fd()  # type: ignore[attr-defined]
        except RuntimeError:
            fd = None
        if fd is not None:
            # file_descriptor strategy (at::MapAllocator). _get_shared_fd never moves data.
            if fd < 0:
                return None
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                st = os.fstat(fd)
            except OSError:
                return None
            if not _TORCH_FD_RE.fullmatch(target):
                return None
            kind, tail = HandleKind.TORCH_FD, b""
        else:
            # is_shared() and no MapAllocator: a THManagedMapAllocator (file_system
            # strategy), for which _share_filename_cpu_ only reads the existing handle.
            before = storage.data_ptr()
            _manager, name_b, _size = storage._share_filename_cpu_()
            assert storage.data_ptr() == before
            name = name_b.decode() if isinstance(name_b, bytes) else str(name_b)
            if not _TORCH_NAME_RE.fullmatch(name):
                return None
            try:
                st = os.stat(_SHM_DIR + name, follow_symlinks=False)
            except OSError:
                return None
            kind, tail, fd = HandleKind.TORCH_FILE, name.encode(), -1
        base = st.st_size - nbytes
        if not stat.S_ISREG(st.st_mode) or st.st_dev != self._shm_dev:
            return None
        if not 0 <= base <= _MAX_TORCH_BASE:
            return None
        lease = self._new_lease(placer)
        lease.keep.append(storage)
        h = _Handle(
            kind,
            self._pid,
            fd,
            st.st_dev,
            st.st_ino,
            lease.id,
            0,
            base,
            nbytes,
            int(t.storage_offset()),
            tuple(t.stride()),
            tail,
        )
        return _pack(h)

    def _place_cuda(self, placer: ShmPlacer, t: torch.Tensor) -> bytes | None:  # pragma: no cover
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
        tail = _CUDA_TAIL.pack(device, size_bytes, offset_bytes, ref_offset, bool(event_sync))
        tail += b"".join(_U16.pack(len(p)) + p for p in parts)
        lease = self._new_lease(placer)
        lease.keep.append(t)
        h = _Handle(
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
        return _pack(h)

    # -- handshake probe ------------------------------------------------------------------

    def probe_handle(self) -> bytes:
        """A handle to a small fixed pattern in our pool, kept for the transport's life.

        Send it in the handshake; the peer's `check_probe` tells whether it can open
        our segments (same host, same uid, ``/proc`` visible).

        Raises:
            TensorTransportError: the transport is closed or no segment could be made.
        """
        with self._lock:
            self._check_open()
            if self._probe is None:
                placer = ShmPlacer(self, _ProbePeer)
                src = torch.frombuffer(bytearray(_PROBE), dtype=torch.uint8)
                got = self._place_pool(placer, src, len(_PROBE))
                if got is None or placer._lease is None:
                    raise _fail("could not allocate the probe segment")
                handle, (dst, _src) = got
                _copy_into(dst, src)
                placer._lease.created = math.inf  # never swept
                self._probe = (handle, placer._lease.id)
            return self._probe[0]

    def check_probe(self, handle: bytes, peer_pid: int) -> bool:
        """Whether the peer's probe handle resolves here to the expected pattern."""
        try:
            h = _unpack(handle)
            if h.kind != HandleKind.POOL:
                return False
            got = self._resolve(h, torch.uint8, (len(_PROBE),), peer_pid, count=False)
        except TensorTransportError:
            return False
        return bytes(got.numpy().tobytes()) == _PROBE

    # -- receiver side --------------------------------------------------------------------

    def resolver(self, peer_pid: int | None) -> ShmResolver:
        """A resolver that accepts handles from the process ``peer_pid`` only.

        Args:
            peer_pid: the peer's pid from the handshake. ``None`` accepts any pid; use it
                only for tests and tools.

        Raises:
            TensorTransportError: the transport is closed.
        """
        with self._lock:
            self._check_open()
        return ShmResolver(self, peer_pid)

    def forget_peer(self, peer_pid: int) -> int:
        """Unmap the peer's pool segments (it died or left). Returns how many."""
        with self._lock:
            keys = [k for k in self._maps if k[0] == peer_pid]
            for k in keys:
                del self._maps[k]
            return len(keys)

    def statistics(self) -> TorchShmStatistics:
        """The counters and pool gauges as a frozen snapshot."""
        with self._lock:
            return TorchShmStatistics(
                leases_active=sum(1 for e in self._leases.values() if e.peer is not _ProbePeer),
                pool_segments=len(self._pool.segments),
                pool_bytes=self._pool.total_bytes,
                pool_bytes_in_use=self._pool.used_bytes,
                mapped_segments=len(self._maps),
                **self._stats,
            )

    def _resolve(
        self,
        h: _Handle,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        peer_pid: int | None,
        *,
        count: bool = True,
    ) -> torch.Tensor:
        if not isinstance(dtype, torch.dtype):
            raise _fail(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
        if len(shape) != len(h.strides):
            raise _fail(f"handle has {len(h.strides)} dimensions, descriptor {len(shape)}")
        if any(not isinstance(n, int) or n < 0 for n in shape):
            raise _fail(f"bad shape {shape!r}")
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        nbytes = numel * itemsize
        if numel == 0:
            if h.kind != HandleKind.EMPTY:
                raise _fail("handle for an empty tensor must be EMPTY")
            out = torch.empty(shape, dtype=dtype)
        elif h.kind == HandleKind.EMPTY:
            raise _fail("EMPTY handle for a tensor with elements")
        else:
            if peer_pid is not None and h.pid != peer_pid:
                raise _fail(f"handle names pid {h.pid}, but the peer is pid {peer_pid}")
            if h.pid <= 0:
                raise _fail(f"bad pid {h.pid}")
            if any(s < 0 for s in h.strides) or h.elem_offset < 0:
                raise _fail("negative stride or offset")
            if not 0 < h.span <= _MAX_SPAN or not 0 <= h.base <= _MAX_BASE:
                raise _fail(f"span {h.span} or base {h.base} out of range")
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, h.strides, strict=True))
            start = h.elem_offset * itemsize
            if start + extent * itemsize > h.span:
                raise _fail(
                    f"tensor needs bytes {start}..{start + extent * itemsize} of a "
                    f"{h.span}-byte storage"
                )
            with self._lock:
                self._check_open()
            if h.kind == HandleKind.POOL:
                out = self._resolve_pool(h, dtype, shape, nbytes)
            elif h.kind in (HandleKind.TORCH_FD, HandleKind.TORCH_FILE):
                out = self._resolve_torch(h, dtype, shape, start, extent * itemsize)
            else:
                out = self._resolve_cuda(h, dtype, shape)
        if count:
            with self._lock:
                self._stats["tensors_received"] += 1
                self._stats["bytes_received"] += nbytes
        return out

    def _open_proc_fd(
        self, pid: int, fd: int, h: _Handle, pattern: re.Pattern[str], fs_dev: int
    ) -> tuple[int, os.stat_result]:
        if not 0 <= fd < _MAX_FD:
            raise _fail(f"fd {fd} out of range")
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(path)
        except FileNotFoundError:
            raise _fail(f"process {pid} has no fd {fd} (gone, or on another host)") from None
        except PermissionError:
            raise _fail(
                f"no access to {path}: torch_shm needs both processes under the same uid, "
                "a dumpable peer and a /proc that shows it"
            ) from None
        except OSError as exc:
            raise _fail(f"cannot read {path}: {exc.strerror}") from None
        if not pattern.fullmatch(target):
            raise _fail(f"{path} is not a tensorrpc/torch shared-memory segment: {target[:80]!r}")
        # stat() follows the magic link without opening anything: check before open().
        try:
            st = os.stat(path)
        except OSError as exc:
            raise _fail(f"cannot stat {path}: {exc.strerror}") from None
        self._check_file(st, h, fs_dev, path)
        try:
            ofd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            raise _fail(f"cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(ofd)
            self._check_file(st, h, fs_dev, path)
        except BaseException:
            os.close(ofd)
            raise
        return ofd, st

    @staticmethod
    def _check_file(st: os.stat_result, h: _Handle, fs_dev: int, path: str) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise _fail(f"{path} is not a shared-memory file")
        if st.st_dev != fs_dev or st.st_dev != h.dev or st.st_ino != h.ino:
            raise _fail(f"{path} is not the segment the handle names (device/inode differ)")
        if h.base + h.span > st.st_size:
            raise _fail(f"handle reaches byte {h.base + h.span} of a {st.st_size}-byte segment")

    def _resolve_pool(
        self, h: _Handle, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
    ) -> torch.Tensor:
        if h.tail:
            raise _fail("unexpected bytes after a POOL handle")
        if h.elem_offset != 0 or h.strides != _contiguous_strides(shape) or h.span != nbytes:
            raise _fail("pool handle must describe exactly one contiguous tensor")
        if h.base < REGION_HEADER or h.base % 64:
            raise _fail(f"pool region at byte {h.base} is misaligned")
        key = (h.pid, h.fd, h.dev, h.ino)
        with self._lock:
            seg = self._maps.get(key)
            if seg is not None:
                self._maps.move_to_end(key)
        if seg is None:
            seg = self._map_pool_segment(h, key)
        if h.base + h.span > seg.size:
            raise _fail(f"handle reaches byte {h.base + h.span} of a {seg.size}-byte segment")
        view = seg.view
        tag_at = view.data_ptr() + h.base - REGION_HEADER
        if _read_u64(tag_at) != h.tag:
            raise _fail("pool region no longer holds this tensor (lease released or expired)")
        out = self._buffers.empty(nbytes)
        ctypes.memmove(out.data_ptr(), view.data_ptr() + h.base, nbytes)
        if _read_u64(tag_at) != h.tag:
            raise _fail("pool region was reused while it was read (lease released too early)")
        return out.view(dtype).view(shape)

    def _map_pool_segment(self, h: _Handle, key: tuple[int, int, int, int]) -> _MappedSegment:
        ofd, st = self._open_proc_fd(h.pid, h.fd, h, _MEMFD_RE, self._memfd_dev)
        try:
            seals = fcntl.fcntl(ofd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise _fail("memfd segment is not sealed against shrinking")
            view = map_shared(ofd, st.st_size, populate=True)
        except OSError as exc:
            raise _fail(f"cannot map the peer's segment: {exc.strerror}") from None
        finally:
            os.close(ofd)
        seg = _MappedSegment(view, st.st_size)
        with self._lock:
            self._maps[key] = seg
            while len(self._maps) > self._max_maps:
                self._maps.popitem(last=False)
        return seg

    def _resolve_torch(
        self, h: _Handle, dtype: torch.dtype, shape: tuple[int, ...], start: int, length: int
    ) -> torch.Tensor:
        if h.base > _MAX_TORCH_BASE:
            raise _fail(f"torch storage at byte {h.base} of its file")
        if h.kind == HandleKind.TORCH_FD:
            if h.tail:
                raise _fail("unexpected bytes after a TORCH_FD handle")
            ofd, _st = self._open_proc_fd(h.pid, h.fd, h, _TORCH_FD_RE, self._shm_dev)
        else:
            try:
                name = h.tail.decode("ascii")
            except UnicodeDecodeError:
                raise _fail("torch segment name is not ASCII") from None
            if not _TORCH_NAME_RE.fullmatch(name):
                raise _fail(f"{name[:80]!r} is not a torch shared-memory segment name")
            path = _SHM_DIR + name
            try:
                ofd = os.open(
                    path,
                    os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK,
                )
            except OSError as exc:
                raise _fail(f"cannot open {path}: {exc.strerror}") from None
            try:
                st = os.fstat(ofd)
                self._check_file(st, h, self._shm_dev, path)
                if st.st_uid != os.geteuid():
                    raise _fail(f"{path} belongs to another user")
            except BaseException:
                os.close(ofd)
                raise
        try:
            first = h.base + start
            window = first - first % PAGE_SIZE
            delta = first - window
            try:
                mapped = map_shared(ofd, delta + length, window)
            except OSError as exc:
                raise _fail(f"cannot map the torch segment: {exc.strerror}") from None
        finally:
            os.close(ofd)
        try:
            flat = mapped[delta : delta + length].view(dtype)
            return flat.as_strided(shape, h.strides)
        except RuntimeError as exc:
            raise _fail(f"cannot build the tensor on the torch segment: {exc}") from None

    def _resolve_cuda(
        self, h: _Handle, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:  # pragma: no cover - needs two processes and a GPU
        tail = h.tail
        if len(tail) < _CUDA_TAIL.size:
            raise _fail("CUDA handle truncated")
        device, size_bytes, offset_bytes, ref_offset, event_sync = _CUDA_TAIL.unpack_from(tail)
        parts: list[bytes] = []
        pos = _CUDA_TAIL.size
        for _ in range(3):
            if len(tail) < pos + 2:
                raise _fail("CUDA handle truncated")
            (n,) = _U16.unpack_from(tail, pos)
            pos += 2
            if n > 1024 or len(tail) < pos + n:
                raise _fail("CUDA handle field out of range")
            parts.append(tail[pos : pos + n])
            pos += n
        if pos != len(tail):
            raise _fail("unexpected bytes after a CUDA handle")
        ipc_handle, ref_handle, event_handle = parts
        if not _TORCH_NAME_RE.fullmatch(ref_handle.decode("ascii", "replace")):
            raise _fail("CUDA ref-counter handle is not a torch shared-memory name")
        if not torch.cuda.is_available() or not 0 <= device < torch.cuda.device_count():
            raise _fail(f"no CUDA device {device} here")
        if size_bytes != h.span:
            raise _fail("CUDA handle sizes disagree")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        try:
            tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
                torch.Tensor,
                torch.Size(shape),
                h.strides,
                h.elem_offset,
                torch.storage.TypedStorage,
                dtype,
                device,
                ipc_handle,
                size_bytes,
                offset_bytes,
                False,
                ref_handle,
                ref_offset,
                event_handle,
                bool(event_sync),
            )
        except (RuntimeError, TypeError) as exc:
            raise _fail(f"CUDA IPC failed: {exc}") from None
        return tensor


class _ProbePeerType:
    """Marks the probe's lease (it belongs to no peer)."""

    def __repr__(self) -> str:
        return "<probe>"


_ProbePeer: Any = _ProbePeerType()


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into the contiguous ``dst`` of the same shape and dtype.

    Contiguous sources go through one ``memmove`` (GIL released, no thread pool):
    ``Tensor.copy_`` hands a copy to the OpenMP pool, whose wake-up costs milliseconds on a
    busy host even for 1 MiB.
    """
    if src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        with torch.no_grad():
            dst.copy_(src)


def _read_u64(addr: int) -> int:
    return int(ctypes.c_uint64.from_address(addr).value)


def _write_u64(addr: int, value: int) -> None:
    ctypes.c_uint64.from_address(addr).value = value
