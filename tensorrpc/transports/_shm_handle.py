"""The ``torch_shm`` handle: its wire format and the checks that need no memory access.

A handle is a packed struct (magic, version, kind, ndim, pid, fd, dev, ino, lease, tag,
base, span, elem_offset), the strides, and a kind-specific tail. Everything here is pure:
parse, bounds, layout. The receiver (`tensorrpc.transports._shm_recv`) then checks
the file it names before it maps anything.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from tensorrpc._exceptions import TensorTransportError

__all__ = [
    "TRANSPORT_NAME",
    "HandleKind",
    "fail",
    "pack",
    "pack_fields",
    "unpack",
]

#: The name this transport goes by in descriptors and handshakes.
TRANSPORT_NAME: Final = "torch_shm"

_MAGIC = b"TRSH"
_VERSION = 1
# magic, version, kind, ndim, pid, fd, dev, ino, lease, tag, base, span, elem_offset
_HEAD = struct.Struct("<4sBBHiiQQQQQQq")
#: Where the lease id lies in a handle: the only field that differs between two handles
#: of one tensor in shared memory (`without_lease`).
LEASE_AT: Final = struct.calcsize("<4sBBHiiQQ")
LEASE_END: Final = LEASE_AT + 8
CUDA_TAIL: Final = struct.Struct("<iQQQB")
U16: Final = struct.Struct("<H")
_MAX_NDIM = 64
_MAX_HANDLE = 4096
MAX_FD: Final = 1 << 20  # the kernel's hard ceiling on fs.nr_open
_MAX_SPAN = 1 << 46
_MAX_BASE = 1 << 46
#: The strides' struct for each rank (built once: a format string per call costs more).
_STRIDES: Final = tuple(struct.Struct(f"<{n}q") for n in range(_MAX_NDIM + 1))


class HandleKind(IntEnum):
    """Where a handle's bytes live (byte 5 of the handle)."""

    #: A tensor with no elements: nothing to map.
    EMPTY = 0
    #: A region of the sender's memfd pool (a sealed memfd).
    POOL = 1
    #: A storage in torch's shared memory, ``file_descriptor`` strategy (unsealed: mapped
    #: only past the unsealed-alias gate, docs/security.md).
    TORCH_FD = 2
    #: A storage in torch's shared memory, ``file_system`` strategy (unsealed, as above;
    #: its data starts at byte 64 of the file, after torch's reference count).
    TORCH_FILE = 3
    #: A CUDA storage shared through torch's CUDA IPC.
    CUDA = 4
    #: A tensor in tensorrpc shared memory (``tensorrpc.shared_empty``): a sealed memfd,
    #: sent by alias.
    SHARED = 5


@dataclass(slots=True)
class Handle:
    """A parsed handle (every field from the wire: untrusted until checked).

    Treat it as immutable. (Not a frozen dataclass only because a frozen one takes 5 µs
    to build, twice per transfer.)
    """

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


#: Handle kinds by their wire value.
_KINDS: Final = tuple(HandleKind)


def fail(message: str) -> TensorTransportError:
    """The error for a handle that cannot be used (never names files or descriptors)."""
    return TensorTransportError(f"torch_shm: {message}")


def pack(h: Handle) -> bytes:
    """The wire form of a handle."""
    return pack_fields(
        h.kind,
        h.pid,
        h.fd,
        h.dev,
        h.ino,
        h.lease,
        h.tag,
        h.base,
        h.span,
        h.elem_offset,
        h.strides,
        h.tail,
    )


def pack_fields(
    kind: HandleKind,
    pid: int,
    fd: int,
    dev: int,
    ino: int,
    lease: int,
    tag: int,
    base: int,
    span: int,
    elem_offset: int,
    strides: tuple[int, ...],
    tail: bytes,
) -> bytes:
    """The wire form of the handle with these fields (`pack` without building a `Handle`)."""
    head = _HEAD.pack(
        _MAGIC,
        _VERSION,
        kind,
        len(strides),
        pid,
        fd,
        dev,
        ino,
        lease,
        tag,
        base,
        span,
        elem_offset,
    )
    return head + _strides_struct(len(strides)).pack(*strides) + tail


def _strides_struct(ndim: int) -> struct.Struct:
    return _STRIDES[ndim] if ndim <= _MAX_NDIM else struct.Struct(f"<{ndim}q")


def unpack(handle: bytes) -> Handle:
    """Parse a handle from the wire.

    Raises:
        TensorTransportError: it is not a well-formed handle of this version.
    """
    if type(handle) is bytes:
        data = handle
    elif isinstance(handle, bytes | bytearray | memoryview):
        data = bytes(handle)
    else:
        raise fail(f"handle must be bytes, not {type(handle).__name__}")
    if not _HEAD.size <= len(data) <= _MAX_HANDLE:
        raise fail(f"handle of {len(data)} bytes (expected {_HEAD.size}..{_MAX_HANDLE})")
    (magic, version, kind, ndim, pid, fd, dev, ino, lease, tag, base, span, elem_offset) = (
        _HEAD.unpack_from(data)
    )
    if magic != _MAGIC:
        raise fail("not a torch_shm handle (bad magic)")
    if version != _VERSION:
        raise fail(f"handle version {version} not supported (this side speaks {_VERSION})")
    if kind >= len(_KINDS):
        raise fail(f"unknown handle kind {kind}")
    if ndim > _MAX_NDIM:
        raise fail(f"handle with {ndim} dimensions")
    end = _HEAD.size + 8 * ndim
    if len(data) < end:
        raise fail("handle truncated in its strides")
    strides = _STRIDES[ndim].unpack_from(data, _HEAD.size)
    return Handle(
        _KINDS[kind], pid, fd, dev, ino, lease, tag, base, span, elem_offset, strides, data[end:]
    )


def without_lease(handle: bytes) -> bytes:
    """``handle`` less its lease id: equal for every handle of one view of one storage."""
    return handle[:LEASE_AT] + handle[LEASE_END:]


def lease_of(handle: bytes) -> int:
    """The lease id of a well-formed handle (`unpack` checked one with these bytes)."""
    return int.from_bytes(handle[LEASE_AT:LEASE_END], "little")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides (in elements) for ``shape``."""
    if len(shape) == 1:
        return (1,)
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def non_overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether no two elements of the strided view share memory.

    A view whose elements overlap (a zero stride, ``expand``) would let 4 KiB of shared
    memory stand for a tensor of any size; such views are never sent or accepted by alias.
    """
    dims = sorted((s, n) for n, s in zip(shape, strides, strict=True) if n > 1)
    reach = 0  # elements spanned by the dims so far, minus one
    for stride, n in dims:
        if stride <= reach:
            return False
        reach += (n - 1) * stride
    return True


def check_bounds(h: Handle, dtype_size: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """Check a non-empty handle's pid, strides and span against the descriptor.

    Returns:
        ``(start, length)``: the bytes of the storage the view reads, relative to ``base``.

    Raises:
        TensorTransportError: a field is out of range, or the view leaves its storage.
    """
    if h.pid <= 0:
        raise fail(f"bad pid {h.pid}")
    strides = h.strides
    if h.elem_offset < 0:
        raise fail("negative stride or offset")
    if not 0 < h.span <= _MAX_SPAN or not 0 <= h.base <= _MAX_BASE:
        raise fail(f"span {h.span} or base {h.base} out of range")
    if strides == contiguous_strides(shape):
        extent = math.prod(shape)  # C-contiguous and non-empty: no overlap, no gap
    else:
        if any(s < 0 for s in strides):
            raise fail("negative stride or offset")
        if not non_overlapping(shape, strides):
            raise fail("the handle's strides make elements overlap (a zero or short stride)")
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        if math.prod(shape) > extent:
            raise fail("the handle's strides make elements overlap")
    start = h.elem_offset * dtype_size
    length = extent * dtype_size
    if start + length > h.span:
        raise fail(f"tensor needs bytes {start}..{start + length} of a {h.span}-byte storage")
    return start, length
