"""Compression of payloads and tensor frames in the codec (no sockets), bombs included."""

from __future__ import annotations

import numpy as np
import ormsgpack
import pytest
import torch

from tensorrpc import _codec, _compression
from tensorrpc._codec import CodecConfig, ExtCode, Location
from tensorrpc._compression import Compression
from tensorrpc._exceptions import DecodeError, DecompressionError, RemoteProtocolError
from tensorrpc._protocol import (
    Flags,
    Hello,
    MessageKind,
    Welcome,
    decode_control,
    encode_control,
    split_frames,
)

from .server_helpers import Engine

zstandard = pytest.importorskip("zstandard")

ZSTD = Compression()


def activations() -> torch.Tensor:
    """ReLU'd float32 activations: about half zeros, the rest noise (partly compressible)."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))
    return torch.relu(x)


def token_ids() -> torch.Tensor:
    return torch.randint(0, 50_000, (16_384,), generator=torch.Generator().manual_seed(2))


def decode(encoded: _codec.Encoded, config: CodecConfig = _codec.DEFAULT) -> object:
    return _codec.decode(encoded.payload, [bytearray(b) for b in encoded.buffers], config)


def test_tensor_frames_and_payloads_round_trip_smaller() -> None:
    x, ids = activations(), token_ids()
    array = ids.numpy().astype(np.int32)
    value = {"x": x, "ids": ids, "array": array, "text": "token " * 8000}
    plain = _codec.encode(value)
    packed = _codec.encode(value, compression=ZSTD)
    assert len(packed.buffers) == len(plain.buffers) == 3
    for small, big in zip(packed.buffers, plain.buffers, strict=True):
        assert small.nbytes < big.nbytes * 0.9
    assert len(packed.payload) < len(plain.payload) / 10
    out = decode(packed)
    assert isinstance(out, dict)
    assert torch.equal(out["x"], x)
    assert torch.equal(out["ids"], ids)
    assert isinstance(out["array"], np.ndarray)
    assert np.array_equal(out["array"], array)
    assert out["text"] == value["text"]
    out["x"].add_(1)  # built on writable memory of its own


def test_what_does_not_pay_or_is_small_or_may_go_by_shm_is_sent_as_it_is() -> None:
    noise = torch.randint(-(2**31), 2**31 - 1, (65_536,), dtype=torch.int32)
    small = torch.zeros(1000)
    encoded = _codec.encode([noise, small, "x" * 100], compression=ZSTD)
    assert [b.nbytes for b in encoded.buffers] == [noise.nbytes, small.nbytes]
    assert encoded.payload == _codec.encode([noise, small, "x" * 100]).payload

    class Shm:
        """Takes the first tensor by handle, leaves the others to frames."""

        def __init__(self) -> None:
            self.taken = 0

        def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
            self.taken += 1
            return ("test_shm", b"h") if self.taken == 1 else None

    zeros = torch.zeros(1 << 16)
    shm = _codec.encode([zeros, zeros], placer=Shm(), compression=ZSTD)
    first, second = ormsgpack.unpackb(shm.payload, ext_hook=lambda code, data: data)
    assert ormsgpack.unpackb(first)[2:] == [int(Location.HANDLE), ["test_shm", b"h"]]
    assert ormsgpack.unpackb(second)[2:] == [int(Location.ZSTD_FRAME), 0]
    assert shm.buffers[0].nbytes < zeros.nbytes / 100


def test_compression_options_are_checked() -> None:
    assert _compression.resolve("zstd") == Compression()
    assert _compression.resolve(None) is None
    for bad in ("gzip", 3):
        with pytest.raises(ValueError, match=r"compression|codec"):
            _compression.resolve(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="level"):
        Compression(level=99)
    with pytest.raises(ValueError, match="min_bytes"):
        Compression(min_bytes=0)


def _frame_with_size(data: bytes, declared: int) -> bytes:
    """A zstd frame of ``data`` whose header claims ``declared`` bytes (a lie)."""
    frame: bytes = zstandard.ZstdCompressor(level=1).compress(data)
    fhd = frame[4]  # RFC 8878 frame header descriptor
    assert fhd >> 6 == 2  # a 4-byte content size
    assert fhd & 3 == 0  # no dictionary id
    at = 5 if (fhd >> 5) & 1 else 6  # after the window descriptor, if any
    return frame[:at] + declared.to_bytes(4, "little") + frame[at + 4 :]


def _tensor_message(nbytes_declared_by_shape: int, frame: bytes) -> tuple[bytes, list[bytes]]:
    desc = ormsgpack.packb(["uint8", [nbytes_declared_by_shape], int(Location.ZSTD_FRAME), 0])
    return ormsgpack.packb(ormsgpack.Ext(int(ExtCode.TORCH), desc)), [frame]


@pytest.mark.parametrize(
    ("shape_bytes", "frame", "fault"),
    [
        # a frame that claims the tensor's size but expands to 1 MiB: refused while
        # decompressing into the tensor's 4 KiB, never allocated
        (4096, _frame_with_size(bytes(1 << 20), 4096), "corrupt|expand"),
        # a frame that says it expands beyond the tensor: refused before anything
        (4096, zstandard.ZstdCompressor().compress(bytes(1 << 20)), "declares 1048576"),
        # no declared size: refused, however small
        (4096, zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4096)), "declare"),
        # bytes after the frame, or a second frame
        (4096, zstandard.ZstdCompressor().compress(bytes(4096)) + b"junk", "corrupt|expand"),
        (
            4096,
            zstandard.ZstdCompressor().compress(bytes(4096)) * 2,
            "corrupt|expand",
        ),
        (4096, b"not zstd at all", "not a zstd frame"),
    ],
)
def test_bad_or_bomb_tensor_frames_are_refused(shape_bytes: int, frame: bytes, fault: str) -> None:
    payload, buffers = _tensor_message(shape_bytes, frame)
    with pytest.raises(DecompressionError, match=fault) as info:
        _codec.decode(payload, buffers)
    assert isinstance(info.value, DecodeError)


def test_a_payload_that_expands_beyond_the_payload_limit_is_refused() -> None:
    small = CodecConfig(max_payload_bytes=1 << 20)
    inner = ormsgpack.packb("x" * (2 << 20))
    bomb = ormsgpack.packb(ormsgpack.Ext(int(ExtCode.ZSTD), zstandard.compress(inner)))
    assert len(bomb) < 1000
    with pytest.raises(DecompressionError, match="over the limit"):
        _codec.decode(bomb, (), small)
    liar = _frame_with_size(inner, 1000)
    with pytest.raises(DecompressionError):
        _codec.decode(ormsgpack.packb(ormsgpack.Ext(int(ExtCode.ZSTD), liar)), (), small)
    # within the limit it decodes, and the limits apply to what it expands to
    assert _codec.decode(bomb) == "x" * (2 << 20)


def test_a_compressed_payload_is_one_ext_at_the_top_only() -> None:
    inner = zstandard.compress(ormsgpack.packb([1, 2]))
    nested = ormsgpack.packb([ormsgpack.Ext(int(ExtCode.ZSTD), inner)])
    with pytest.raises(DecodeError, match="ext code 3"):
        _codec.decode(nested)
    whole = ormsgpack.packb(ormsgpack.Ext(int(ExtCode.ZSTD), inner))
    assert _codec.decode(whole) == [1, 2]
    with pytest.raises(DecodeError, match="nothing after it"):
        _codec.decode(whole[:-1])


def test_a_compressed_payload_still_counts_its_objects() -> None:
    config = CodecConfig(max_payload_objects=1000)
    inner = ormsgpack.packb([[]] * 5000)
    packed = ormsgpack.packb(ormsgpack.Ext(int(ExtCode.ZSTD), zstandard.compress(inner)))
    with pytest.raises(DecodeError, match="max_payload_objects"):
        _codec.decode(packed, (), config)


def test_without_zstandard_nothing_is_announced_and_frames_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frame = zstandard.ZstdCompressor().compress(bytes(4096))
    monkeypatch.setattr(_compression, "_zstd", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)
    assert _compression.available() == ()
    with pytest.raises(ImportError, match=r"tensorrpc\[compression\]"):
        _compression.resolve("zstd")
    payload, buffers = _tensor_message(4096, frame)
    with pytest.raises(DecompressionError, match="not installed"):
        _codec.decode(payload, buffers)


def test_the_handshake_says_what_each_side_decodes() -> None:
    hello = Hello("e1", "S", "f", 1, "h", 1, compression=("zstd",))
    header, payload, _ = split_frames(encode_control(MessageKind.HELLO, hello))
    assert decode_control(header, payload) == hello
    welcome = Welcome("c", "h", compression=("zstd",))
    header, payload, _ = split_frames(encode_control(MessageKind.WELCOME, welcome))
    assert decode_control(header, payload) == welcome
    bare = ormsgpack.packb({"client_id": "c", "host_id": "h", "transports": [],
                            "heartbeat_ms": 1, "stream_window": 1})  # fmt: skip
    with pytest.raises(RemoteProtocolError, match="missing the field 'pid'"):
        decode_control(header, bare)  # every field is required (protocol v1 is strict)


def test_the_engine_learns_the_clients_codecs_and_each_calls_wish() -> None:
    engine = Engine.make()
    engine.join(compression=("zstd",))
    assert engine.proto.sessions[b"c1"].compression == ("zstd",)
    call = engine.call(b"c1", 1, flags=int(Flags.COMPRESS))
    assert call is not None
    assert call.results == int(Flags.COMPRESS)
    plain = engine.call(b"c1", 2, flags=int(Flags.NO_WAIT))
    assert plain is not None
    assert plain.results == 0


# -- what the shells move off the event loop (OFF_LOOP_BYTES) --------------------------------


class _Declines:
    """A placer that places the tensors it is told to (a stand-in for torch_shm)."""

    def __init__(self, take: bool) -> None:
        self.take = take

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        return ("torch_shm", b"h") if self.take else None


def test_encode_stops_at_off_loop_bytes_to_compress_over_the_whole_message() -> None:
    x = activations()  # 256 KiB
    quarter = x.nbytes // 4
    # One frame, several frames adding up, or a payload: over the bound, the shell
    # encodes again on a worker thread.
    for value in (x, [x[:16], x[16:32], x[32:48]]):
        with pytest.raises(_codec.OffLoop):
            _codec.encode(value, compression=ZSTD, off_loop=x.nbytes // 2)
    with pytest.raises(_codec.OffLoop):
        _codec.encode("z" * quarter, compression=ZSTD, off_loop=quarter)
    # Below it, without compression, or without a bound: encoded here, as before.
    small = _codec.encode(x[:16], compression=ZSTD, off_loop=x.nbytes // 2)
    assert torch.equal(decode(small), x[:16])  # type: ignore[arg-type]
    assert len(_codec.encode(x, off_loop=1).buffers[0]) == x.nbytes
    assert torch.equal(decode(_codec.encode(x, compression=ZSTD)), x)  # type: ignore[arg-type]
    # A placer that declines everything changes nothing; once one placed a tensor, the
    # encode is never repeated (it would place it twice).
    with pytest.raises(_codec.OffLoop):
        _codec.encode(x, compression=ZSTD, off_loop=quarter, placer=_Declines(False))
    config = CodecConfig()
    placed = _codec.encode(
        [x[:32], x[32:].numpy()], config, compression=ZSTD, off_loop=1, placer=_Declines(True)
    )
    assert placed.buffers == []


def test_compressed_bytes_is_what_a_message_says_it_expands_to() -> None:
    x = activations()
    encoded = _codec.encode([x, x[:8]], compression=ZSTD)
    assert _codec.compressed_bytes(encoded.payload, encoded.buffers) == x.nbytes + x[:8].nbytes
    payload = _codec.encode("z" * 100_000, compression=ZSTD).payload
    assert _codec.compressed_bytes(payload, ()) == len(ormsgpack.packb("z" * 100_000))
    plain = _codec.encode(x)
    assert _codec.compressed_bytes(plain.payload, plain.buffers) == 0
    # A stranger's bytes: a guess at most, never an error (decode checks them).
    assert _codec.compressed_bytes(b"\xc7\x05\x03\x28\xb5\x2f\xfd\x00", [b"\x28\xb5\x2f\xfd"]) == 0
