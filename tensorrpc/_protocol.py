"""The wire protocol, sans-I/O: frames in, typed headers and bodies out.

A tensorrpc message (after the routing-id frame a ROUTER socket adds or strips) is a list
of frames ``[header, payload, *buffers]``; docs/protocol.md is the full specification.
This module packs and unpacks the fixed header, encodes and decodes the msgpack bodies of
the control kinds (HELLO, WELCOME, REJECT, BYE, CREDIT, ERROR), and checks the frame
layout of every kind. Value-carrying payloads (CALL, RESULT, STREAM_ITEM) belong to
``_codec``.

Rules this module keeps:

1. Nothing here performs I/O or imports zmq, asyncio, anyio or trio.
2. Everything decoded from the wire is checked; any violation raises
   [`RemoteProtocolError`][tensorrpc.RemoteProtocolError] and nothing else (ormsgpack errors
   included).
3. Everything we are asked to encode is checked too; a violation raises
   [`LocalProtocolError`][tensorrpc.LocalProtocolError] before any byte is produced.
4. Header packing and unpacking run once per message: they use one precompiled
   ``struct.Struct`` and small bounded caches, and never copy payload or buffer frames.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypeAlias, cast

import ormsgpack

from tensorrpc._exceptions import (
    LocalProtocolError,
    RemoteProtocolError,
    TensorRPCError,
    error_from_wire,
)
from tensorrpc._metadata import EMPTY as _NO_METADATA, decode_block
from tensorrpc._text import CONTROL

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from typing_extensions import Buffer

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "MAX_BODY_BYTES",
    "MAX_BUFFERS",
    "MAX_CALL_RELEASES",
    "MAX_CONTROL_BYTES",
    "MAX_CONTROL_OBJECTS",
    "MAX_LIST_ITEMS",
    "MAX_METHOD_BYTES",
    "MAX_NAME_CHARS",
    "MAX_PATH_PARTS",
    "MAX_SIGNATURE_CHARS",
    "MAX_TEXT_CHARS",
    "MAX_TRACEBACK_CHARS",
    "PROTOCOL_VERSION",
    "TRACE_CONTEXT_BYTES",
    "Attach",
    "Bye",
    "ControlBody",
    "Credit",
    "ErrorInfo",
    "Flags",
    "Header",
    "Hello",
    "MessageKind",
    "Reject",
    "RejectReason",
    "Release",
    "Welcome",
    "count_msgpack_objects",
    "decode_control",
    "encode_control",
    "encode_error",
    "header_version",
    "pack_call_header",
    "pack_metadata_reply_header",
    "pack_reply_header",
    "split_frames",
    "unpack_header",
]

#: The protocol version this implementation speaks (header byte 2).
PROTOCOL_VERSION: Final = 1
#: First two bytes of every header frame.
MAGIC: Final = b"TR"
_HEADER = struct.Struct("<2sBBHHQI")
#: Size in bytes of the fixed part of the header frame.
HEADER_SIZE: Final = _HEADER.size
#: Longest method name, in UTF-8 bytes, that may follow a CALL header.
MAX_METHOD_BYTES: Final = 255
#: Most lease ids one CALL header carries (the ``RELEASES`` flag); more go by RELEASE.
MAX_CALL_RELEASES: Final = 64
#: Longest identifier-like string in a control body (ids, names, fingerprints, reasons).
MAX_NAME_CHARS: Final = 1024
#: Longest free-text string in a control body (``message`` fields).
MAX_TEXT_CHARS: Final = 64 * 1024
#: Longest ``traceback`` in an ERROR body.
MAX_TRACEBACK_CHARS: Final = 1024 * 1024
#: Most entries in a list field of a control body.
MAX_LIST_ITEMS: Final = 4096
#: Largest control payload frame of any kind, in bytes (ERROR's cap; see MAX_BODY_BYTES).
MAX_CONTROL_BYTES: Final = 4 * 1024 * 1024
#: Most msgpack objects (every value, key and container counts one) in a control body.
#: A HELLO at its field limits has four lists of at most 4096 entries; the rest is slack
#: for keys added by later revisions. Checked before decoding, so that a body of a
#: million empty arrays costs a scan that stops here, not a million Python lists.
MAX_CONTROL_OBJECTS: Final = 32 * 1024
#: Default bound on the buffer frames after the payload of a value-carrying message.
MAX_BUFFERS: Final = 1024
#: Most entries of ERROR's ``path``.
MAX_PATH_PARTS: Final = 256
#: Longest entry of HELLO's ``signatures`` list, in characters.
MAX_SIGNATURE_CHARS: Final = 4096
#: Size of the binary W3C trace context a CALL with the ``TRACE`` flag carries at the end of
#: its header frame: version (1 byte, 0), trace-id (16), parent span id (8), trace-flags (1).
TRACE_CONTEXT_BYTES: Final = 26

_U16_MAX: Final = 0xFFFF
_U32_MAX: Final = 0xFFFF_FFFF
_U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF
_I64_MAX: Final = 0x7FFF_FFFF_FFFF_FFFF


class MessageKind(IntEnum):
    """What a message is; header byte 3 (see docs/protocol.md for directions)."""

    #: engine → client: who I am (first message an engine sends on a connection).
    HELLO = 1
    #: client → engine: the HELLO is accepted.
    WELCOME = 2
    #: either way: the handshake is refused; the sender then forgets the peer.
    REJECT = 3
    #: client → engine: run a method; codec payload of the argument list (+ buffers).
    CALL = 4
    #: client → engine: stop the call with this ``call_id``; empty payload.
    CANCEL = 5
    #: engine → client: the call's return value; codec payload (+ buffers).
    RESULT = 6
    #: engine → client: the call failed; `ErrorInfo` body.
    ERROR = 7
    #: either way: one item of a stream (engine → client: a response item; client →
    #: engine: a request item of a call with ``REQUEST_STREAM``); codec payload (+ buffers).
    STREAM_ITEM = 8
    #: either way: a stream finished normally (engine → client: the response stream;
    #: client → engine: the request stream, a half-close); empty payload.
    STREAM_END = 9
    #: either way: liveness probe; empty payload; ``call_id`` is an opaque nonce.
    PING = 10
    #: either way: answer to PING, echoing its ``call_id``; empty payload.
    PONG = 11
    #: either way: the sender is leaving; `Bye` body.
    BYE = 12
    #: either way: the consumer of a stream took ``n`` more items (client → engine: of a
    #: response stream; engine → client: of a request stream); `Credit` body.
    CREDIT = 13
    #: client → engine: the client attached to the shared-memory tensors of these result
    #: leases (``torch_shm``); the engine may reuse their memory. `Release` body.
    RELEASE = 14
    #: either way, on a bulk connection only (docs/design.md, "a bulk connection per
    #: peer"): the dialer's first message binds the connection to the session whose
    #: handshake gave the token; the listener answers with the same kind (empty token)
    #: once it is bound. `Attach` body.
    ATTACH = 16


#: Largest payload accepted per control kind, in bytes, checked before decoding. The
#: bodies are small and fixed except HELLO's ``signatures`` (1 MiB holds a service of
#: ~2,000 methods with 400-character signatures; an engine cuts its signatures rather than
#: exceed it), REJECT's ``message`` (65,536 characters of up to 4 UTF-8 bytes) and ERROR's
#: ``traceback`` (1,048,576 characters). The empty kinds (CANCEL, STREAM_END, PING, PONG)
#: take 0 bytes; CALL, RESULT and STREAM_ITEM are bounded by the codec.
MAX_BODY_BYTES: Final[Mapping[MessageKind, int]] = MappingProxyType(
    {
        MessageKind.HELLO: 1024 * 1024,
        MessageKind.WELCOME: 64 * 1024,
        MessageKind.REJECT: 320 * 1024,
        MessageKind.BYE: 8 * 1024,
        MessageKind.CREDIT: 1024,
        MessageKind.RELEASE: 64 * 1024,
        MessageKind.ATTACH: 1024,
        MessageKind.ERROR: MAX_CONTROL_BYTES,
    }
)


class Flags(IntFlag):
    """Header flag bits (header bytes 4-5); only CALL may set any, but ``METADATA``."""

    #: The CALL expects a stream (STREAM_ITEM… STREAM_END) instead of one RESULT.
    STREAM = 1
    #: Refuse with ``ErrorCode.OVERLOADED`` rather than queue when the engine is full.
    NO_WAIT = 2
    #: Result tensors at least the engine's ``torch_shm`` threshold may travel by
    #: ``torch_shm`` handle (the call's transport is ``auto``).
    SHM_RESULTS = 4
    #: Every out-of-band result tensor should travel by ``torch_shm`` handle (the call's
    #: transport is ``torch_shm``).
    SHM_RESULTS_ALL = 8
    #: The header frame ends with a `TRACE_CONTEXT_BYTES`-byte W3C trace context
    #: (after the method name).
    TRACE = 16
    #: Right after the fixed header, before the method name, the frame carries result
    #: lease ids the client is done with (as a RELEASE would): a count byte ``k``
    #: (1..`MAX_CALL_RELEASES`) and ``k`` u64 little-endian ids.
    RELEASES = 32
    #: The header frame carries a metadata block (`tensorrpc._metadata`): on a CALL
    #: after the fixed header and any lease ids, before the method name; on a RESULT or
    #: STREAM_END (the only other kinds that may set it) right after the fixed header.
    METADATA = 64
    #: The engine may compress the results' payload and tensor frames with a codec the
    #: client listed in WELCOME's ``compression`` (never what goes by ``torch_shm``).
    COMPRESS = 128
    #: The call's request is a stream: STREAM_ITEMs from the client follow the CALL (as
    #: the engine's CREDIT allows), ended by the client's STREAM_END (a half-close).
    REQUEST_STREAM = 256


_KNOWN_FLAGS: Final = int(
    Flags.STREAM
    | Flags.REQUEST_STREAM
    | Flags.NO_WAIT
    | Flags.SHM_RESULTS
    | Flags.SHM_RESULTS_ALL
    | Flags.TRACE
    | Flags.RELEASES
    | Flags.METADATA
    | Flags.COMPRESS
)
_TRACE: Final = int(Flags.TRACE)
_RELEASES: Final = int(Flags.RELEASES)
_METADATA: Final = int(Flags.METADATA)
# The flags a caller of pack_call_header may pass (TRACE, RELEASES and METADATA follow
# from its trace, releases and metadata arguments).
_CALLER_FLAGS: Final = _KNOWN_FLAGS & ~_TRACE & ~_RELEASES & ~_METADATA
# The kinds besides CALL whose header may carry metadata (response metadata).
_METADATA_REPLIES: Final = frozenset({6, 9})
# One packer per count of lease ids a CALL header carries: the count byte, then the ids.
_RELEASE_BLOCKS: Final = tuple(struct.Struct(f"<B{k}Q") for k in range(MAX_CALL_RELEASES + 1))
_NO_FLAGS: Final = Flags(0)


class RejectReason:
    """The ``reason`` codes a REJECT carries (plain strings on the wire)."""

    #: Schema fingerprints differ.
    FINGERPRINT: Final = "fingerprint"
    #: Service names differ.
    SERVICE: Final = "service"
    #: Protocol versions differ.
    VERSION: Final = "version"
    #: Another live engine already uses this engine id.
    DUPLICATE_ID: Final = "duplicate_id"
    #: The handshake message (HELLO or WELCOME) was malformed; ``message`` names the fault.
    PROTOCOL: Final = "protocol"
    #: Anything else; ``message`` explains.
    OTHER: Final = "other"


_VALUE_KINDS: Final = frozenset({MessageKind.CALL, MessageKind.RESULT, MessageKind.STREAM_ITEM})
_EMPTY_KINDS: Final = frozenset(
    {MessageKind.CANCEL, MessageKind.STREAM_END, MessageKind.PING, MessageKind.PONG}
)
# Kinds whose call_id must be 0 (connection level) and kinds whose call_id must not be.
_CONNECTION_KINDS: Final = frozenset(
    {
        MessageKind.HELLO,
        MessageKind.WELCOME,
        MessageKind.REJECT,
        MessageKind.BYE,
        MessageKind.RELEASE,
        MessageKind.ATTACH,
    }
)
_CALL_KINDS: Final = frozenset(
    {
        MessageKind.CALL,
        MessageKind.CANCEL,
        MessageKind.RESULT,
        MessageKind.STREAM_ITEM,
        MessageKind.STREAM_END,
        MessageKind.CREDIT,
    }
)
_KIND_BY_VALUE: Final = {int(k): k for k in MessageKind}
#: The kinds `pack_reply_header` packs with a non-zero call id.
_REPLY_CALL_KINDS: Final = _CALL_KINDS - {MessageKind.CALL}


@dataclass(frozen=True, slots=True)
class Header:
    """The decoded header frame of one message.

    Args:
        kind: What the message is.
        call_id: The call it belongs to; 0 for connection-level kinds (HELLO, WELCOME,
            REJECT, BYE, RELEASE, ATTACH; and ERROR about the connection rather than a
            call). PING/PONG carry an opaque nonce.
        flags: `Flags`; only CALL may set any, but ``METADATA`` (RESULT, STREAM_END).
        timeout_ms: CALL only: relative deadline in milliseconds, 0 for none.
        method: CALL only: the method name (non-empty).
        trace: CALL with the ``TRACE`` flag only: the binary W3C trace context
            (`TRACE_CONTEXT_BYTES` bytes); empty otherwise.
        releases: CALL with the ``RELEASES`` flag only: the result lease ids the client
            is done with (1..`MAX_CALL_RELEASES` of them); empty otherwise.
        metadata: With the ``METADATA`` flag (CALL, RESULT, STREAM_END): the call's
            request or response metadata (key → value, checked); empty otherwise.
    """

    #: What the message is.
    kind: MessageKind
    #: Call id (u64), 0 for connection-level kinds.
    call_id: int = 0
    #: Flag bits, CALL only.
    flags: Flags = _NO_FLAGS
    #: Relative deadline in milliseconds (u32), CALL only; 0 means none.
    timeout_ms: int = 0
    #: Method name, CALL only.
    method: str = ""
    #: Binary W3C trace context, CALL with the ``TRACE`` flag only; empty otherwise.
    trace: bytes = b""
    #: Result lease ids the client is done with, CALL with ``RELEASES`` only.
    releases: tuple[int, ...] = ()
    #: Request (CALL) or response (RESULT, STREAM_END) metadata; ``METADATA`` flag only.
    metadata: Mapping[str, str] = field(default_factory=lambda: _NO_METADATA)


# -- header packing ------------------------------------------------------------------------

_pack = _HEADER.pack
_unpack_from = _HEADER.unpack_from
_CACHE_LIMIT: Final = 4096
_method_bytes_cache: dict[str, bytes] = {}
_method_name_cache: dict[bytes, str] = {}
_reply_header_cache: dict[int, bytes] = {}
_FLAGS_BY_VALUE: Final = {int(f): f for f in (Flags(v) for v in range(_KNOWN_FLAGS + 1))}

# Building a frozen dataclass through its __init__ costs ~1 us (object.__setattr__ per
# field); unpack_header runs once per message, so it fills the slots directly.
_new_object = object.__new__
_set_kind, _set_call_id, _set_flags, _set_timeout_ms, _set_method, _set_trace, _set_releases = (
    Header.__dict__[name].__set__
    for name in ("kind", "call_id", "flags", "timeout_ms", "method", "trace", "releases")
)
_set_metadata = Header.__dict__["metadata"].__set__


def _make_header(
    kind: MessageKind,
    call_id: int,
    flags: Flags,
    timeout_ms: int,
    method: str,
    trace: bytes = b"",
    releases: tuple[int, ...] = (),
    metadata: Mapping[str, str] = _NO_METADATA,
) -> Header:
    header: Header = _new_object(Header)
    _set_kind(header, kind)
    _set_call_id(header, call_id)
    _set_flags(header, flags)
    _set_timeout_ms(header, timeout_ms)
    _set_method(header, method)
    _set_trace(header, trace)
    _set_releases(header, releases)
    _set_metadata(header, metadata)
    return header


def _method_bytes(method: str) -> bytes:
    if type(method) is str:
        encoded = _method_bytes_cache.get(method)
        if encoded is not None:
            return encoded
    if not isinstance(method, str) or not method:
        raise LocalProtocolError("a CALL needs a non-empty method name")
    try:
        encoded = method.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"method name {method!r} is not valid UTF-8") from exc
    if len(encoded) > MAX_METHOD_BYTES:
        raise LocalProtocolError(
            f"method name is {len(encoded)} bytes long; the limit is {MAX_METHOD_BYTES}"
        )
    if len(_method_bytes_cache) < _CACHE_LIMIT:
        _method_bytes_cache[method] = encoded
    return encoded


def _check_int(name: str, value: object, maximum: int) -> int:
    if type(value) is not int and not isinstance(value, IntEnum | IntFlag):
        raise LocalProtocolError(f"header {name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise LocalProtocolError(f"header {name}={value} is out of range 0..{maximum}")
    return int(value)


def pack_call_header(
    call_id: int,
    method: str,
    flags: int = 0,
    timeout_ms: int = 0,
    trace: bytes = b"",
    releases: Sequence[int] = (),
    metadata: bytes = b"",
) -> bytes:
    """Pack the header frame of a CALL (the hot path: no `Header` object).

    Args:
        call_id: The call id, 1..2**64-1.
        method: The method name (1..255 UTF-8 bytes).
        flags: `Flags` bits (``TRACE`` and ``RELEASES`` are set from ``trace`` and
            ``releases``, never by the caller).
        timeout_ms: Relative deadline in milliseconds (0 = none, at most 2**32-1).
        trace: A binary W3C trace context of `TRACE_CONTEXT_BYTES` bytes to carry
            (sets the ``TRACE`` flag), or empty for none.
        releases: Result lease ids (each 1..2**63-1, at most `MAX_CALL_RELEASES`) to
            carry (sets the ``RELEASES`` flag), or empty for none.
        metadata: The request metadata block (`tensorrpc._metadata.encode_block`, sets
            the ``METADATA`` flag), or empty for none.

    Returns:
        The header frame.

    Raises:
        LocalProtocolError: Any field is out of range, the method name is invalid,
            ``trace`` has the wrong size or ``releases`` has too many or bad ids.
    """
    name = _method_bytes(method)
    if flags & ~_CALLER_FLAGS:
        raise LocalProtocolError(f"unknown flag bits 0x{int(flags) & ~_CALLER_FLAGS:x}")
    if metadata:
        name = metadata + name
        flags |= _METADATA
    if releases:
        name = _release_block(releases) + name
        flags |= _RELEASES
    if trace:
        if len(trace) != TRACE_CONTEXT_BYTES:
            raise LocalProtocolError(
                f"a trace context is {TRACE_CONTEXT_BYTES} bytes, not {len(trace)}"
            )
        flags |= _TRACE
        name += trace
    if call_id == 0:
        raise LocalProtocolError("a CALL needs a non-zero call_id")
    try:
        return _pack(MAGIC, PROTOCOL_VERSION, 4, flags, 0, call_id, timeout_ms) + name
    except struct.error as exc:
        raise LocalProtocolError(
            f"CALL header out of range (call_id={call_id!r}, timeout_ms={timeout_ms!r})"
        ) from exc


def _release_block(releases: Sequence[int]) -> bytes:
    """The count byte and the lease ids of a CALL header with ``RELEASES``."""
    count = len(releases)
    if count > MAX_CALL_RELEASES:
        raise LocalProtocolError(
            f"a CALL carries at most {MAX_CALL_RELEASES} lease ids, not {count}"
        )
    for lease in releases:
        if type(lease) is not int or not 0 < lease <= _I64_MAX:
            raise LocalProtocolError(f"lease id {lease!r} is out of range 1..{_I64_MAX}")
    return _RELEASE_BLOCKS[count].pack(count, *releases)


def pack_reply_header(kind: MessageKind, call_id: int = 0) -> bytes:
    """Pack the header frame of any kind but CALL (no flags, no deadline, no method).

    Headers with ``call_id == 0`` are cached, since they are identical every time.

    Args:
        kind: The message kind (not CALL).
        call_id: The call id; must be non-zero for call-level kinds (CANCEL, RESULT,
            STREAM_ITEM, STREAM_END, CREDIT) and zero for HELLO, WELCOME, REJECT and BYE.

    Returns:
        The header frame.

    Raises:
        LocalProtocolError: ``kind`` is CALL or unknown, or ``call_id`` does not fit it.
    """
    if call_id == 0:
        cached = _reply_header_cache.get(kind)
        if cached is not None:
            return cached
    elif (
        type(kind) is MessageKind
        and kind in _REPLY_CALL_KINDS
        and type(call_id) is int
        and 0 < call_id <= _U64_MAX
    ):
        # The hot path (a RESULT, STREAM_ITEM, ...): `_check_kind_call_id` would pass.
        return _pack(MAGIC, PROTOCOL_VERSION, kind, 0, 0, call_id, 0)
    kind = _check_kind_call_id(kind, call_id)
    try:
        packed = _pack(MAGIC, PROTOCOL_VERSION, kind, 0, 0, call_id, 0)
    except struct.error as exc:
        raise LocalProtocolError(f"call_id {call_id!r} is out of range") from exc
    if call_id == 0:
        _reply_header_cache[kind] = packed
    return packed


def pack_metadata_reply_header(kind: MessageKind, call_id: int, metadata: bytes) -> bytes:
    """Pack the header frame of a RESULT or STREAM_END that carries response metadata.

    Args:
        kind: RESULT or STREAM_END.
        call_id: The call's id (non-zero).
        metadata: The block (`tensorrpc._metadata.encode_block`); empty: no metadata
            (the plain header of `pack_reply_header`).

    Raises:
        LocalProtocolError: Another kind, or ``call_id`` out of range.
    """
    if not metadata:
        return pack_reply_header(kind, call_id)
    if kind not in _METADATA_REPLIES:
        raise LocalProtocolError(f"{kind!r} carries no metadata")
    _check_kind_call_id(kind, call_id)
    return _pack(MAGIC, PROTOCOL_VERSION, kind, _METADATA, 0, call_id, 0) + metadata


def _check_kind_call_id(kind: object, call_id: object) -> MessageKind:
    if type(kind) is not MessageKind:
        known = _KIND_BY_VALUE.get(kind) if type(kind) is int else None
        if known is None:
            raise LocalProtocolError(f"unknown message kind {kind!r}")
        kind = known
    if kind is MessageKind.CALL:
        raise LocalProtocolError("use pack_call_header() for CALL headers")
    _check_int("call_id", call_id, _U64_MAX)
    if call_id != 0 and kind in _CONNECTION_KINDS:
        raise LocalProtocolError(f"{kind.name} is connection-level: call_id must be 0")
    if call_id == 0 and kind in _CALL_KINDS:
        raise LocalProtocolError(f"{kind.name} needs a non-zero call_id")
    return kind


# -- header unpacking ----------------------------------------------------------------------


def header_version(frame: Buffer) -> int | None:
    """Read only the protocol version of a header frame, without validating the rest.

    The magic and the version byte keep their place in every protocol version, so a peer
    can learn which version another speaks (and say so in a REJECT) even when it cannot
    parse the rest.

    Args:
        frame: A header frame.

    Returns:
        The version byte, or None when the frame is too short or the magic is wrong.
    """
    view = memoryview(frame)
    if view.nbytes < 3 or view.ndim != 1 or view.itemsize != 1 or view[:2].tobytes() != MAGIC:
        return None
    return int(view[2])


def unpack_header(frame: Buffer) -> Header:
    """Parse and validate a header frame.

    Args:
        frame: The first frame of a message (after any routing id).

    Returns:
        The decoded header.

    Raises:
        RemoteProtocolError: The frame is not a valid header of this protocol version:
            truncated, wrong magic, unknown version, kind or flags, non-zero reserved
            field, fields that do not fit the kind, or a bad method name.
    """
    try:
        view = memoryview(frame)
    except TypeError as exc:
        raise RemoteProtocolError(f"header frame is not a buffer: {type(frame).__name__}") from exc
    size = view.nbytes
    if not view.c_contiguous:
        raise RemoteProtocolError("header frame is not a contiguous buffer")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if size < HEADER_SIZE:
        raise RemoteProtocolError(
            f"truncated header: {size} bytes, at least {HEADER_SIZE} expected"
        )
    magic, version, kind_value, flags, reserved, call_id, timeout_ms = _unpack_from(view)
    kind = _KIND_BY_VALUE.get(kind_value)
    if magic != MAGIC or version != PROTOCOL_VERSION or kind is None or reserved:
        raise _prefix_error(magic, version, kind_value, reserved)
    if kind is MessageKind.CALL:
        return _call_header(view, size, flags, call_id, timeout_ms)
    if flags == _METADATA and kind_value in _METADATA_REPLIES and call_id and not timeout_ms:
        metadata, end = decode_block(view, HEADER_SIZE, size)
        if end != size:
            raise RemoteProtocolError(f"{kind.name} header has bytes after its metadata")
        return _make_header(kind, call_id, Flags.METADATA, 0, "", metadata=metadata)
    if (
        size != HEADER_SIZE
        or flags
        or timeout_ms
        or (kind in _CONNECTION_KINDS if call_id else kind in _CALL_KINDS)
    ):
        raise _reply_fields_error(kind, size, flags, timeout_ms, call_id)
    return _make_header(kind, call_id, _NO_FLAGS, 0, "")


def _prefix_error(magic: bytes, version: int, kind_value: int, reserved: int) -> Exception:
    """What is wrong with a header's magic, version, kind or reserved field (cold path)."""
    if magic != MAGIC:
        return RemoteProtocolError(f"bad magic {magic!r} (expected {MAGIC!r}): not tensorrpc")
    if version != PROTOCOL_VERSION:
        return RemoteProtocolError(
            f"unsupported protocol version {version} (this peer speaks {PROTOCOL_VERSION})"
        )
    if kind_value not in _KIND_BY_VALUE:
        return RemoteProtocolError(f"unknown message kind {kind_value}")
    return RemoteProtocolError(f"reserved header field is {reserved}, must be 0")


def _reply_fields_error(
    kind: MessageKind, size: int, flags: int, timeout_ms: int, call_id: int
) -> Exception:
    """What is wrong with the fields of a header other than CALL (cold path)."""
    if size != HEADER_SIZE:
        return RemoteProtocolError(
            f"{kind.name} header is {size} bytes; only CALL carries a method name"
        )
    if flags:
        return RemoteProtocolError(
            f"{kind.name} header has flags 0x{flags:x}; only CALL may (RESULT and "
            "STREAM_END: METADATA alone)"
        )
    if timeout_ms:
        return RemoteProtocolError(f"{kind.name} header has a timeout; only CALL may")
    if call_id:
        return RemoteProtocolError(f"{kind.name} is connection-level but has call_id {call_id}")
    return RemoteProtocolError(f"{kind.name} with call_id 0")


def _call_header(view: memoryview, size: int, flags: int, call_id: int, timeout_ms: int) -> Header:
    """The CALL header in ``view`` (``size`` bytes), with its flags, trace and method name."""
    if flags & ~_KNOWN_FLAGS:
        raise RemoteProtocolError(f"unknown flag bits 0x{flags & ~_KNOWN_FLAGS:x} in CALL")
    if call_id == 0:
        raise RemoteProtocolError("CALL with call_id 0")
    trace = b""
    if flags & _TRACE:
        size -= TRACE_CONTEXT_BYTES
        if size < HEADER_SIZE:
            raise RemoteProtocolError("CALL with the TRACE flag is too short for its context")
        trace = view[size:].tobytes()
        if trace[0] != 0:
            raise RemoteProtocolError(f"unknown trace context version {trace[0]}")
    start = HEADER_SIZE
    releases: tuple[int, ...] = ()
    if flags & _RELEASES:
        releases = _call_releases(view, size)
        start += 1 + 8 * len(releases)
    metadata = _NO_METADATA
    if flags & _METADATA:
        metadata, start = decode_block(view, start, size)
    return _make_header(
        MessageKind.CALL, call_id, _FLAGS_BY_VALUE[flags], timeout_ms,
        _method_name(view, start, size), trace, releases, metadata,
    )  # fmt: skip


def _method_name(view: memoryview, start: int, size: int) -> str:
    """The method name of a CALL header, from ``start`` to ``size``."""
    length = size - start
    if length <= 0:
        raise RemoteProtocolError("CALL without a method name")
    if length > MAX_METHOD_BYTES:
        raise RemoteProtocolError(
            f"method name is {length} bytes long; the limit is {MAX_METHOD_BYTES}"
        )
    raw = view[start:size].tobytes()
    name = _method_name_cache.get(raw)
    if name is None:
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RemoteProtocolError(f"method name {raw!r} is not valid UTF-8") from exc
        if len(_method_name_cache) < _CACHE_LIMIT:
            _method_name_cache[raw] = name
    return name


def _call_releases(view: memoryview, size: int) -> tuple[int, ...]:
    """The lease ids of a CALL header with ``RELEASES`` (``size``: its end, before any
    trace context)."""
    if size <= HEADER_SIZE:
        raise RemoteProtocolError("CALL with the RELEASES flag has no lease count")
    count = view[HEADER_SIZE]
    if not 0 < count <= MAX_CALL_RELEASES:
        raise RemoteProtocolError(f"CALL carries {count} lease ids; 1..{MAX_CALL_RELEASES} allowed")
    if size < HEADER_SIZE + 1 + 8 * count:
        raise RemoteProtocolError(f"CALL header too short for its {count} lease ids")
    block = _RELEASE_BLOCKS[count].unpack_from(view, HEADER_SIZE)
    releases: tuple[int, ...] = block[1:]
    for lease in releases:
        if not 0 < lease <= _I64_MAX:
            raise RemoteProtocolError(f"lease id {lease} is out of range 1..{_I64_MAX}")
    return releases


def split_frames(
    frames: Sequence[Buffer], *, max_buffers: int = MAX_BUFFERS
) -> tuple[Header, Buffer, Sequence[Buffer]]:
    """Split one message into its header, payload and buffer frames, checking the layout.

    The layout per kind: CALL, RESULT and STREAM_ITEM are ``[header, payload, *buffers]``
    with a non-empty payload and at most ``max_buffers`` buffers; every other kind is
    exactly ``[header, payload]``, and for CANCEL, STREAM_END, PING and PONG the payload is
    empty. Nothing is copied: the payload and buffers are the frames themselves.

    Args:
        frames: The frames of one message, without the routing id.
        max_buffers: Most buffer frames accepted after the payload.

    Returns:
        ``(header, payload, buffers)``.

    Raises:
        RemoteProtocolError: The header is invalid or the frame layout does not fit the kind.
    """
    count = len(frames)
    if count < 2:
        raise RemoteProtocolError(f"a message has at least 2 frames (header, payload); got {count}")
    header = unpack_header(frames[0])
    kind = header.kind
    payload = frames[1]
    if kind in _VALUE_KINDS:
        if count - 2 > max_buffers:
            raise RemoteProtocolError(
                f"{kind.name} has {count - 2} buffer frames; the limit is {max_buffers}"
            )
        if _nbytes(payload) == 0:
            raise RemoteProtocolError(f"{kind.name} with an empty payload")
        return header, payload, frames[2:]
    if count != 2:
        raise RemoteProtocolError(
            f"{kind.name} must have exactly 2 frames (header, payload); got {count}"
        )
    if kind in _EMPTY_KINDS and _nbytes(payload) != 0:
        raise RemoteProtocolError(f"{kind.name} must have an empty payload")
    return header, payload, ()


def _nbytes(frame: Buffer) -> int:
    try:
        return memoryview(frame).nbytes
    except TypeError as exc:
        raise RemoteProtocolError(f"frame is not a buffer: {type(frame).__name__}") from exc


# -- object budget -------------------------------------------------------------------------


def _scan_tables() -> tuple[bytes, bytes, dict[int, tuple[int, int, int]], bytes]:
    # fixed[b]: the whole size of an object starting with byte b whose size the byte
    # alone tells (0: variable or invalid); kids[b]: the elements a fix container holds.
    fixed = bytearray(256)
    kids = bytearray(256)
    for b in range(0x80):  # positive fixint
        fixed[b] = 1
    for b in range(0x80, 0x90):  # fixmap
        fixed[b], kids[b] = 1, 2 * (b & 0x0F)
    for b in range(0x90, 0xA0):  # fixarray
        fixed[b], kids[b] = 1, b & 0x0F
    for b in range(0xA0, 0xC0):  # fixstr
        fixed[b] = 1 + (b & 0x1F)
    for b in range(0xE0, 0x100):  # negative fixint
        fixed[b] = 1
    sizes = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
    sizes |= {0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10}
    sizes |= {0xD8: 18}
    for b, size in sizes.items():
        fixed[b] = size
    # variable: byte -> (length bytes, bytes between length and data, 0 blob/1 array/2 map)
    variable = {0xC4: (1, 0, 0), 0xC5: (2, 0, 0), 0xC6: (4, 0, 0)}  # bin
    variable |= {0xC7: (1, 1, 0), 0xC8: (2, 1, 0), 0xC9: (4, 1, 0)}  # ext
    variable |= {0xD9: (1, 0, 0), 0xDA: (2, 0, 0), 0xDB: (4, 0, 0)}  # str
    variable |= {0xDC: (2, 0, 1), 0xDD: (4, 0, 1), 0xDE: (2, 0, 2), 0xDF: (4, 0, 2)}
    # One-byte objects with no elements: a run of them is counted without a Python loop.
    single = bytes(b for b in range(256) if fixed[b] == 1 and kids[b] == 0)
    return bytes(fixed), bytes(kids), variable, single


_FIXED, _KIDS, _VARIABLE, _SINGLE_BYTE = _scan_tables()
_RUN_MIN: Final = 16


def count_msgpack_objects(data: Buffer, budget: int) -> int:
    """Count the msgpack objects of the first document in ``data``, stopping past ``budget``.

    Every value counts one: each scalar, string, binary, ext, array and map, and each map
    key. The scan reads headers only (strings, binaries and exts are skipped by their
    length), so it costs at most ``budget`` steps whatever ``data`` holds, and runs of
    one-byte objects or of same-typed fixed-size scalars (a list of floats) are counted in
    one step. It never fails: truncated or invalid input is counted as far as it goes and
    left to the decoder to report.

    Args:
        data: A msgpack document (trailing bytes are ignored).
        budget: The most objects the caller accepts.

    Returns:
        The number of objects, or ``budget + 1`` as soon as there are more than ``budget``.
    """
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    fixed, kids, variable = _FIXED, _KIDS, _VARIABLE
    end = view.nbytes
    pos = 0
    pending = 1  # objects still to read
    count = 0
    while pending:
        if pos >= end:
            return count  # truncated: the decoder reports it
        byte = view[pos]
        size = fixed[byte]
        count += 1
        if count > budget:
            return budget + 1
        pending -= 1
        if size:
            pos += size
            pending += kids[byte]
            if count + pending > budget:
                return budget + 1
            continue
        spec = variable.get(byte)
        if spec is None:
            return count  # 0xc1 (never used): the decoder reports it
        width, gap, what = spec
        length = int.from_bytes(view[pos + 1 : pos + 1 + width], "big")
        pos += 1 + width
        if what == 0:
            pos += gap + length
            continue
        pending += length if what == 1 else 2 * length
        if count + pending > budget:
            return budget + 1  # each element still to read is one object at least
        if what == 1 and length >= _RUN_MIN and pos < end:
            skip = _run_bytes(view, pos, length)
            if skip:  # count + pending stays within the budget checked above
                count += length
                pending -= length
                pos += skip
    return count


# fixstr headers give a size but a run of them need not share one: only scalars whose
# size the type byte fixes (ints, floats, fixext) may be counted by stride.
_NO_RUN: Final = frozenset(range(0xA0, 0xC0))


def _run_bytes(view: memoryview, pos: int, length: int) -> int:
    """The bytes of the ``length`` array elements at ``pos`` when they can be counted in
    one step, else 0.

    They can when all are one-byte objects, or all the same fixed-size scalar
    (0xcb float64, ...).
    """
    first = view[pos]
    step = _FIXED[first]
    if step == 0 or _KIDS[first]:
        return 0
    if step == 1:
        run = view[pos : pos + length].tobytes()
        same = len(run) == length and not run.translate(None, _SINGLE_BYTE)
    elif first in _NO_RUN:
        return 0
    else:
        heads = view[pos : pos + step * length : step].tobytes()
        same = len(heads) == length and heads.count(first) == length
    return step * length if same else 0


# -- control bodies ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """HELLO body: what an engine says about itself when it joins a client."""

    #: The engine's id, unique among the client's live engines.
    engine_id: str
    #: Service name.
    service: str
    #: Schema fingerprint of the service (hex).
    fingerprint: str
    #: Protocol version the engine speaks.
    protocol_version: int
    #: Identifies the host (a hint for logs and tools; torch_shm goes by what the kernel
    #: says about the connection, not by this).
    host_id: str
    #: The engine's process id, as it claims (a hint; see ``host_id``).
    pid: int
    #: Tensor transports the engine can receive, by name.
    transports: tuple[str, ...] = ()
    #: How many calls the engine runs at once.
    concurrency: int = 1
    #: Interval at which the engine sends PINGs, in milliseconds.
    heartbeat_ms: int = 1000
    #: The service's method names.
    methods: tuple[str, ...] = ()
    #: The names of the methods that stream.
    streaming: tuple[str, ...] = ()
    #: One human-readable signature per entry of ``methods``, in the same order
    #: (``"add(a: int, b: int = 1) -> int"``), for tools.
    signatures: tuple[str, ...] = ()
    #: The largest message frame the engine accepts, in bytes (its ``maxmsgsize``); 0:
    #: no limit. A client refuses to send a frame over it rather than have the engine's
    #: ZMQ drop the connection.
    max_message_bytes: int = 0
    #: The engine's session epoch with this client: a random u64 (1..2**64-1) drawn per
    #: session (the engine fills it in). A HELLO repeating the epoch belongs to the same
    #: session; a new epoch from a known engine id means the engine lost the session and
    #: every call in flight on it.
    epoch: int = 1
    #: How long the engine waits, in milliseconds, without a message from the client
    #: before it declares the client dead (1..2**32-1). The client PINGs often enough.
    dead_after_ms: int = 5000
    #: Compression codecs the engine can decode (empty: none): ``"zstd"``.
    compression: tuple[str, ...] = ()
    #: The names of the methods whose request is a stream (client streaming, and
    #: bidirectional when also in ``streaming``).
    request_streaming: tuple[str, ...] = ()
    #: Request stream items a client may send per stream before it needs the engine's
    #: CREDIT.
    stream_window: int = 16
    #: A listening engine's bulk endpoint (docs/design.md): the client may dial it and
    #: bind it to this session with ``bulk_token``; "" when there is none.
    bulk: str = ""
    #: This session's bulk token (hex, 128 bits, usable once); "" without ``bulk``.
    bulk_token: str = ""


@dataclass(frozen=True, slots=True)
class Welcome:
    """WELCOME body: the client accepts an engine's HELLO."""

    #: The client's id (its routing identity, as text).
    client_id: str
    #: Identifies the client's host.
    host_id: str
    #: Tensor transports the client can receive, by name.
    transports: tuple[str, ...] = ()
    #: Interval at which the client sends PINGs, in milliseconds.
    heartbeat_ms: int = 1000
    #: Stream items an engine may send per stream before it needs CREDIT.
    stream_window: int = 16
    #: The client's process id, as it claims: a hint, used only by an engine configured
    #: to trust unattested peers over tcp.
    pid: int = 0
    #: The largest message frame the client accepts, in bytes (its ``maxmsgsize``); 0:
    #: no limit. An engine refuses to send a result frame over it (``BAD_RESULT``).
    max_message_bytes: int = 0
    #: The client's session epoch with this engine: a random u64 (1..2**64-1) drawn per
    #: session (the client fills it in). An engine that sees a WELCOME with a new epoch
    #: from a client it has a session with knows the client lost that session.
    epoch: int = 1
    #: How long the client waits, in milliseconds, without a message from the engine
    #: before it declares the engine dead (1..2**32-1). The engine PINGs often enough.
    dead_after_ms: int = 5000
    #: The client's schema fingerprint, so that an engine can refuse a mismatch too;
    #: "" for a schema-less client (it admits any schema).
    fingerprint: str = ""
    #: Compression codecs the client can decode (empty: none): ``"zstd"``.
    compression: tuple[str, ...] = ()
    #: A listening client's bulk endpoint (docs/design.md): the engine that dialed in
    #: may dial it and bind it to this session with ``bulk_token``; "" when none.
    bulk: str = ""
    #: This session's bulk token (hex, 128 bits, usable once); "" without ``bulk``.
    bulk_token: str = ""


@dataclass(frozen=True, slots=True)
class Attach:
    """ATTACH body: bind a bulk connection to a session (docs/design.md)."""

    #: The listener's session epoch (its HELLO's or WELCOME's ``epoch``).
    epoch: int
    #: The session's bulk token (hex) from that handshake; "" in the listener's answer.
    token: str = ""


@dataclass(frozen=True, slots=True)
class Reject:
    """REJECT body: the handshake is refused."""

    #: One of `RejectReason`'s codes (unknown codes are accepted and kept).
    reason: str
    #: Human-readable explanation naming what differs.
    message: str = ""


@dataclass(frozen=True, slots=True)
class Bye:
    """BYE body: the sender is leaving."""

    #: Why, for logs ("shutdown", "closed", ...).
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Credit:
    """CREDIT body: the stream's consumer took ``n`` more items."""

    #: Number of further items the engine may send (1..2**32-1).
    n: int


@dataclass(frozen=True, slots=True)
class Release:
    """RELEASE body: the client attached to the tensors sent under these leases."""

    #: Lease ids (from the engine's ``torch_shm`` handles), 1..2**63-1 each.
    leases: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """ERROR body: why a call (or, with call_id 0, the connection) failed."""

    #: An [`ErrorCode`][tensorrpc.ErrorCode] value (unknown codes are kept as plain ints).
    code: int
    #: Qualified name of the remote exception type ("" when not applicable).
    type: str = ""
    #: Human-readable message.
    message: str = ""
    #: Formatted remote traceback text ("" when none).
    traceback: str = field(default="", repr=False)
    #: Where the refused value sits (INVALID_ARGUMENT, BAD_RESULT): the parameter or
    #: ``"result"`` first, then field names and indexes, ``("req", "items", 3, "x")``;
    #: empty when the error names no value.
    path: tuple[str | int, ...] = ()

    def to_exception(self) -> TensorRPCError:
        """Build the local exception this error stands for (see ``error_from_wire``)."""
        return error_from_wire(self.code, self.type, self.message, self.traceback, self.path)


#: Any control-message body.
ControlBody: TypeAlias = Hello | Welcome | Reject | Bye | Credit | ErrorInfo | Release | Attach

# Field schema per body class: (name, kind, limit). kind: "str" | "name" | "int" | "strs" |
# "names" | "ints". A "name" is a "str" without control characters (_text.CONTROL):
# ids, reasons and type names are refused with one, so no log line or terminal gets it raw.
_Field: TypeAlias = tuple[str, str, int]
_SCHEMAS: Final[dict[type[Any], tuple[_Field, ...]]] = {
    Hello: (
        ("engine_id", "name", MAX_NAME_CHARS),
        ("service", "name", MAX_NAME_CHARS),
        ("fingerprint", "name", MAX_NAME_CHARS),
        ("protocol_version", "int", 255),
        ("host_id", "name", MAX_NAME_CHARS),
        ("pid", "int", _I64_MAX),
        ("transports", "names", MAX_NAME_CHARS),
        ("concurrency", "int", _U32_MAX),
        ("heartbeat_ms", "int", _U32_MAX),
        ("methods", "names", MAX_METHOD_BYTES),
        ("streaming", "names", MAX_METHOD_BYTES),
        ("signatures", "names", MAX_SIGNATURE_CHARS),
        ("max_message_bytes", "int", _I64_MAX),
        ("epoch", "int", _U64_MAX),
        ("dead_after_ms", "int", _U32_MAX),
        ("compression", "names", MAX_NAME_CHARS),
        ("request_streaming", "names", MAX_METHOD_BYTES),
        ("stream_window", "int", _U32_MAX),
        ("bulk", "name", MAX_NAME_CHARS),
        ("bulk_token", "name", 64),
    ),
    Welcome: (
        ("client_id", "name", MAX_NAME_CHARS),
        ("host_id", "name", MAX_NAME_CHARS),
        ("transports", "names", MAX_NAME_CHARS),
        ("heartbeat_ms", "int", _U32_MAX),
        ("stream_window", "int", _U32_MAX),
        ("pid", "int", _I64_MAX),
        ("max_message_bytes", "int", _I64_MAX),
        ("epoch", "int", _U64_MAX),
        ("dead_after_ms", "int", _U32_MAX),
        ("fingerprint", "name", MAX_NAME_CHARS),
        ("compression", "names", MAX_NAME_CHARS),
        ("bulk", "name", MAX_NAME_CHARS),
        ("bulk_token", "name", 64),
    ),
    Attach: (("epoch", "int", _U64_MAX), ("token", "name", 64)),
    Reject: (("reason", "name", MAX_NAME_CHARS), ("message", "str", MAX_TEXT_CHARS)),
    Bye: (("reason", "name", MAX_NAME_CHARS),),
    Credit: (("n", "int", _U32_MAX),),
    Release: (("leases", "ints", _I64_MAX),),
    ErrorInfo: (
        ("code", "int", _U16_MAX),
        ("type", "name", MAX_NAME_CHARS),
        ("message", "str", MAX_TEXT_CHARS),
        ("traceback", "str", MAX_TRACEBACK_CHARS),
        ("path", "path", MAX_NAME_CHARS),
    ),
}
_BODY_BY_KIND: Final[dict[MessageKind, type[Any]]] = {
    MessageKind.HELLO: Hello,
    MessageKind.WELCOME: Welcome,
    MessageKind.REJECT: Reject,
    MessageKind.BYE: Bye,
    MessageKind.CREDIT: Credit,
    MessageKind.ERROR: ErrorInfo,
    MessageKind.RELEASE: Release,
    MessageKind.ATTACH: Attach,
}
# CREDIT of 0 items means nothing; epoch 0 and a dead-after bound of 0 name no session
# and no bound: all three are refused.
_MIN_INT: Final = {"n": 1, "epoch": 1, "dead_after_ms": 1}


_ErrorType: TypeAlias = type[TensorRPCError]


def _check_str(where: str, name: str, limit: int, value: object, error: _ErrorType) -> object:
    if type(value) is not str:
        raise error(f"{where} must be a string, not {type(value).__name__}")
    if len(value) > limit:
        raise error(f"{where} is {len(value)} characters long; the limit is {limit}")
    return value


def _check_name(where: str, name: str, limit: int, value: object, error: _ErrorType) -> object:
    _check_str(where, name, limit, value, error)
    bad = CONTROL.search(str(value))
    if bad is not None:
        raise error(f"{where} has a control character (U+{ord(bad.group()):04X}) at {bad.start()}")
    return value


def _check_int_field(where: str, name: str, limit: int, value: object, error: _ErrorType) -> object:
    if type(value) is not int and not isinstance(value, IntEnum):
        raise error(f"{where} must be an integer, not {type(value).__name__}")
    low = _MIN_INT.get(name, 0)
    if not low <= value <= limit:
        raise error(f"{where}={value} is out of range {low}..{limit}")
    return int(value)


def _check_ints(where: str, name: str, limit: int, value: object, error: _ErrorType) -> object:
    if not isinstance(value, list | tuple):
        raise error(f"{where} must be a list of integers, not {type(value).__name__}")
    if not 0 < len(value) <= MAX_LIST_ITEMS:
        raise error(f"{where} has {len(value)} entries; expected 1..{MAX_LIST_ITEMS}")
    for i, item in enumerate(value):
        if type(item) is not int or not 0 < item <= limit:
            raise error(f"{where}[{i}] must be an integer in 1..{limit}, not {item!r}")
    return tuple(value)


def _check_strs(where: str, name: str, limit: int, value: object, error: _ErrorType) -> object:
    if not isinstance(value, list | tuple):
        raise error(f"{where} must be a list of strings, not {type(value).__name__}")
    if len(value) > MAX_LIST_ITEMS:
        raise error(f"{where} has {len(value)} entries; the limit is {MAX_LIST_ITEMS}")
    for i, item in enumerate(value):
        if type(item) is not str:
            raise error(f"{where}[{i}] must be a string, not {type(item).__name__}")
        if len(item) > limit:
            raise error(f"{where}[{i}] is {len(item)} characters long; the limit is {limit}")
    return tuple(value)


def _check_path(where: str, name: str, limit: int, value: object, error: _ErrorType) -> object:
    if not isinstance(value, list | tuple):
        raise error(f"{where} must be a list, not {type(value).__name__}")
    if len(value) > MAX_PATH_PARTS:
        raise error(f"{where} has {len(value)} entries; the limit is {MAX_PATH_PARTS}")
    for i, item in enumerate(value):
        if type(item) is int:
            if not 0 <= item <= _I64_MAX:
                raise error(f"{where}[{i}]={item} is out of range 0..{_I64_MAX}")
        elif type(item) is str:
            _check_name(f"{where}[{i}]", name, limit, item, error)
        else:
            raise error(f"{where}[{i}] must be a string or an integer, not {type(item).__name__}")
    return tuple(value)


def _check_names(where: str, name: str, limit: int, value: object, error: _ErrorType) -> object:
    items = _check_strs(where, name, limit, value, error)
    for i, item in enumerate(cast("tuple[str, ...]", items)):
        _check_name(f"{where}[{i}]", name, limit, item, error)
    return items


#: The check of each field type of the control bodies, by the name ``_FIELDS`` gives it.
_FIELD_CHECKS: Final[dict[str, Callable[[str, str, int, object, _ErrorType], object]]] = {
    "str": _check_str,
    "name": _check_name,
    "int": _check_int_field,
    "ints": _check_ints,
    "strs": _check_strs,
    "names": _check_names,
    "path": _check_path,
}


def _check_field(
    body: str, name: str, ftype: str, limit: int, value: object, error: type[TensorRPCError]
) -> object:
    return _FIELD_CHECKS[ftype](f"{body}.{name}", name, limit, value, error)


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = "\n... [truncated]"
    return text[: limit - len(marker)] + marker


def encode_control(kind: MessageKind, body: ControlBody | None, call_id: int = 0) -> list[bytes]:
    """Encode a control message (any kind but CALL, RESULT and STREAM_ITEM).

    Args:
        kind: The message kind.
        body: The body dataclass matching ``kind`` (`Hello` for HELLO, ...), or None
            for CANCEL, STREAM_END, PING and PONG.
        call_id: The call id for call-level kinds (CANCEL, STREAM_END, CREDIT, ERROR), the
            nonce for PING/PONG, 0 otherwise.

    Returns:
        ``[header, payload]``; the payload is a msgpack map, or empty.

    Raises:
        LocalProtocolError: The kind is a value-carrying kind, or the body does not match
            the kind, or a field has the wrong type or is over its limit.
    """
    if kind in _VALUE_KINDS:
        raise LocalProtocolError(f"{kind.name} carries a codec payload, not a control body")
    header = pack_reply_header(kind, call_id)
    if kind in _EMPTY_KINDS:
        if body is not None:
            raise LocalProtocolError(f"{kind.name} carries no body")
        return [header, b""]
    expected = _BODY_BY_KIND[kind]
    if type(body) is not expected:
        raise LocalProtocolError(
            f"{kind.name} needs a {expected.__name__} body, not {type(body).__name__}"
        )
    body_name = expected.__name__
    if isinstance(body, Hello):
        _check_hello_lists(body, LocalProtocolError)
    wire: dict[str, object] = {}
    for name, ftype, limit in _SCHEMAS[expected]:
        wire[name] = _check_field(
            body_name, name, ftype, limit, getattr(body, name), LocalProtocolError
        )
    try:
        payload = ormsgpack.packb(wire)
    except TypeError as exc:  # MsgpackEncodeError is TypeError in ormsgpack 1.13
        raise LocalProtocolError(f"cannot encode {body_name}: {exc}") from exc
    cap = MAX_BODY_BYTES[kind]
    if len(payload) > cap and isinstance(body, Hello) and body.signatures:
        payload = _cut_signatures(wire, body.signatures, cap)
    if len(payload) > cap:
        raise LocalProtocolError(
            f"{body_name} encodes to {len(payload)} bytes; the limit for {kind.name} is {cap}"
        )
    return [header, payload]


def _truncate_signature(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 4] + " ..."


def _cut_signatures(wire: dict[str, object], signatures: tuple[str, ...], cap: int) -> bytes:
    """A HELLO payload with its signatures cut (to 1024, 256, 64 characters, then empty)
    until it fits ``cap``: they are for tools, never checked, so cut rather than refuse."""
    payload = b""
    for chars in (1024, 256, 64, 0):
        wire["signatures"] = tuple(
            _truncate_signature(t, chars) if chars else "" for t in signatures
        )
        payload = ormsgpack.packb(wire)
        if len(payload) <= cap:
            break
    return payload


def encode_error(call_id: int, info: ErrorInfo) -> list[bytes]:
    """Encode an ERROR message, truncating over-long text instead of failing.

    An engine must always be able to report a failure, so ``message`` and ``traceback``
    are cut to their limits (ending with a ``[truncated]`` marker).

    Args:
        call_id: The failed call's id, or 0 for an error about the connection.
        info: What went wrong.

    Returns:
        ``[header, payload]``.

    Raises:
        LocalProtocolError: ``code`` or ``type`` is invalid.
    """
    if type(info.message) is str and type(info.traceback) is str:
        message = _truncate(info.message, MAX_TEXT_CHARS)
        traceback = _truncate(info.traceback, MAX_TRACEBACK_CHARS)
        if message is not info.message or traceback is not info.traceback:
            info = ErrorInfo(info.code, info.type, message, traceback, info.path)
    try:
        _check_path("ErrorInfo.path", "path", MAX_NAME_CHARS, info.path, LocalProtocolError)
    except LocalProtocolError:  # a key it cannot carry: the message still names it
        info = ErrorInfo(info.code, info.type, info.message, info.traceback, ())
    try:
        header = _pack(MAGIC, PROTOCOL_VERSION, MessageKind.ERROR, 0, 0, call_id, 0)
    except struct.error as exc:
        raise LocalProtocolError(f"call_id {call_id!r} is out of range") from exc
    wire: dict[str, object] = {}
    for name, ftype, limit in _SCHEMAS[ErrorInfo]:
        wire[name] = _check_field(
            "ErrorInfo", name, ftype, limit, getattr(info, name), LocalProtocolError
        )
    payload = ormsgpack.packb(wire)
    cap = MAX_BODY_BYTES[MessageKind.ERROR]
    while len(payload) > cap and wire["traceback"]:
        # Characters of up to 4 UTF-8 bytes: cut the traceback until the body fits.
        text = str(wire["traceback"])
        keep = len(text) - (len(payload) - cap) - 64
        wire["traceback"] = _truncate(text, keep) if keep > 64 else ""
        payload = ormsgpack.packb(wire)
    return [header, payload]


def _check_body_budget(kind: MessageKind, payload: Buffer, size: int) -> None:
    """Refuse a control body over its kind's size cap, not a map, or of too many objects."""
    cap = MAX_BODY_BYTES[kind]
    if size > cap:
        raise RemoteProtocolError(
            f"{kind.name} payload is {size} bytes; the limit for {kind.name} is {cap}"
        )
    view = memoryview(payload)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    first = view[0] if size else 0xC0
    if not (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)):
        raise RemoteProtocolError(f"{kind.name} payload must be a msgpack map")
    if size > MAX_CONTROL_OBJECTS and (
        count_msgpack_objects(view, MAX_CONTROL_OBJECTS) > MAX_CONTROL_OBJECTS
    ):
        raise RemoteProtocolError(
            f"{kind.name} payload holds more than {MAX_CONTROL_OBJECTS} msgpack objects (the limit)"
        )


def decode_control(header: Header, payload: Buffer) -> ControlBody | None:
    """Decode the body of a control message.

    Unknown map keys are ignored (so that later protocol revisions may add fields);
    missing keys, wrong types and over-long values are errors.

    Args:
        header: The message's header (from `unpack_header` or `split_frames`).
        payload: The payload frame.

    Returns:
        The body dataclass for HELLO, WELCOME, REJECT, BYE, CREDIT and ERROR; None for
        CANCEL, STREAM_END, PING and PONG (whose payload must be empty).

    Raises:
        RemoteProtocolError: The payload is not a valid body for the header's kind (also
            when the kind is CALL, RESULT or STREAM_ITEM, which carry codec payloads).
    """
    kind = header.kind
    size = _nbytes(payload)
    if kind in _EMPTY_KINDS:
        if size:
            raise RemoteProtocolError(f"{kind.name} must have an empty payload")
        return None
    cls = _BODY_BY_KIND.get(kind)
    if cls is None:
        raise RemoteProtocolError(f"{kind.name} carries a codec payload, not a control body")
    body_name = cls.__name__
    _check_body_budget(kind, payload, size)
    try:
        wire = ormsgpack.unpackb(memoryview(payload))
    except ValueError as exc:  # MsgpackDecodeError is ValueError in ormsgpack 1.13
        raise RemoteProtocolError(f"{kind.name} payload is not valid msgpack: {exc}") from exc
    except TypeError as exc:
        raise RemoteProtocolError(f"{kind.name} payload cannot be decoded: {exc}") from exc
    if type(wire) is not dict:
        raise RemoteProtocolError(
            f"{kind.name} payload must be a msgpack map, not {type(wire).__name__}"
        )
    values: list[object] = []
    for name, ftype, limit in _SCHEMAS[cls]:
        try:
            value = wire[name]
        except KeyError:
            raise RemoteProtocolError(f"{body_name} is missing the field {name!r}") from None
        values.append(_check_field(body_name, name, ftype, limit, value, RemoteProtocolError))
    body: ControlBody = cls(*values)
    if cls is Hello:
        _check_hello_lists(body, RemoteProtocolError)  # type: ignore[arg-type]
    return body


def _check_hello_lists(hello: Hello, error: _ErrorType) -> None:
    """One signature per method; only methods stream; a request window of at least 1."""
    if len(hello.signatures) != len(hello.methods):
        raise error(
            f"Hello.signatures has {len(hello.signatures)} entries for "
            f"{len(hello.methods)} methods; one per method is required"
        )
    for name in ("streaming", "request_streaming"):
        stray = set(getattr(hello, name)).difference(hello.methods)
        if stray:
            raise error(f"Hello.{name} names {len(stray)} entries that are not methods")
    if hello.stream_window < 1:  # no request item could ever go, nor credit come back
        raise error("Hello.stream_window must be at least 1")
