"""Call metadata, sans-I/O: the key/value strings a CALL carries and a reply returns.

Both travel in the header frame as one block (layout: docs/protocol.md §3; rules:
docs/context.md). What we are asked to send is checked before a byte is produced
(`MetadataError`); what a peer sent, as it is decoded (`RemoteProtocolError`), its strings
shown only through `tensorrpc._text.peer_text`. They stay hostile after that: whoever
logs them escapes them, and they never become metric labels.
"""

from __future__ import annotations

import re
import struct
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from tensorrpc._exceptions import MetadataError, RemoteProtocolError
from tensorrpc._text import CONTROL, peer_text

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "EMPTY",
    "KEY_PATTERN",
    "MAX_KEY_CHARS",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_ENTRIES",
    "MAX_VALUE_BYTES",
    "RESERVED_PREFIXES",
    "check_metadata",
    "decode_block",
    "encode_block",
    "merge_metadata",
]

#: Longest key, in characters (ASCII, so bytes too).
MAX_KEY_CHARS: Final = 64
#: Longest value, in UTF-8 bytes.
MAX_VALUE_BYTES: Final = 4096
#: Most keys per message.
MAX_METADATA_ENTRIES: Final = 64
#: Most bytes of entries (lengths, keys and values) per message.
MAX_METADATA_BYTES: Final = 8192
#: Key prefixes reserved for the protocol; version 1 defines no such key.
RESERVED_PREFIXES: Final = ("tensorrpc-",)
#: What a key looks like.
KEY_PATTERN: Final = re.compile(r"[a-z0-9][a-z0-9._-]*")
#: No metadata (shared, read-only).
EMPTY: Final[Mapping[str, str]] = MappingProxyType({})

_U16: Final = struct.Struct("<H")
_KEY_RULE: Final = (
    f"1..{MAX_KEY_CHARS} characters of a-z, 0-9, '-', '_' and '.', starting with a letter or digit"
)


def _key_fault(key: object) -> str | None:
    """What is wrong with a key (None: nothing)."""
    if type(key) is not str:
        return f"a key must be a str, not {type(key).__name__}"
    if not 0 < len(key) <= MAX_KEY_CHARS or KEY_PATTERN.fullmatch(key) is None:
        return f"key {peer_text(key, 80)!r} is not {_KEY_RULE}"
    for prefix in RESERVED_PREFIXES:
        if key.startswith(prefix):
            return f"key {key!r} starts with {prefix!r}, which is reserved for the protocol"
    return None


def _value_fault(key: str, value: object) -> str | None:
    if type(value) is not str:
        return f"the value of {key!r} must be a str, not {type(value).__name__}"
    if CONTROL.search(value) is not None:
        return f"the value of {key!r} holds a control character: {peer_text(value, 80)}"
    return None


def check_metadata(metadata: Mapping[str, str] | None, what: str = "metadata") -> dict[str, str]:
    """A validated copy of ``metadata`` we are asked to send.

    Args:
        metadata: Key → value; None for none.
        what: What the metadata is, for the error message.

    Returns:
        A new dict (empty for None).

    Raises:
        MetadataError: A key or value breaks a rule, or the whole is over a bound.
    """
    if metadata is None:
        return {}
    try:
        items = dict(metadata)
    except (TypeError, ValueError) as exc:
        raise MetadataError(f"{what} must be a mapping of str to str: {exc}") from None
    if len(items) > MAX_METADATA_ENTRIES:
        raise MetadataError(
            f"{what} has {len(items)} keys; at most {MAX_METADATA_ENTRIES} are allowed"
        )
    total = 0  # bytes on the wire: two lengths, the key and the value
    for key, value in items.items():
        fault = _key_fault(key) or _value_fault(key, value)
        if fault is not None:
            raise MetadataError(f"{what}: {fault}")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise MetadataError(f"{what}: the value of {key!r} is not valid UTF-8") from None
        if size > MAX_VALUE_BYTES:
            raise MetadataError(
                f"{what}: the value of {key!r} is {size} bytes; at most {MAX_VALUE_BYTES}"
            )
        total += 3 + len(key) + size
    if total > MAX_METADATA_BYTES:
        raise MetadataError(
            f"{what} takes {total} bytes on the wire; at most {MAX_METADATA_BYTES} are allowed"
        )
    return items


def merge_metadata(
    base: Mapping[str, str], more: Mapping[str, str] | None, what: str = "metadata"
) -> dict[str, str]:
    """``base`` (already checked) updated with ``more``, checked as a whole.

    Raises:
        MetadataError: As `check_metadata`.
    """
    extra = check_metadata(more, what)
    if not base:
        return extra
    merged = {**base, **extra}
    return check_metadata(merged, what) if extra else merged


def encode_block(metadata: Mapping[str, str]) -> bytes:
    """The header block of ``metadata`` (checked already: `check_metadata`); ``b""``
    for none, which sends no block and no ``METADATA`` flag."""
    if not metadata:
        return b""
    parts = []
    for key, value in metadata.items():
        raw = value.encode("utf-8")
        parts.append(bytes((len(key),)) + key.encode("ascii") + _U16.pack(len(raw)) + raw)
    entries = b"".join(parts)
    if len(metadata) > MAX_METADATA_ENTRIES or len(entries) > MAX_METADATA_BYTES:
        raise MetadataError(f"metadata over its bounds: {len(metadata)} keys, {len(entries)} bytes")
    return _U16.pack(len(entries)) + entries


def decode_block(view: memoryview, start: int, end: int) -> tuple[Mapping[str, str], int]:
    """Read the metadata block at ``view[start:]`` of a header frame ending at ``end``.

    Args:
        view: The header frame (bytes).
        start: Where the block starts (its size field).
        end: Where the block must end at the latest.

    Returns:
        The metadata (read-only) and the offset just after the block.

    Raises:
        RemoteProtocolError: The block breaks a rule of this module or does not fit.
    """
    if start + 2 > end:
        raise RemoteProtocolError("the METADATA flag is set but the header has no block")
    (size,) = _U16.unpack_from(view, start)
    pos = start + 2
    stop = pos + size
    if not 0 < size <= MAX_METADATA_BYTES or stop > end:
        raise RemoteProtocolError(
            f"metadata block of {size} bytes does not fit (1..{MAX_METADATA_BYTES}, "
            f"{end - pos} left in the header)"
        )
    raw = view[pos:stop].tobytes()
    pos = 0
    out: dict[str, str] = {}
    while pos < size:
        if len(out) >= MAX_METADATA_ENTRIES:
            raise RemoteProtocolError(f"metadata has more than {MAX_METADATA_ENTRIES} keys")
        klen = raw[pos]
        kend = pos + 1 + klen
        if kend + 2 > size:
            raise RemoteProtocolError("metadata entry runs past its block")
        try:
            key = raw[pos + 1 : kend].decode("ascii")
        except UnicodeDecodeError:
            raise RemoteProtocolError(
                f"metadata key {peer_text(raw[pos + 1 : kend], 80)} is not ASCII"
            ) from None
        fault = _key_fault(key)
        if fault is not None:
            raise RemoteProtocolError(f"metadata: {fault}")
        if key in out:
            raise RemoteProtocolError(f"metadata key {key!r} appears twice")
        (vlen,) = _U16.unpack_from(raw, kend)
        vstart = kend + 2
        pos = vstart + vlen
        if vlen > MAX_VALUE_BYTES or pos > size:
            raise RemoteProtocolError(
                f"metadata value of {key!r} is {vlen} bytes (at most {MAX_VALUE_BYTES}, "
                "inside its block)"
            )
        try:
            value = raw[vstart:pos].decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError(f"metadata value of {key!r} is not valid UTF-8") from None
        fault = _value_fault(key, value)
        if fault is not None:
            raise RemoteProtocolError(f"metadata: {fault}")
        out[key] = value
    return MappingProxyType(out), stop
