"""The receiving side of ``torch_shm``: check a handle's file, map it, build the tensor.

Every handle from the wire is untrusted. Before any memory is touched the receiver checks
the handle's format and bounds (`._shm_handle`), that it names the process the kernel
says sent it (`._peer.KernelPeer`: the connection's credentials, pinned by a pidfd), and
that ``/proc/<pid>/fd/<n>`` is a tensorrpc memfd of the right kind (by its name), on the
memfd device, with the handle's inode, **sealed against shrinking and growing** (so no
``ftruncate`` can ever turn an access into ``SIGBUS``), and at most ``max_segment_bytes``
long, with the handle's bytes inside it. The path is only ``stat``-ed before the checks
pass, the opened file must be the same inode, and it is used only if the pidfd then says
the attested process is still alive (a reused pid fails). Errors say what is wrong with
the *handle*, never which files or descriptors a process has.

torch's own shared files (``share_memory_()``: kinds ``TORCH_FD`` and ``TORCH_FILE``)
cannot be sealed; a resolver maps them only when it was made with ``unsealed=True``, which
the policy grants only when `._peer.alias_gate` holds for the peer.

Mappings are lazy (no ``MAP_POPULATE``: a sparse segment costs nothing but the pages the
tensor really reads) and kept in a per-peer LRU keyed by ``(pid, dev, ino)``, bounded by
count and by bytes per peer; a segment bigger than the per-peer budget is mapped only
over the page-aligned range the handle needs, and not kept.

A kept mapping must not outlive the sender's use of the file: the sender closes a pool
segment it trims and the memfd of a `tensorrpc.share` tensor it frees, and our mapping
would then be all that keeps that memory. `Receiver.prune` drops every kept mapping
whose file the sender no longer has open (``/proc/<pid>/fd/<n>`` is gone or is another
file); it runs over all of them at each sweep of the transport (once per heartbeat
interval) and, before each new kept mapping of a peer, over the `PRUNE_PER_MAP` of that
peer's mappings checked longest ago (a ``stat`` costs microseconds: checking every kept
mapping there made a new segment cost O(kept)). Tensors built on a mapping keep it, as
they must.

torch's own shared files are kept mapped only from the second handle that names them:
a ``DataLoader`` batch is sent once, and a mapping kept after its call would make this
receiver, not the sender, the last holder of the file, so that freeing its pages
(milliseconds for 64 MiB) would fall on us at the next prune. Its one-off mapping dies
with the tensors built on it. A ``share_memory_()`` tensor sent again and again is kept
from its second call on.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import itertools
import logging
import math
import os
import re
import stat
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Final

from tensorrpc._lazy import LazyModule
from tensorrpc._release import later, later_if_large
from tensorrpc.transports._shm_handle import (
    CUDA_TAIL,
    MAX_FD,
    TRANSPORT_NAME,
    U16,
    Handle,
    HandleKind,
    check_bounds,
    contiguous_strides,
    fail,
    lease_of,
    unpack,
    without_lease,
)
from tensorrpc.transports._shm_holds import Hold, Holds
from tensorrpc.transports._shm_pool import (
    PAGE_SIZE,
    REGION_HEADER,
    BufferCache,
    map_shared,
    privatize,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    import torch

    from tensorrpc.transports._peer import KernelPeer
else:
    torch = LazyModule("torch", globals())

__all__ = ["Receiver", "SegmentMaps", "ShmReceiving", "ShmResolver", "refuse_all"]

logger = logging.getLogger("tensorrpc.transports")

POOL_RE: Final = re.compile(r"/memfd:tensorrpc-[0-9]+-[0-9]+ \(deleted\)")
SHARED_RE: Final = re.compile(r"/memfd:tensorrpc-shared-[0-9]+-[0-9]+ \(deleted\)")
#: torch's shared files (both sharing strategies): ``/dev/shm/torch_<pid>_<n>_<n>``,
#: unlinked already (``file_descriptor``) or not (``file_system``).
TORCH_RE: Final = re.compile(r"/dev/shm/torch_[0-9]+_[0-9]+_[0-9]+( \(deleted\))?")
_SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_OPEN_FLAGS: Final = os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
_TORCH_NAME_RE = re.compile(r"/torch_[0-9]+_[0-9]+_[0-9]+")
# (module constants: an enum member read from its class costs ~0.1 µs, per handle)
_EMPTY: Final = HandleKind.EMPTY
_POOL: Final = HandleKind.POOL
_SHARED: Final = HandleKind.SHARED
_CUDA: Final = HandleKind.CUDA
_TORCH_FD: Final = HandleKind.TORCH_FD
_TORCH_FILE: Final = HandleKind.TORCH_FILE
_UNSEALED_REFUSED = (
    "torch shared-memory files are not accepted from this peer (shm_alias_unsealed is "
    '"never", or the peer is not our user with no privilege we lack); they go through '
    "the sealed pool"
)
_NO_ATTACH = "cannot attach to the handle (not a live tensorrpc segment of the peer)"
#: Kept mappings of a peer checked (`Receiver.prune`) before each new one is kept.
PRUNE_PER_MAP: Final = 2
#: torch shared files seen once, remembered so that the second handle keeps its mapping.
_SEEN_ONCE_MAX = 1024
#: Alias handles remembered for `Receiver.known` (all forgotten past this many).
_KNOWN_MAX = 4096
_SERIALS = itertools.count(1)
_ALIAS_KINDS: Final = frozenset({HandleKind.SHARED, HandleKind.TORCH_FD, HandleKind.TORCH_FILE})


#: ``pidfd_getfd(2)`` (Linux 5.6; the same number on every architecture since 5.1).
_SYS_PIDFD_GETFD: Final = 438
#: Whether `_getfd` may be tried: False once the kernel (or Yama, seccomp, an LSM)
#: refused it; then descriptors are opened through ``/proc/<pid>/fd`` as before.
_getfd_usable = True
_libc = ctypes.CDLL(None, use_errno=True)


def _getfd(pidfd: int, fd: int) -> int:
    """A duplicate of descriptor ``fd`` of the process of ``pidfd`` (close-on-exec), or
    -1 when this way is not available here (the caller opens it through ``/proc``).

    One system call instead of three path walks through ``/proc`` (``readlink``,
    ``stat``, ``open``), and no ``open`` of the file at all: nothing a file's ``open``
    could do (a FIFO, a device) happens; the caller checks what it got with ``fstat``.

    Raises:
        OSError: the process has exited (``ESRCH``) or has no such descriptor (``EBADF``).
    """
    global _getfd_usable
    got = int(_libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
    if got >= 0:
        return got
    err = ctypes.get_errno()
    if err in (errno.ESRCH, errno.EBADF):
        raise OSError(err, os.strerror(err))
    _getfd_usable = False  # ENOSYS, EPERM (Yama's ptrace_scope, seccomp, an LSM), ...
    return -1


def _shm_device() -> int:
    """``st_dev`` of ``/dev/shm`` (where torch puts its shared files); -1 without it."""
    try:
        return os.stat("/dev/shm").st_dev
    except OSError:
        return -1


def _still_open(key: tuple[int, int, int], fd: int) -> bool:
    """Whether the process ``key[0]`` still has file ``(key[1], key[2])`` open as ``fd``."""
    pid, dev, ino = key
    if fd < 0:
        return True  # (not known: kept until evicted)
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return st.st_dev == dev and st.st_ino == ino


def _read_u64(addr: int) -> int:
    return int(ctypes.c_uint64.from_address(addr).value)


class _Mapped:
    """A kept mapping and its typed views (made on first use, dropped with the mapping)."""

    __slots__ = ("fd", "serial", "typed", "view")

    def __init__(self, view: torch.Tensor, fd: int) -> None:
        self.view = view
        #: Unique per mapping ever kept: a `_Known` handle names the mapping it was
        #: checked against by it.
        self.serial = next(_SERIALS)
        #: The descriptor number in the sender that names the file (for `Receiver.prune`).
        self.fd = fd
        #: dtype -> (``view`` reinterpreted as that dtype, its storage offset).
        self.typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}


class _Known:
    """What a handle resolved by alias before needs to be resolved again (see
    `Receiver.known`): the mapping it was checked against and the view it made."""

    __slots__ = ("dtype", "elem", "key", "nbytes", "serial", "shape", "strides", "unsealed")

    def __init__(
        self,
        key: tuple[int, int, int],
        serial: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        elem: int,
        nbytes: int,
        unsealed: bool,
    ) -> None:
        self.key = key
        self.serial = serial
        self.dtype = dtype
        self.shape = shape
        self.strides = strides
        #: Elements from the mapping's start to the tensor's.
        self.elem = elem
        self.nbytes = nbytes
        #: A torch file: only for a resolver allowed to map those.
        self.unsealed = unsealed


class SegmentMaps:
    """Mapped segments of peers, LRU, bounded by count (all peers) and bytes (per peer).

    Each kept mapping also caches its views as the dtypes its handles used, so that a
    handle into a mapped segment costs one view op (``as_strided``), not two. The typed
    views live and die with their mapping's entry: evicted, replaced or forgotten, they
    go with it (a new segment under the same key starts with none).

    Args:
        max_segments: most segments kept mapped, all peers together.
        max_bytes_per_peer: most bytes kept mapped per peer; a larger segment is never kept.
    """

    def __init__(self, *, max_segments: int, max_bytes_per_peer: int) -> None:
        self.max_segments = max_segments
        self.max_bytes_per_peer = max_bytes_per_peer
        self._maps: OrderedDict[tuple[int, int, int], _Mapped] = OrderedDict()
        self._bytes: dict[int, int] = {}
        #: pid -> its mappings' keys, the one checked longest ago first (`oldest_checked`);
        #: keys of dropped mappings are skipped there and compacted away.
        self._unchecked: dict[int, collections.deque[tuple[int, int, int]]] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def bytes_of(self, pid: int) -> int:
        """Bytes kept mapped for ``pid``."""
        return self._bytes.get(pid, 0)

    def get(self, key: tuple[int, int, int]) -> torch.Tensor | None:
        """The mapping of ``(pid, dev, ino)`` (marked most recently used), or None."""
        entry = self._maps.get(key)
        if entry is None:
            return None
        self._maps.move_to_end(key)
        return entry.view

    def entry(self, key: tuple[int, int, int]) -> _Mapped | None:
        """The kept mapping of ``key`` (marked most recently used), or None."""
        entry = self._maps.get(key)
        if entry is not None:
            self._maps.move_to_end(key)
        return entry

    def typed(
        self, key: tuple[int, int, int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, int] | None] | None:
        """The mapping of ``key`` (marked most recently used) and its cached view as
        ``dtype`` with that view's storage offset, made now if the mapping's size is a
        multiple of the item size (else None); None when ``key`` is not mapped."""
        entry = self._maps.get(key)
        if entry is None:
            return None
        self._maps.move_to_end(key)
        view = entry.view
        typed = entry.typed.get(dtype)
        if typed is None and view.numel() % dtype.itemsize == 0:
            try:
                as_dtype = view.view(dtype)
            except RuntimeError:  # (a mapping at an odd offset: the caller's slow path)
                return view, None
            typed = entry.typed[dtype] = (as_dtype, int(as_dtype.storage_offset()))
        return view, typed

    def put(self, key: tuple[int, int, int], view: torch.Tensor, fd: int = -1) -> bool:
        """Keep a whole-segment mapping of the sender's descriptor ``fd``; False when it
        is over the per-peer budget."""
        size = view.numel()
        pid = key[0]
        if size > self.max_bytes_per_peer or self.max_segments <= 0:
            return False
        old = self._maps.pop(key, None)
        if old is not None:
            self._bytes[pid] -= old.view.numel()
            later_if_large(old, old.view.numel())
        while self._bytes.get(pid, 0) + size > self.max_bytes_per_peer:
            self._evict(next(k for k in self._maps if k[0] == pid))
        while len(self._maps) >= self.max_segments:
            self._evict(next(iter(self._maps)))
        self._maps[key] = _Mapped(view, fd)
        self._bytes[pid] = self._bytes.get(pid, 0) + size
        self._unchecked.setdefault(pid, collections.deque()).append(key)
        return True

    def kept(self, pid: int | None = None) -> list[tuple[tuple[int, int, int], int]]:
        """``(key, sender's fd)`` of every kept mapping (of ``pid`` only, if given)."""
        return [(k, m.fd) for k, m in self._maps.items() if pid is None or k[0] == pid]

    def oldest_checked(self, pid: int, count: int) -> list[tuple[tuple[int, int, int], int]]:
        """``(key, sender's fd)`` of the ``count`` mappings of ``pid`` checked longest ago
        (or never); they count as checked now (see `Receiver.prune`)."""
        queue = self._unchecked.get(pid)
        if queue is None:
            return []
        out: list[tuple[tuple[int, int, int], int]] = []
        while queue and len(out) < count:
            key = queue.popleft()
            entry = self._maps.get(key)
            if entry is not None and all(key != k for k, _ in out):
                out.append((key, entry.fd))
        queue.extend(k for k, _ in out)  # (a dropped mapping's key is skipped, lazily)
        if len(queue) > 2 * len(self._maps) + count:
            self._unchecked[pid] = collections.deque(
                dict.fromkeys(k for k in queue if k in self._maps)
            )
        return out

    def evict(self, key: tuple[int, int, int]) -> None:
        """Drop one mapping and its typed views if kept (tensors on it keep it mapped)."""
        if key in self._maps:
            self._evict(key)

    def _evict(self, key: tuple[int, int, int]) -> None:
        entry = self._maps.pop(key)
        later_if_large(entry, entry.view.numel())  # unmapped off the event loop
        left = self._bytes[key[0]] - entry.view.numel()
        if left:
            self._bytes[key[0]] = left
        else:
            del self._bytes[key[0]]
            self._unchecked.pop(key[0], None)

    def forget(self, pid: int) -> int:
        """Drop every mapping of ``pid`` (tensors built on them keep theirs alive)."""
        keys = [k for k in self._maps if k[0] == pid]
        for k in keys:
            self._evict(k)
        return len(keys)

    def clear(self) -> None:
        """Drop every mapping."""
        maps, self._maps = self._maps, OrderedDict()
        if maps:
            later(maps)  # unmapped off the event loop
        self._bytes.clear()
        self._unchecked.clear()


class Receiver:
    """Resolves handles into tensors for one process (thread-safe).

    Args:
        memfd_dev: ``st_dev`` of memfds on this kernel.
        maps: the mapping cache.
        buffers: recycled destination buffers for copies out of the pool.
        max_segment_bytes: a segment larger than this is refused.
    """

    def __init__(
        self, memfd_dev: int, maps: SegmentMaps, buffers: BufferCache, max_segment_bytes: int
    ) -> None:
        self._lock = threading.Lock()
        self._memfd_dev = memfd_dev
        self._shm_dev = _shm_device()
        self.maps = maps
        self.buffers = buffers
        self.max_segment_bytes = max_segment_bytes
        self.tensors_received = 0
        self.bytes_received = 0
        #: Of those, tensors received by alias (SHARED and CUDA handles).
        self.tensors_aliased = 0
        #: Kept mappings dropped because the sender had closed their file (`prune`).
        self.pruned = 0
        #: Leases held by tensors built on peers' pool regions (one-copy receive).
        self.holds = Holds()
        #: torch shared files mapped once and not kept (see the module docstring).
        self._seen_once: OrderedDict[tuple[int, int, int], None] = OrderedDict()
        #: Alias handles resolved on a kept mapping, by their bytes less the lease id.
        self._known: dict[bytes, _Known] = {}

    # -- handles resolved before -----------------------------------------------------------

    def known(
        self,
        handle: bytes,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        peer_pid: int | None,
        unsealed: bool,
    ) -> torch.Tensor | None:
        """The tensor of a handle whose bytes (its lease id aside) were resolved by alias
        before, on a mapping still kept; None: not known (`resolve` it).

        Its checks passed then for the very bytes, dtype and shape, and against the very
        mapping (its serial): they would pass again. The sender's pid must be the
        resolver's, and a torch file needs ``unsealed``, as in `resolve`.
        """
        k = self._known.get(without_lease(handle))
        if (
            k is None
            or k.dtype is not dtype
            or k.shape != shape
            or (k.unsealed and not unsealed)
            or (peer_pid is not None and peer_pid != k.key[0])
        ):
            return None
        with self._lock:
            entry = self.maps.entry(k.key)
            if entry is None or entry.serial != k.serial:
                return None
            typed = entry.typed[dtype]
            self.tensors_received += 1
            self.bytes_received += k.nbytes
            self.tensors_aliased += 1
        return torch.as_strided(typed[0], shape, k.strides, typed[1] + k.elem)

    def learn(self, handle: bytes, h: Handle, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Remember ``handle``, just resolved from ``h``, for `known` if it went by alias on
        a kept mapping (a window, a one-off mapping or a pool region is not remembered)."""
        if h.kind not in _ALIAS_KINDS or type(handle) is not bytes:
            return
        size = dtype.itemsize
        start = h.base + h.elem_offset * size
        key = (h.pid, h.dev, h.ino)
        with self._lock:
            entry = self.maps.entry(key)
            if entry is None or start % size:
                return
            got = self.maps.typed(key, dtype)
            if got is None or got[1] is None:
                return
            if len(self._known) >= _KNOWN_MAX:
                self._known.clear()
            nbytes = math.prod(shape) * size
            self._known[without_lease(handle)] = _Known(
                key, entry.serial, dtype, shape, h.strides, start // size, nbytes, h.kind != _SHARED
            )

    # -- mappings the sender freed ---------------------------------------------------------

    def prune(self, pid: int | None = None, limit: int | None = None) -> int:
        """Drop the kept mappings (of ``pid``, or of every peer) whose file the sender no
        longer holds open. Returns how many.

        ``/proc/<pid>/fd/<n>`` is stat-ed (one system call per kept segment): gone, or
        another file (the number was reused, or the process), means the sender closed it.
        With ``limit`` (and ``pid``), only that many of the peer's mappings are checked:
        those checked longest ago, in turn.
        """
        with self._lock:
            if pid is not None and limit is not None:
                kept = self.maps.oldest_checked(pid, limit)
            else:
                kept = self.maps.kept(pid)
        dead = [key for key, fd in kept if not _still_open(key, fd)]
        if dead:
            with self._lock:
                for key in dead:
                    self.maps.evict(key)
                self.pruned += len(dead)
        return len(dead)

    # -- handles ---------------------------------------------------------------------------

    def resolve(
        self,
        h: Handle,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        peer_pid: int | None,
        *,
        count: bool = True,
        owner: tuple[bool, Hashable] | None = None,
        peer: KernelPeer | None = None,
        unsealed: bool = False,
    ) -> torch.Tensor:
        """Build the tensor a parsed handle describes (see `ShmResolver.resolve`).

        ``owner`` asks for one-copy receive of pool tensors (built on the region itself):
        ``(True, peer)`` holds the lease in `holds` until the tensor's storage is freed;
        ``(False, message)`` tracks the tensor for `detach`. None copies pool tensors out.
        ``peer``: the attested sender; a file opened through ``/proc`` is used only if
        it is still alive afterwards. ``unsealed``: torch's shared files may be mapped.
        """
        if not isinstance(dtype, torch.dtype):
            raise fail(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
        if len(shape) != len(h.strides):
            raise fail(f"handle has {len(h.strides)} dimensions, descriptor {len(shape)}")
        for n in shape:
            if not isinstance(n, int) or n < 0:
                raise fail(f"bad shape {shape!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            if h.kind != _EMPTY:
                raise fail("handle for an empty tensor must be EMPTY")
            out = torch.empty(shape, dtype=dtype)
        elif h.kind == _EMPTY:
            raise fail("EMPTY handle for a tensor with elements")
        else:
            if peer_pid is not None and h.pid != peer_pid:
                raise fail(_NO_ATTACH)  # (the same words as any file it may not open)
            out = self._resolve_kind(h, dtype, shape, nbytes, owner, peer, unsealed)
        if count:
            with self._lock:
                self.tensors_received += 1
                self.bytes_received += nbytes
                if h.kind != _POOL and h.kind != _EMPTY:
                    self.tensors_aliased += 1
        return out

    def _resolve_kind(
        self,
        h: Handle,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        nbytes: int,
        owner: tuple[bool, Hashable] | None,
        peer: KernelPeer | None = None,
        unsealed: bool = False,
    ) -> torch.Tensor:
        start, length = check_bounds(h, dtype.itemsize, shape)
        if h.kind == _POOL:
            return self._resolve_pool(h, dtype, shape, nbytes, owner, peer)
        if h.kind == _SHARED:
            return self._resolve_shared(h, dtype, shape, start, length, peer, SHARED_RE)
        if h.kind == _CUDA:
            return self._resolve_cuda(h, dtype, shape)
        if not unsealed:
            raise fail(_UNSEALED_REFUSED)
        return self._resolve_shared(h, dtype, shape, start, length, peer, TORCH_RE)

    def _open(
        self,
        pid: int,
        fd: int,
        dev: int,
        ino: int,
        pattern: re.Pattern[str],
        flags: int,
        peer: KernelPeer | None = None,
    ) -> tuple[int, os.stat_result]:
        """Open ``/proc/<pid>/fd/<fd>`` if it is the file described; generic errors only.

        With ``peer``, the descriptor is looked up in the ``/proc/<pid>/fd`` directory
        taken when the peer was pinned (`KernelPeer.fd_dir`), which fails once that
        process has exited, whoever has its pid now; a peer without one has the file
        kept only if its pidfd says the process is still alive after the open.
        """
        if not 0 <= fd < MAX_FD or pid <= 0:
            raise fail(_NO_ATTACH)
        fd_dir = -1
        if peer is not None and peer.fd_dir >= 0:
            if pid != peer.pid:
                raise fail(_NO_ATTACH)
            fd_dir = peer.fd_dir
        device = self._shm_dev if pattern is TORCH_RE else self._memfd_dev
        if pattern is TORCH_RE and peer is not None and fd_dir >= 0 and _getfd_usable:
            # torch's files: a regular file on /dev/shm's device with the handle's inode
            # is all the name would tell (tensorrpc's memfds keep the name check, which
            # tells a pool segment from a shared tensor's).
            try:
                ofd = _getfd(peer.pidfd, fd)
            except OSError:
                raise fail(_NO_ATTACH) from None
            if ofd >= 0:
                return self._checked(ofd, dev, ino, device)
        name, dir_fd = (str(fd), fd_dir) if fd_dir >= 0 else (f"/proc/{pid}/fd/{fd}", None)
        try:
            target = os.readlink(name, dir_fd=dir_fd)
            if not pattern.fullmatch(target):
                raise fail(_NO_ATTACH)
            # stat() follows the magic link without opening anything: check before open().
            self._check_file(os.stat(name, dir_fd=dir_fd), dev, ino, device)
            ofd = os.open(name, flags | _OPEN_FLAGS, dir_fd=dir_fd)
        except OSError:
            raise fail(_NO_ATTACH) from None
        if fd_dir < 0 and peer is not None and not peer.alive():
            os.close(ofd)
            raise fail(_NO_ATTACH)
        return self._checked(ofd, dev, ino, device)

    def _checked(self, ofd: int, dev: int, ino: int, device: int) -> tuple[int, os.stat_result]:
        """``(ofd, its fstat)`` if the file we hold is the one described; else ``ofd`` is
        closed and the generic error raised."""
        try:
            st = os.fstat(ofd)
            self._check_file(st, dev, ino, device)
        except BaseException:
            os.close(ofd)
            raise
        return ofd, st

    def _check_file(self, st: os.stat_result, dev: int, ino: int, device: int) -> None:
        if not stat.S_ISREG(st.st_mode) or st.st_dev != device:
            raise fail(_NO_ATTACH)
        if st.st_dev != dev or st.st_ino != ino:
            raise fail(_NO_ATTACH)
        if st.st_size > self.max_segment_bytes:
            raise fail(f"segment larger than this receiver's limit ({self.max_segment_bytes} B)")

    def _segment(
        self,
        h: Handle,
        pattern: re.Pattern[str],
        first: int,
        length: int,
        peer: KernelPeer | None = None,
    ) -> tuple[torch.Tensor, int]:
        """A mapping covering bytes ``first .. first+length`` of the handle's segment.

        Returns:
            ``(view, offset)``: the bytes start at ``view[offset]``.
        """
        key = (h.pid, h.dev, h.ino)
        end = max(first + length, h.base + h.span)  # the handle's whole storage must fit
        with self._lock:
            view = self.maps.get(key)
        if view is not None:
            if end > view.numel():
                raise fail("the handle reaches past the end of its segment")
            return view, first
        ofd, st = self._open(h.pid, h.fd, h.dev, h.ino, pattern, os.O_RDWR, peer)
        try:
            sealed = pattern is not TORCH_RE  # (torch's files: the caller's gate held)
            if sealed and fcntl.fcntl(ofd, fcntl.F_GET_SEALS) & _SEALED != _SEALED:
                raise fail("the segment is not sealed against shrinking and growing")
            size = st.st_size
            if end > size:
                raise fail("the handle reaches past the end of its segment")
            if size <= self.maps.max_bytes_per_peer:
                once = not sealed and not self._seen_twice(key)
                # (not kept: dies with its tensors, unmapped off the thread that drops them)
                view = map_shared(ofd, size, unmap_later=once)
                if once:
                    return view, first
                # Before keeping one more of this peer's segments, drop some it freed.
                self.prune(h.pid, PRUNE_PER_MAP)
                with self._lock:
                    self.maps.put(key, view, h.fd)
                return view, first
            window = first - first % PAGE_SIZE
            return map_shared(ofd, first - window + length, window), first - window
        except OSError as exc:
            raise fail(f"cannot map the peer's segment: {exc.strerror}") from None
        finally:
            os.close(ofd)

    def _seen_twice(self, key: tuple[int, int, int]) -> bool:
        """Whether a torch shared file was named before (else it is remembered now)."""
        with self._lock:
            seen = self._seen_once
            if seen.pop(key, 0) is None:
                return True
            seen[key] = None
            if len(seen) > _SEEN_ONCE_MAX:
                seen.popitem(last=False)
            return False

    def _resolve_pool(
        self,
        h: Handle,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        nbytes: int,
        owner: tuple[bool, Hashable] | None = None,
        peer: KernelPeer | None = None,
    ) -> torch.Tensor:
        if h.tail:
            raise fail("unexpected bytes after a POOL handle")
        if h.elem_offset != 0 or h.strides != contiguous_strides(shape) or h.span != nbytes:
            raise fail("pool handle must describe exactly one contiguous tensor")
        if h.base < REGION_HEADER or h.base % 64:
            raise fail(f"pool region at byte {h.base} is misaligned")
        if h.tag == 0:
            raise fail("pool handle without a tag")
        view, at = self._segment(h, POOL_RE, h.base - REGION_HEADER, REGION_HEADER + nbytes, peer)
        tag_at = view.data_ptr() + at
        if _read_u64(tag_at) != h.tag:
            raise fail("pool region no longer holds this tensor (lease released or expired)")
        if owner is not None:
            return (
                self._on_region(h, view, tag_at + REGION_HEADER, nbytes, owner)
                .view(dtype)
                .view(shape)
            )
        out = self.buffers.empty(nbytes)
        ctypes.memmove(out.data_ptr(), tag_at + REGION_HEADER, nbytes)
        if _read_u64(tag_at) != h.tag:
            raise fail("pool region was reused while it was read (lease released too early)")
        return out.view(dtype).view(shape)

    def _on_region(
        self, h: Handle, view: torch.Tensor, addr: int, nbytes: int, owner: tuple[bool, Hashable]
    ) -> torch.Tensor:
        """One copy in all: a ``uint8`` tensor on the region itself, leased to us while it
        lives (``hold``), or until `detach` gives it pages of its own (``keep``)."""
        hold_mode, key = owner
        array = (ctypes.c_char * nbytes).from_address(addr)
        map_key = (h.pid, h.dev, h.ino)
        if hold_mode:
            self.holds.add(key, h.lease)
            tag = Hold(self.holds, key, h.lease, view, (addr, nbytes), map_key)
        else:
            tag = Hold(None, key, h.lease, view, (addr, nbytes), map_key)
            self.holds.keep(key, tag)
        # The tensor keeps `array` alive and `array` keeps the hold (and the mapping).
        array._tensorrpc_hold = tag  # type: ignore[attr-defined]
        return torch.frombuffer(array, dtype=torch.uint8)

    def detach(self, key: Hashable) -> int:
        """The sender takes back the regions of message ``key``: its tensors still alive
        get private pages (a copy), so they keep their values. Returns how many.

        Raises:
            OSError: the kernel refused the private pages (out of memory).
        """
        alive = self.holds.detach(key)
        for hold in alive:
            privatize(hold.addr, hold.nbytes)
            with self._lock:
                self.maps.evict(hold.map_key)  # later handles must see the shared pages
        return len(alive)

    def _resolve_shared(
        self,
        h: Handle,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        start: int,
        length: int,
        peer: KernelPeer | None,
        pattern: re.Pattern[str],
    ) -> torch.Tensor:
        """A tensor on a whole file the sender shares: ``SHARED`` (sealed) or torch's."""
        if h.tail:
            raise fail("unexpected bytes after a SHARED handle")
        if h.base != 0 and (pattern is not TORCH_RE or h.base % 64):
            # (torch's file_system files keep a 64-byte reference count before the data)
            raise fail("shared handle must start at byte 0 of its segment")
        start += h.base
        size = dtype.itemsize
        if start % size == 0:
            # The hot path: a kept mapping, and its view as `dtype` made once for all.
            with self._lock:
                got = self.maps.typed((h.pid, h.dev, h.ino), dtype)
            if got is not None:
                view, cached = got
                # (as _segment: the handle's whole storage must fit)
                if max(start + length, h.base + h.span) > view.numel():
                    raise fail("the handle reaches past the end of its segment")
                if cached is not None:
                    as_dtype, offset = cached
                    elem = start // size
                    try:
                        if elem == 0:  # at the view's own offset: the cheaper call
                            return as_dtype.as_strided(shape, h.strides)
                        return torch.as_strided(as_dtype, shape, h.strides, offset + elem)
                    except RuntimeError as exc:
                        raise fail(
                            f"cannot build the tensor on the shared segment: {exc}"
                        ) from None
        view, at = self._segment(h, pattern, start, length, peer)
        try:
            if at % size == 0 and view.numel() % size == 0:
                # One view op for the common case (the handle's bytes are inside `view`).
                typed = view.view(dtype)
                return typed.as_strided(shape, h.strides, typed.storage_offset() + at // size)
            flat = view[at : at + length].view(dtype)
            return flat.as_strided(shape, h.strides)
        except RuntimeError as exc:
            raise fail(f"cannot build the tensor on the shared segment: {exc}") from None

    def _resolve_cuda(
        self, h: Handle, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:  # pragma: no cover - needs two processes and a GPU
        tail = h.tail
        if len(tail) < CUDA_TAIL.size:
            raise fail("CUDA handle truncated")
        device, size_bytes, offset_bytes, ref_offset, event_sync = CUDA_TAIL.unpack_from(tail)
        parts: list[bytes] = []
        pos = CUDA_TAIL.size
        for _ in range(3):
            if len(tail) < pos + 2:
                raise fail("CUDA handle truncated")
            (n,) = U16.unpack_from(tail, pos)
            pos += 2
            if n > 1024 or len(tail) < pos + n:
                raise fail("CUDA handle field out of range")
            parts.append(tail[pos : pos + n])
            pos += n
        if pos != len(tail):
            raise fail("unexpected bytes after a CUDA handle")
        ipc_handle, ref_handle, event_handle = parts
        if not _TORCH_NAME_RE.fullmatch(ref_handle.decode("ascii", "replace")):
            raise fail("CUDA ref-counter handle is not a torch shared-memory name")
        if not torch.cuda.is_available() or not 0 <= device < torch.cuda.device_count():
            raise fail(f"no CUDA device {device} here")
        if size_bytes != h.span:
            raise fail("CUDA handle sizes disagree")
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
            raise fail(f"CUDA IPC failed: {exc}") from None
        return tensor


class ShmResolver:
    """Resolves handles of incoming messages (implements the codec's ``TensorResolver``).

    Made by `TorchShmTransport.resolver` for one peer; handles that name any other
    process are refused. Records the lease ids it saw, for the runtime to send back.
    With an ``owner`` (see `Receiver.resolve`), pool tensors are built on the peer's
    regions (one copy in all) instead of copied out.
    """

    __slots__ = (
        "_check",
        "_closed",
        "_leases",
        "_owner",
        "_peer",
        "_peer_pid",
        "_receiver",
        "_unsealed",
    )

    def __init__(
        self,
        receiver: Receiver,
        peer_pid: int | None,
        check: Callable[[], None],
        owner: tuple[bool, Hashable] | None = None,
        peer: KernelPeer | None = None,
        unsealed: bool = False,
    ) -> None:
        self._receiver = receiver
        self._peer_pid = peer_pid
        self._check = check
        self._owner = owner
        self._peer = peer
        self._unsealed = unsealed
        self._closed = False
        #: Lease ids seen, in order of appearance (a dict: O(1) membership, no repeats).
        self._leases: dict[int, None] = {}

    @property
    def leases(self) -> tuple[int, ...]:
        """Distinct lease ids of the handles resolved so far, in order of appearance."""
        return tuple(self._leases)

    def resolve(
        self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Build the tensor a handle describes.

        Returns:
            For pool handles, a private copy, or (one-copy receive) a tensor on the
            region leased to us; a tensor aliasing the sender's memory for tensorrpc
            shared memory and CUDA storages.

        Raises:
            TensorTransportError: the handle is malformed, does not match ``dtype`` and
                ``shape``, names anything but a sealed tensorrpc segment of the peer, or
                the segment cannot be opened (another host, no ``/proc`` access, sender
                gone).
        """
        if transport != TRANSPORT_NAME:
            raise fail(f"cannot resolve a {transport!r} handle")
        self._check()
        peer = self._peer
        if peer is not None and not self._leases and not peer.alive():
            # (once per message, before anything is looked up: the process that sent it
            # exited, its pid may be reused, its connection's address with it)
            raise fail(_NO_ATTACH)
        receiver = self._receiver
        shape = shape if type(shape) is tuple else tuple(shape)
        known = (
            receiver.known(handle, dtype, shape, self._peer_pid, self._unsealed)
            if type(handle) is bytes
            else None
        )
        if known is not None:
            self._hold(lease_of(handle))
            return known
        h = unpack(handle)
        self._hold(h.lease)
        got = receiver.resolve(
            h, dtype, shape, self._peer_pid, owner=self._owner, peer=peer, unsealed=self._unsealed
        )
        receiver.learn(handle, h, dtype, shape)
        return got

    def _hold(self, lease: int) -> None:
        owner = self._owner
        if owner is not None and owner[0] and lease not in self._leases:
            # The decode itself holds each lease until close(): a tensor that dies
            # before its message's last tensor is resolved cannot release it early.
            self._receiver.holds.add(owner[1], lease)
        self._leases[lease] = None

    def close(self) -> tuple[int, ...]:
        """The message is decoded: the lease ids to RELEASE now.

        Without ``hold`` that is every lease seen. With it, a lease whose tensors are
        still alive is released later, once they are gone
        (`TorchShmTransport.releasable`);
        what this returns also includes the peer's earlier leases released since.
        Idempotent (a second call returns only what was released since).
        """
        owner = self._owner
        if owner is None or not owner[0]:
            if self._closed:
                return ()
            self._closed = True
            return self.leases
        holds = self._receiver.holds
        if not self._closed:
            self._closed = True
            for lease in self.leases:
                holds.drop(owner[1], lease)
        return holds.take(owner[1])


def refuse_all() -> None:
    """The check of a resolver for a peer that may not use ``torch_shm``.

    Raises:
        TensorTransportError: always; the message says nothing about files or descriptors.
    """
    raise fail(
        "torch_shm is not in use with this peer (the kernel did not attest its process "
        "on this connection); send tensors as frames"
    )


class ShmReceiving:
    """The receiving half of `TorchShmTransport`: resolvers, the peers' leases held by
    one-copy tensors, and the peers' mappings.

    A base class: the transport provides ``_receiver`` and ``_checked``.
    """

    _receiver: Receiver

    def _checked(self) -> None:  # pragma: no cover - the transport overrides it
        raise NotImplementedError

    @property
    def holds(self) -> Holds:
        """The peers' leases held by our received tensors (``holds.ready``: releasable)."""
        return self._receiver.holds

    def resolver(
        self,
        peer_pid: int | None,
        *,
        hold: Hashable = None,
        keep: Hashable = None,
        peer: KernelPeer | None = None,
        unsealed: bool = False,
    ) -> ShmResolver:
        """A resolver that accepts handles from the process ``peer_pid`` only.

        Args:
            peer_pid: the pid the kernel attested for the connection (see
                docs/security.md). ``None`` accepts any pid; use it only for tests and
                tools.
            hold: one-copy receive from a peer that keeps its regions until a RELEASE
                (any hashable key for that peer): pool tensors are built on the peer's
                region, which stays leased to us until the tensor's storage is freed;
                [`ShmResolver.close`][tensorrpc.transports.torch_shm.ShmResolver.close]
                and `releasable` say which lease ids to RELEASE.
            keep: one-copy receive of one message (any hashable key; a tuple starting
                with the peer's key) whose sender takes its regions back by itself (an
                argument lease ends with the first reply): call `detach` with the key
                before that point. Without ``hold`` or ``keep``, pool tensors are copied
                out and every lease may be released once the message is decoded.
            peer: the attested process (its pidfd): files are used only while it lives.
            unsealed: map torch's own shared files (its ``alias_gate`` held).

        Raises:
            TensorTransportError: the transport is closed.
            ValueError: both ``hold`` and ``keep`` given.
        """
        self._checked()
        if hold is not None and keep is not None:
            raise ValueError("hold and keep are exclusive")
        owner = (True, hold) if hold is not None else (False, keep) if keep is not None else None
        return ShmResolver(self._receiver, peer_pid, self._checked, owner, peer, unsealed)

    def detach(self, keep: Hashable) -> int:
        """Message ``keep`` ends: its tensors still on the peer's regions get private pages.

        Returns:
            How many tensors were still alive (and copied); usually none.

        Raises:
            TensorTransportError: the kernel refused the private pages.
        """
        try:
            return self._receiver.detach(keep)
        except OSError as exc:
            raise fail(f"cannot give received tensors pages of their own: {exc.strerror}") from None

    def releasable(self, peer: Hashable) -> tuple[int, ...]:
        """Lease ids of ``peer`` (a ``hold`` key) whose tensors are all gone, each once."""
        return self._receiver.holds.take(peer)

    def releasable_peers(self) -> list[Hashable]:
        """``hold`` keys with releasable leases (for a periodic flush)."""
        return self._receiver.holds.peers()

    def forget_holds(self, peer: Hashable) -> int:
        """The peer is gone: release nothing more to it, and give the tensors still on the
        regions of its messages (``keep`` keys starting with ``peer``) pages of their own.

        Tensors received by ``hold`` stay valid: their mapping keeps the memory alive.

        Returns:
            How many tensors were copied.
        """
        copied = 0
        for key in self._receiver.holds.forget(peer):
            copied += self.detach(key)
        return copied

    def refusing_resolver(self) -> ShmResolver:
        """A resolver that refuses every handle: for a peer the kernel did not attest."""
        return ShmResolver(self._receiver, 0, refuse_all)

    def forget_peer(self, peer_pid: int) -> int:
        """Unmap the peer's segments (it died or left). Returns how many."""
        with self._receiver._lock:
            return self._receiver.maps.forget(peer_pid)
