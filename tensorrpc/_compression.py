"""Compression of payloads and tensor frames across hosts (sans-I/O; optional ``zstandard``).

The codec calls these: a sender compresses a payload or a tensor frame of at least
``Compression.min_bytes`` when the peer said in its handshake that it decodes the codec
and the result saves enough; a receiver decompresses it into exactly the size the frame
declares, which must be the tensor's size (or within the payload limit), so that a frame
that would expand further (a decompression bomb) is refused before anything beyond that
size is allocated. ``zstandard`` is imported on first use, never by ``import tensorrpc``;
without it a peer announces no codec and nothing is compressed. docs/protocol.md (§5, §6)
is the wire specification; docs/compression.md the guide.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from tensorrpc._exceptions import DecompressionError, EncodeError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "OFF_LOOP_BYTES",
    "ZSTD",
    "Compression",
    "available",
    "compress",
    "content_size",
    "declared_size",
    "decompress_exact",
    "resolve",
]

#: The one codec: Zstandard frames (RFC 8878) with their content size in the header.
ZSTD: Final = "zstd"
#: A compressed frame is sent only when it saves at least this fraction of the bytes;
#: otherwise the receiver would pay the decompression for nothing.
_MIN_SAVING: Final = 1 / 16
#: Payloads and frames from this many bytes (uncompressed) are compressed and
#: decompressed on a worker thread, not on the event loop: below it the thread hop costs
#: about as much as decompressing (docs/compression.md has the measurement).
OFF_LOOP_BYTES: Final = 128 * 1024
#: The first bytes of every zstd frame (RFC 8878, 3.1.1).
_MAGIC: Final = b"\x28\xb5\x2f\xfd"
#: zstd's own level bounds (negative levels are its fast modes).
_LEVELS: Final = range(-7, 23)

_zstd: Any = None


@dataclass(frozen=True, slots=True)
class Compression:
    """How a call compresses its arguments and asks for compressed results.

    Pass it (or just ``"zstd"``) as ``compression=`` to `Client.with_options` or
    `Client.stub`. Only payloads and tensor frames of at least ``min_bytes`` are
    compressed, only to a peer that can decode the codec (it says so in its handshake),
    only when it saves at least 1/16 of the bytes, and never what travels by
    ``torch_shm`` (a call whose tensors may go by shared memory is not compressed). Needs
    the ``compression`` extra (``pip install 'tensorrpc[compression]'``).

    Attributes:
        codec: The codec; ``"zstd"`` is the only one.
        level: zstd's level (-7..22; 1-3 suit a network, higher levels cost far more CPU).
        min_bytes: Payloads and tensors below this many bytes are sent as they are.
    """

    codec: Literal["zstd"] = ZSTD
    level: int = 1
    min_bytes: int = 16384

    def __post_init__(self) -> None:
        if self.codec != ZSTD:
            raise ValueError(f"unknown compression codec {self.codec!r}; the codec is 'zstd'")
        if type(self.level) is not int or self.level not in _LEVELS:
            raise ValueError(f"zstd level must be an int in -7..22, not {self.level!r}")
        if type(self.min_bytes) is not int or self.min_bytes < 1:
            raise ValueError(f"min_bytes must be a positive int, not {self.min_bytes!r}")


def resolve(value: Compression | str | None) -> Compression | None:
    """``compression=`` as given to a view or stub: a `Compression`, ``"zstd"`` or None.

    Raises:
        ValueError: Another codec name or value.
        ImportError: Compression is asked for and ``zstandard`` is not installed.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = Compression(codec=value)  # type: ignore[arg-type]  # checked by __post_init__
    if not isinstance(value, Compression):
        raise ValueError(f"compression must be 'zstd', a Compression or None, not {value!r}")
    if not available():
        raise ImportError(
            "compression needs the zstandard package: pip install 'tensorrpc[compression]'"
        )
    return value


def available() -> tuple[str, ...]:
    """The codecs this process can decode (announced in HELLO and WELCOME), without
    importing them."""
    if _zstd is not None or importlib.util.find_spec("zstandard") is not None:
        return (ZSTD,)
    return ()


def _module() -> Any:
    global _zstd
    if _zstd is None:
        import zstandard

        _zstd = zstandard
    return _zstd


def compress(data: Buffer, compression: Compression) -> bytes | None:
    """``data`` as one zstd frame (content size in its header), or None when compressing
    saves less than 1/16 of its bytes.

    Raises:
        EncodeError: zstd failed.
    """
    zstd = _module()
    view = memoryview(data)
    try:
        out: bytes = zstd.ZstdCompressor(level=compression.level).compress(view)
    except zstd.ZstdError as exc:
        raise EncodeError(f"zstd could not compress {view.nbytes} bytes: {exc}") from exc
    if len(out) > view.nbytes * (1 - _MIN_SAVING):
        return None
    return out


def content_size(data: Buffer) -> int:
    """The decompressed size ``data`` declares if it looks like a zstd frame, else 0
    (unchecked: `declared_size` checks it where it counts)."""
    view = memoryview(data)
    if view.nbytes < 6 or view.ndim != 1 or view.itemsize != 1 or view[:4].tobytes() != _MAGIC:
        return 0
    try:
        size: int = _module().frame_content_size(view)
    except Exception:  # no zstandard, a malformed header: decode says what is wrong
        return 0
    return max(size, 0)


def declared_size(data: Buffer, limit: int) -> int:
    """The decompressed size a zstd frame declares, checked against ``limit``.

    Raises:
        DecompressionError: Not a zstd frame, no declared size, or over ``limit``.
    """
    try:
        zstd = _module()
    except ImportError:
        raise DecompressionError(
            "a compressed frame came, but zstandard is not installed here"
        ) from None
    try:
        size: int = zstd.frame_content_size(data)
    except zstd.ZstdError:
        raise DecompressionError("a compressed frame is not a zstd frame") from None
    if size < 0:
        raise DecompressionError("a compressed frame must declare its decompressed size")
    if size > limit:
        raise DecompressionError(
            f"a compressed frame declares {size} bytes, over the limit of {limit}"
        )
    return size


def decompress_exact(data: Buffer, size: int) -> bytearray:
    """Decompress one zstd frame that must declare, and expand to, exactly ``size`` bytes.

    The output buffer is allocated once, at ``size``: a frame that would expand beyond
    it, declares another size, carries anything after its end, or is corrupt is refused.

    Raises:
        DecompressionError: Any of those.
    """
    if declared_size(data, size) != size:
        raise DecompressionError(
            f"a compressed frame declares {declared_size(data, 1 << 62)} bytes; "
            f"its tensor has {size}"
        )
    zstd = _module()
    out = bytearray(size)
    filled = 0
    try:
        with zstd.ZstdDecompressor().stream_reader(data) as reader:
            view = memoryview(out)
            while filled < size:
                n = reader.readinto(view[filled:])
                if not n:
                    break
                filled += n
            more = reader.read(1)  # past the declared size, or bytes after the frame
    except zstd.ZstdError as exc:
        raise DecompressionError(f"a compressed frame is corrupt: {exc}") from None
    if filled != size or more:
        raise DecompressionError(
            f"a compressed frame does not expand to the {size} bytes it declares"
        )
    return out
