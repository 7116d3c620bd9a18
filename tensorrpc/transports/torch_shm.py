"""``torch_shm``: tensors cross between processes on one host as shared memory; a handle travels.

How a tensor goes (sender: [`ShmPlacer.place`][tensorrpc.transports.torch_shm.ShmPlacer.place];
receiver: [`ShmResolver.resolve`][tensorrpc.transports.torch_shm.ShmResolver.resolve]):

* **Born in tensorrpc shared memory** (`tensorrpc.shared_empty`,
  `tensorrpc.share`): a sealed memfd; the handle names it and the receiver maps it.
  No byte is copied and the received tensor **aliases the sender's memory**: writes on
  either side are seen by the other. CUDA tensors go through torch's CUDA IPC and alias
  too.
* **In torch's own shared memory** (``share_memory_()``, torch.multiprocessing, either
  sharing strategy) and sent to a peer that passed the unsealed-alias gate
  (`set_peer` with ``alias_unsealed=True``; see docs/security.md): the handle names
  torch's file and the receiver maps it, by alias like the above. torch's files cannot
  be sealed, so this is only done where a truncation costs the receiver nothing new.
* **Anything else** (including torch's shared files to any other peer) is copied once
  into a region of a sealed ``memfd`` segment that the sender's transport owns and
  reuses, and the receiver copies it out into memory of its own. The caller's tensor is
  only read; process-wide torch settings are never touched.

Runtime integration (one `TorchShmTransport` per process or endpoint):

```python
shm = TorchShmTransport()                      # close() (or `with`) at shutdown
# handshake: the shell takes the peer's identity from the kernel (_peer.KernelPeer);
# only an attested peer gets handles or a resolver. shm.set_peer(peer, process=...,
# alias_unsealed=...) says which process it is (budgets) and whether torch's shared
# files may go to it by alias.
placer = shm.placer(peer=engine_id)            # one per outgoing message
enc = encode(value, placer=placer)             # codec calls placer.place(t)
lease = placer.lease                           # None: nothing went by handle
# when the peer confirms it attached: shm.release(lease, peer=engine_id)
# if the message is never sent: placer.abort()
resolver = shm.resolver(attested_pid, peer=kernel_peer)  # per incoming message
value = decode(payload, buffers, resolver=resolver)
resolver.leases                                # lease ids to send back in RELEASE
# peer died: shm.release_peer(peer); shm.forget_peer(peer_pid)
# every few seconds: shm.sweep() (old leases dropped, freed peer segments unmapped)
```

Why ``/proc/<pid>/fd`` rather than ``SCM_RIGHTS``: the handle rides inside the normal
message over any ZMQ transport with no side channel. Opening ``/proc/<pid>/fd/<n>`` needs
the kernel's ``PTRACE_MODE_READ`` check: same uid, a dumpable peer, and a ``/proc`` that
shows it. The checks a receiver makes are in `tensorrpc.transports._shm_recv`.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from tensorrpc._lazy import LazyModule
from tensorrpc.transports._shm_alias_send import LIMITED, AliasSending, _TorchFile
from tensorrpc.transports._shm_budget import PeerBudget, StorageKey
from tensorrpc.transports._shm_copy import Copier
from tensorrpc.transports._shm_handle import (
    TRANSPORT_NAME,
    Handle,
    HandleKind,
    contiguous_strides,
    fail,
    pack,
    pack_fields,
)
from tensorrpc.transports._shm_pool import (
    REGION_HEADER,
    BufferCache,
    Segment,
    SegmentPool,
    Warmer,
    cold,
    fill,
    mark_warm,
    memfd_device,
    pid as current_pid,
)
from tensorrpc.transports._shm_recv import (
    Receiver,
    SegmentMaps,
    ShmReceiving,
    ShmResolver,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable
    from types import TracebackType

    import torch
else:
    torch = LazyModule("torch", globals())

__all__ = [
    "TRANSPORT_NAME",
    "HandleKind",
    "ShmPlacer",
    "ShmResolver",
    "TorchShmStatistics",
    "TorchShmTransport",
]

_MEMFD_PREFIX = "tensorrpc-"
_SHARED = HandleKind.SHARED
_TORCH_FD = HandleKind.TORCH_FD
_TORCH_FILE = HandleKind.TORCH_FILE
_EMPTY_KIND = HandleKind.EMPTY


@dataclass(frozen=True, slots=True)
class TorchShmStatistics:
    """A snapshot of one [`TorchShmTransport`][tensorrpc.transports.torch_shm.TorchShmTransport]'s
    counters."""

    #: Tensors sent by handle (copied into the pool or aliased).
    tensors_sent: int
    #: Bytes of those tensors.
    bytes_sent: int
    #: Of ``tensors_sent``, those sent without a copy (tensorrpc shared memory, or CUDA).
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
    #: Peers' segments this receiver keeps mapped.
    mapped_segments: int
    #: Tensors not placed because their peer already held ``peer_max_bytes`` unreleased.
    peer_limited: int = 0
    #: RELEASEs refused: a lease never made, already released, or made for another peer.
    releases_refused: int = 0
    #: Peers' leases this receiver holds: tensors built on their pool regions (one-copy
    #: receive) still alive; each is released (RELEASE) once its tensors are freed.
    leases_held: int = 0
    #: Of ``tensors_received``, those received by alias: the sender's own memory
    #: (tensorrpc shared memory or CUDA), mapped here with no copy on either side.
    tensors_received_aliased: int = 0
    #: Peers' segments unmapped because the sender had freed them (a trimmed pool
    #: segment, a `tensorrpc.share` tensor gone): found before each new mapping of that
    #: peer and at each `sweep`.
    mappings_pruned: int = 0


@dataclass(slots=True)
class _Lease:
    id: int
    peer: Hashable
    created: float
    regions: list[tuple[Segment, int, int]]
    keep: list[object]
    #: Bytes of pool regions charged to the peer by this lease.
    nbytes: int = 0
    #: Shared storages this lease pins (charged to the peer once: see `PeerBudget`).
    pins: list[StorageKey] = field(default_factory=list)
    #: Whose budget the lease counts against: the peer's process (see `set_peer`).
    account: Hashable = None


class ShmPlacer:
    """Places the tensors of one outgoing message (implements the codec's ``TensorPlacer``).

    Made by [`TorchShmTransport.placer`][tensorrpc.transports.torch_shm.TorchShmTransport.placer].
    Everything placed through one placer shares
    one lease, kept by the transport until
    [`TorchShmTransport.release`][tensorrpc.transports.torch_shm.TorchShmTransport.release].
    """

    __slots__ = ("_defer_bytes", "_fills", "_lease", "_peer", "_transport")

    def __init__(
        self, transport: TorchShmTransport, peer: Hashable, defer_bytes: int | None = None
    ) -> None:
        self._transport = transport
        self._peer = peer
        self._lease: _Lease | None = None
        #: Copies of at least this many bytes wait for `fill` (None: every copy is inline).
        self._defer_bytes = defer_bytes
        self._fills: list[_Fill] = []

    @property
    def lease(self) -> int | None:
        """The lease id to release once the peer has attached (None: nothing placed)."""
        return None if self._lease is None else self._lease.id

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        """Put ``tensor`` in shared memory and return ``("torch_shm", handle)``.

        Returns:
            None when this tensor cannot go by handle (unsupported layout or device, the
            pool or the peer's share of it is full, the peer is disabled); the codec then
            sends it as a frame, and the transport counts a fallback.
        """
        return self._transport._place(self, tensor)

    @property
    def pending_bytes(self) -> int:
        """Bytes placed whose copy into the pool waits for `fill` (0: nothing waits)."""
        return sum(job.nbytes for job in self._fills)

    def fill(self) -> None:
        """Run the copies that `place` deferred, in the calling thread.

        A placer made with ``defer_bytes`` hands back handles of large tensors before
        their bytes are in the pool; the message may go only once this has returned. The
        copies release the GIL (``memmove``, ``pwrite``), so a shell runs this in a worker
        thread and its event loop keeps serving meanwhile. Call it at most once at a
        time, and never after `abort`.
        """
        fills, self._fills = self._fills, []
        try:
            while fills:
                fills.pop(0).run(self._transport._warmer)
        finally:
            for job in fills:  # a failed copy: the rest is never run; close their fds
                job.discard()

    def _copy(self, job: _Fill) -> None:
        defer = self._defer_bytes
        if defer is not None and job.nbytes >= defer:
            self._fills.append(job)  # copied by `fill`, before the message goes
        else:
            job.run(self._transport._warmer)

    def abort(self) -> None:
        """The message will not be sent: release what was placed at once (copies that
        wait for `fill` are dropped)."""
        fills, self._fills = self._fills, []
        for job in fills:
            job.discard()
        if self._lease is not None:
            self._transport.release(self._lease.id)


#: The sending half's counters (see `TorchShmStatistics`).
_SENDER_COUNTERS = (
    "tensors_sent",
    "bytes_sent",
    "tensors_aliased",
    "fallbacks",
    "leases_expired",
    "peer_limited",
    "releases_refused",
)


class TorchShmTransport(ShmReceiving, AliasSending):
    """The ``torch_shm`` tensor transport of one process: a memfd pool, leases, mappings.

    Args:
        segment_bytes: size of an ordinary pool segment (tensors are packed into it).
        pool_max_bytes: the pool never grows beyond this; a tensor that does not fit then
            falls back to frames.
        pool_keep_bytes: idle pool segments beyond this are closed when they empty.
        peer_max_bytes: most bytes leased to one peer and not yet released (pool regions
            and pinned shared storages); beyond it tensors to that peer go as frames.
        peer_max_leases: most unreleased leases per peer; beyond it, frames.
        recv_cache_bytes: idle receive buffers kept for reuse (see ``BufferCache``).
        recv_cache_min_bytes: received copies smaller than this use torch's allocator.
        mapped_segments: how many peers' segments a receiver keeps mapped (LRU).
        mapped_bytes_per_peer: most bytes of one peer's segments kept mapped; a larger
            segment is mapped only over the range a handle needs, and not kept.
        max_segment_bytes: a peer's segment larger than this is refused.
        lease_timeout: seconds after which `sweep` drops an unreleased lease.
        copy_threads: most threads one large copy into the pool uses (None: the cores
            this process may use, at most 4; 1: the caller's thread alone).
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
        peer_max_bytes: int = 1 << 30,
        peer_max_leases: int = 4096,
        recv_cache_bytes: int = 512 << 20,
        recv_cache_min_bytes: int = 1 << 20,
        mapped_segments: int = 64,
        mapped_bytes_per_peer: int = 2 << 30,
        max_segment_bytes: int = 32 << 30,
        lease_timeout: float = 300.0,
        copy_threads: int | None = None,
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
        self._receiver = Receiver(
            memfd_device(),
            SegmentMaps(max_segments=mapped_segments, max_bytes_per_peer=mapped_bytes_per_peer),
            BufferCache(max_idle_bytes=recv_cache_bytes, min_bytes=recv_cache_min_bytes),
            max_segment_bytes,
        )
        self._warmer = Warmer()
        self._copier = Copier(copy_threads)
        self._leases: dict[int, _Lease] = {}
        self._budget = PeerBudget(peer_max_bytes, peer_max_leases)
        self._next_lease = 1
        self._disabled: set[Hashable] = set()
        #: peer -> its process (the budget's key); peers absent count as their own.
        self._accounts: dict[Hashable, Hashable] = {}
        #: Peers that may get torch's unsealed shared files by alias.
        self._alias = set()
        #: torch shared storages sent by alias -> their file (`_place_torch`).
        self._torch_files: weakref.WeakKeyDictionary[torch.UntypedStorage, _TorchFile] = (
            weakref.WeakKeyDictionary()
        )
        self._lease_timeout = lease_timeout
        self._cuda = cuda
        self._clock = clock
        self._closed = False
        self._stats: dict[str, int] = dict.fromkeys(_SENDER_COUNTERS, 0)

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
            self._budget.clear()
            self._pool.close()
            self._receiver.maps.clear()
            self._accounts.clear()
            self._alias.clear()
            self._torch_files.clear()
        self._warmer.close()
        self._copier.close()
        self._receiver.buffers.close()

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
            raise fail("transport is closed")
        if current_pid() != self._pid:
            # A forked child must not allocate from (or release into) its parent's pool.
            self._pid = current_pid()
            self._pool.abandon()
            self._leases.clear()
            self._budget.clear()
            self._receiver.maps.clear()
            self._accounts.clear()
            self._alias.clear()
            self._torch_files.clear()

    def _checked(self) -> None:
        if self._closed or current_pid() != self._pid:  # (read without the lock: rare)
            with self._lock:
                self._check_open()

    # -- peers ---------------------------------------------------------------------------

    def set_peer(self, peer: Hashable, *, process: Hashable, alias_unsealed: bool) -> None:
        """What the handshake learned about ``peer`` from the kernel.

        Args:
            peer: The runtime's id for the connection (as given to `placer`).
            process: The peer's process (`KernelPeer.key`): every connection of one
                process shares one budget (``peer_max_bytes``, ``peer_max_leases``).
            alias_unsealed: Tensors in torch's own shared memory may go to ``peer`` by
                alias (the unsealed-alias gate held on both ends); else they are copied
                through the sealed pool.
        """
        with self._lock:
            self._accounts[peer] = process
            if alias_unsealed:
                self._alias.add(peer)
            else:
                self._alias.discard(peer)

    def _account(self, peer: Hashable) -> Hashable:
        return self._accounts.get(peer, peer)

    # -- sender side ----------------------------------------------------------------------

    def placer(self, peer: Hashable = None, *, defer_bytes: int | None = None) -> ShmPlacer:
        """A placer for one message to ``peer`` (any hashable id the runtime uses).

        Args:
            peer: the receiving peer.
            defer_bytes: copies into the pool of tensors of at least this many bytes wait
                for [`ShmPlacer.fill`][tensorrpc.transports.torch_shm.ShmPlacer.fill]
                (which the caller runs off its event loop, before sending); None: every
                copy runs inside ``place``.

        Raises:
            TensorTransportError: the transport is closed.
        """
        self._checked()
        return ShmPlacer(self, peer, defer_bytes)

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

        Args:
            lease: a lease id from
                [`ShmPlacer.lease`][tensorrpc.transports.torch_shm.ShmPlacer.lease] or a peer's
                RELEASE message.
            peer: when given, only release the lease if it was made for this peer.

        Returns:
            Whether a lease was released. False for unknown ids (released twice, expired,
            forged) and for another peer's lease; those are counted as
            ``releases_refused`` when ``peer`` is given.
        """
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or (peer is not ... and entry.peer != peer):
                if peer is not ...:
                    self._stats["releases_refused"] += 1
                return False
            del self._leases[lease]
            self._free_lease(entry)
            return True

    def refuse_release(self, count: int = 1) -> None:
        """Count RELEASEs refused elsewhere (an argument lease the peer may not release)."""
        with self._lock:
            self._stats["releases_refused"] += count

    def leased(self, lease: int) -> bool:
        """Whether ``lease`` is still held (not released, not expired)."""
        with self._lock:
            return lease in self._leases

    def release_peer(self, peer: Hashable) -> int:
        """The peer is gone: release every lease made for it and close its pool segments
        (none is handed to anyone else, nor to a new peer under the same id). Returns
        how many leases."""
        with self._lock:
            dead = [lid for lid, e in self._leases.items() if e.peer == peer]
            for lid in dead:
                self._free_lease(self._leases.pop(lid))
            self._pool.close_owner(peer)
            self._stats["leases_expired"] += len(dead)
            self._disabled.discard(peer)
            self._accounts.pop(peer, None)
            self._alias.discard(peer)
            return len(dead)

    def sweep(self) -> int:
        """Release leases older than ``lease_timeout``, and unmap the peers' segments
        that their senders have freed. Returns how many leases.

        A receiver that attaches after its lease expired gets a clear error for pool
        handles (the region's tag no longer matches), never another message's bytes.
        The runtime sweeps once per heartbeat interval (1 s by default): that bounds how
        long a freed segment stays mapped here (tensors built on it keep it, as they
        must).
        """
        if not self._closed:
            self._receiver.prune()
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
                # Tag 0 is never valid: a late reader of this region now fails cleanly,
                # and the next lease of it gets a fresh random tag.
                _write_u64(seg.view.data_ptr() + off, 0)
                self._pool.release(seg, off, n)
        entry.regions.clear()
        entry.keep.clear()
        self._budget.closed(entry.account, entry.nbytes, entry.pins)
        entry.pins.clear()

    def _needs_lease(self, placer: ShmPlacer) -> bool:
        """Whether ``placer``'s next tensor opens a lease (none yet, or its lease ended)."""
        return placer._lease is None or placer._lease.id not in self._leases

    def _new_lease(self, placer: ShmPlacer) -> _Lease:
        if self._needs_lease(placer):
            # (A placer used again after its lease was released gets a fresh lease.)
            lid = self._next_lease
            self._next_lease += 1
            account = self._account(placer._peer)
            placer._lease = _Lease(lid, placer._peer, self._clock(), [], [], account=account)
            self._leases[lid] = placer._lease
            self._budget.opened(account)
        assert placer._lease is not None  # (made above, or open: `_needs_lease`)
        return placer._lease

    def _charge(self, lease: _Lease, nbytes: int) -> None:
        lease.nbytes += nbytes
        self._budget.charge(lease.account, nbytes)

    def _over_limit(self, placer: ShmPlacer, nbytes: int) -> bool:
        account = self._account(placer._peer)
        if self._budget.over(account, nbytes, new_lease=self._needs_lease(placer)):
            self._stats["peer_limited"] += 1
            return True
        return False

    def _place(self, placer: ShmPlacer, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        copy: _Fill | None = None
        with self._lock:
            self._check_open()
            if placer._peer in self._disabled or not self._placeable(tensor):
                self._stats["fallbacks"] += 1
                return None
            t = tensor.detach() if tensor.requires_grad else tensor
            nbytes = t.nbytes
            handle: bytes | None = None
            aliased = True
            # Each kind checks the peer's caps with what it would pin (a shared storage
            # costs its bytes once per peer, however many messages pin it).
            if nbytes == 0:
                if not self._over_limit(placer, 0):
                    lease = self._new_lease(placer)
                    strides = contiguous_strides(tuple(t.shape))
                    handle = pack_fields(
                        _EMPTY_KIND, self._pid, -1, 0, 0, lease.id, 0, 0, 0, 0, strides, b""
                    )
            elif t.is_cuda:
                if not self._over_limit(placer, nbytes):
                    handle = self._place_cuda(placer, t)
            else:
                handle = self._place_shared_cpu(placer, t)
                if handle is LIMITED:
                    handle = None
                elif handle is None and not self._over_limit(placer, nbytes):
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
            placer._copy(copy)
        return TRANSPORT_NAME, handle

    def _count_sent(self, nbytes: int, *, aliased: bool) -> None:
        self._stats["tensors_sent"] += 1
        self._stats["bytes_sent"] += nbytes
        if aliased:
            self._stats["tensors_aliased"] += 1

    def _placeable(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            return False
        if t.is_cpu:
            return True
        return t.is_cuda and self._cuda

    def _place_pool(
        self, placer: ShmPlacer, t: torch.Tensor, nbytes: int
    ) -> tuple[bytes, _Fill] | None:
        try:
            # A region in a segment of this peer's own: the peer maps whole segments.
            got = self._pool.allocate(nbytes, placer._peer)
        except OSError:
            return None
        if got is None:
            return None
        seg, off, n = got
        lease = self._new_lease(placer)
        lease.regions.append((seg, off, n))
        self._charge(lease, n)
        data = off + REGION_HEADER
        tag = secrets.randbits(63) | 1  # never 0, unpredictable from earlier tags
        _write_u64(seg.view.data_ptr() + off, tag)
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        fd = -1
        if t.is_contiguous() and cold(seg, data, nbytes):
            try:  # (our own descriptor: a concurrent close cannot redirect the pwrite)
                fd = os.dup(seg.fd)
            except OSError:
                fd = -1
        job = _Fill(seg, seg.view, data, nbytes, t, fd, self._copier)
        strides = contiguous_strides(tuple(t.shape))
        h = Handle(
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
        return pack(h), job

    def statistics(self) -> TorchShmStatistics:
        """The counters and pool gauges as a frozen snapshot."""
        with self._lock:
            recv = self._receiver
            return TorchShmStatistics(
                leases_active=len(self._leases),
                pool_segments=len(self._pool.segments),
                pool_bytes=self._pool.total_bytes,
                pool_bytes_in_use=self._pool.used_bytes,
                mapped_segments=len(recv.maps),
                leases_held=recv.holds.held(),
                tensors_received=recv.tensors_received,
                tensors_received_aliased=recv.tensors_aliased,
                mappings_pruned=recv.pruned,
                bytes_received=recv.bytes_received,
                **self._stats,
            )


class _Fill:
    """One copy into a pool region, taken under the transport's lock and run outside it.

    Holds the segment's mapping (``view``) and, for cold pages, a descriptor of its own
    (``fd``), so that nothing a concurrent close does can move the copy elsewhere.
    """

    __slots__ = ("copier", "fd", "nbytes", "off", "seg", "src", "view")

    def __init__(
        self,
        seg: Segment,
        view: torch.Tensor,
        off: int,
        nbytes: int,
        src: torch.Tensor,
        fd: int,
        copier: Copier,
    ) -> None:
        self.seg = seg
        self.copier = copier
        self.view = view
        self.off = off
        self.nbytes = nbytes
        self.src = src
        self.fd = fd

    def run(self, warmer: Warmer) -> None:
        """Copy ``src`` into the region.

        Contiguous sources go through ``memmove`` (split over the copier's threads when
        large) or ``pwrite``, with the GIL released; not ``Tensor.copy_``, which hands a
        copy to the OpenMP pool, whose wake-up costs milliseconds on a busy host even for
        1 MiB, and whose static split waits for a thread the host does not run; see `fill`.
        """
        src = self.src
        try:
            if src.is_contiguous():
                fill(self.seg, self.view, self.off, src, self.fd, warmer, self.copier)
            else:
                dst = self.view[self.off : self.off + self.nbytes].view(src.dtype)
                with torch.no_grad():
                    dst.view(src.shape).copy_(src)
                mark_warm(self.seg, self.off, self.nbytes)
        finally:
            self.discard()

    def discard(self) -> None:
        """Let go of the copy's descriptor (the copy ran, or never will)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _write_u64(addr: int, value: int) -> None:
    ctypes.c_uint64.from_address(addr).value = value
