"""The tensor codec: round trips of every dtype and layout, frame counts, zero-copy decode,
validation of descriptors and limits, placers and resolvers."""

from __future__ import annotations

import ast
import dataclasses
import datetime
import enum
import gc
import pathlib
import uuid
import warnings
from typing import Any

import numpy as np
import ormsgpack
import pytest
import torch
import zmq

import tensorrpc
from tensorrpc import _codec
from tensorrpc._codec import (
    CodecConfig,
    Encoded,
    ExtCode,
    Location,
    decode,
    encode,
)
from tensorrpc._exceptions import DecodeError, EncodeError, TensorTransportError

from .codec_helpers import (
    NUMPY_DTYPE_NAMES,
    TORCH_DTYPE_NAMES,
    assert_same_array,
    assert_same_tensor,
    random_tensor,
)

THRESHOLD = CodecConfig().inline_threshold


def roundtrip(value: object, config: CodecConfig = _codec.DEFAULT) -> tuple[Any, Encoded]:
    encoded = encode(value, config)
    return decode(encoded.payload, encoded.buffers, config), encoded


def ext(code: int, desc: object) -> bytes:
    return ormsgpack.packb(ormsgpack.Ext(code, ormsgpack.packb(desc)))


# --- layouts --------------------------------------------------------------------------

LAYOUTS = [
    "contiguous",
    "2d",
    "transposed",
    "strided",
    "offset",
    "expanded",
    "scalar",
    "empty",
    "size1-dims",
]


def make_layout(dtype: torch.dtype, layout: str, large: bool) -> torch.Tensor:
    """A tensor of ``dtype`` with ``layout``; large ones are at or above the threshold."""
    n = (THRESHOLD // dtype.itemsize + 8) if large else max(1, 64 // dtype.itemsize)
    match layout:
        case "contiguous":
            return random_tensor(dtype, (n,))
        case "2d":
            return random_tensor(dtype, (2, n))
        case "transposed":
            return random_tensor(dtype, (3, n)).t()
        case "strided":
            return random_tensor(dtype, (3 * n,))[::3]
        case "offset":
            return random_tensor(dtype, (n + 5,))[5:]
        case "expanded":
            return random_tensor(dtype, (1, n)).expand(2, n)
        case "scalar":
            return random_tensor(dtype, ())
        case "empty":
            return random_tensor(dtype, (0, n))
        case "size1-dims":
            # contiguous, but a size-1 dim has a stride that is not the canonical one
            tensor = random_tensor(dtype, (2, n))[:1].t()
            assert tensor.is_contiguous()
            assert tensor.stride() != (1, 1)
            return tensor
    raise AssertionError(layout)


def expected_frames(tensor: torch.Tensor, config: CodecConfig = _codec.DEFAULT) -> int:
    return int(tensor.numel() * tensor.element_size() >= config.inline_threshold)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype_name", TORCH_DTYPE_NAMES)
def test_every_torch_dtype_and_layout_round_trips_bit_exactly(
    dtype_name: str, layout: str, large: bool
) -> None:
    tensor = make_layout(getattr(torch, dtype_name), layout, large)
    got, encoded = roundtrip({"t": tensor})
    assert len(encoded.buffers) == expected_frames(tensor)
    assert_same_tensor(got["t"], tensor)
    assert got["t"].is_contiguous()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float8_e4m3fn", "float16", "float32"])
def test_large_contiguous_tensor_is_one_frame_on_its_memory(dtype_name: str) -> None:
    tensor = random_tensor(getattr(torch, dtype_name), (4, 1024))
    encoded = encode([tensor])
    assert len(encoded.buffers) == 1
    (buf,) = encoded.buffers
    assert buf.nbytes == tensor.nbytes
    assert buf.ndim == 1
    assert buf.format == "B"
    start = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert start == tensor.data_ptr()
    assert any(obj is tensor for obj in encoded.keepalive)


def test_noncontiguous_large_tensor_sends_one_contiguous_temporary() -> None:
    base = random_tensor(torch.float32, (64, 64))
    tensor = base.t()
    encoded = encode(tensor)
    assert len(encoded.buffers) == 1
    (owner,) = encoded.keepalive
    assert isinstance(owner, torch.Tensor)
    assert owner.is_contiguous()
    assert owner.data_ptr() != base.data_ptr()
    assert np.frombuffer(encoded.buffers[0], dtype=np.uint8).ctypes.data == owner.data_ptr()


def test_message_without_large_tensors_is_one_frame() -> None:
    small = torch.arange(10)
    value = {"ids": list(range(100)), "small": small, "arr": np.zeros(3)}
    encoded = encode(value)
    assert encoded.buffers == []
    assert encoded.keepalive == []
    got = decode(encoded.payload, [])
    assert got["ids"] == list(range(100))
    assert_same_tensor(got["small"], small)


def test_inline_threshold_boundary() -> None:
    config = CodecConfig(inline_threshold=64)
    below = torch.zeros(15, dtype=torch.float32)
    at = torch.zeros(16, dtype=torch.float32)
    assert len(encode(below, config).buffers) == 0
    assert len(encode(at, config).buffers) == 1


def test_zero_threshold_sends_even_empty_tensors_in_frames() -> None:
    config = CodecConfig(inline_threshold=0)
    value = [torch.empty(0, 3), np.empty((2, 0)), torch.tensor(1.0)]
    got, encoded = roundtrip(value, config)
    assert len(encoded.buffers) == 3
    assert got[0].shape == (0, 3)
    assert got[1].shape == (2, 0)
    assert got[2].item() == 1.0


# --- numpy ----------------------------------------------------------------------------

NP_LAYOUTS = ["contiguous", "fortran", "strided", "negative", "scalar", "empty", "bigendian"]


def make_array(dtype: np.dtype[Any], layout: str, large: bool) -> np.ndarray[Any, Any]:
    n = (THRESHOLD // dtype.itemsize + 8) if large else 4
    rng = np.random.default_rng(1)

    def rand(*shape: int) -> np.ndarray[Any, Any]:
        count = int(np.prod(shape)) * dtype.itemsize
        raw = rng.integers(0, 256, size=count, dtype=np.uint8)
        if dtype.kind == "b":
            raw = np.bitwise_and(raw, np.uint8(1))
        return raw.view(dtype).reshape(shape)

    match layout:
        case "contiguous":
            return rand(n)
        case "fortran":
            return np.asfortranarray(rand(3, n))
        case "strided":
            return rand(3 * n)[::3]
        case "negative":
            return rand(n)[::-1]
        case "scalar":
            return rand(1).reshape(())
        case "empty":
            return rand(0, n)
        case "bigendian":
            return rand(2, n).astype(dtype.newbyteorder(">"))
    raise AssertionError(layout)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
@pytest.mark.parametrize("layout", NP_LAYOUTS)
@pytest.mark.parametrize("dtype_name", NUMPY_DTYPE_NAMES)
def test_every_numpy_dtype_and_layout_round_trips_bit_exactly(
    dtype_name: str, layout: str, large: bool
) -> None:
    array = make_array(np.dtype(dtype_name), layout, large)
    got, encoded = roundtrip((array,))
    assert len(encoded.buffers) == int(array.nbytes >= THRESHOLD)
    assert_same_array(got[0], array)
    assert got[0].flags.writeable
    assert got[0].flags.c_contiguous


def test_numpy_and_torch_share_dtype_names() -> None:
    for name in NUMPY_DTYPE_NAMES:
        assert name in TORCH_DTYPE_NAMES


def test_numpy_array_decodes_as_numpy_and_tensor_as_tensor() -> None:
    got, _ = roundtrip({"a": np.arange(3), "t": torch.arange(3)})
    assert type(got["a"]) is np.ndarray
    assert type(got["t"]) is torch.Tensor


@pytest.mark.parametrize(
    ("array", "words"),
    [
        (np.array([object(), 1], dtype=object), "object"),
        (np.zeros(3, dtype=[("x", "f4"), ("y", "i4")]), "structured"),
        (np.array(["ab", "c"]), "string"),
        (np.array([b"ab", b"c"]), "string"),
        (np.zeros(3, dtype="V4"), "void"),
        (np.zeros(3, dtype="datetime64[s]"), "non-numeric"),
        (np.zeros(3, dtype="timedelta64[s]"), "non-numeric"),
        (np.ma.masked_array([1, 2], mask=[False, True]), "masked"),
    ],
    ids=["object", "structured", "unicode", "bytes", "void", "datetime", "timedelta", "masked"],
)
def test_unsupported_numpy_arrays_are_clear_encode_errors(
    array: np.ndarray[Any, Any], words: str
) -> None:
    with pytest.raises(EncodeError, match=words):
        encode({"x": array})


@pytest.mark.skipif(
    np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is float64 on this platform"
)
def test_longdouble_is_refused_with_advice() -> None:
    with pytest.raises(EncodeError, match="float64"):
        encode(np.zeros(2, dtype=np.longdouble))
    with pytest.raises(EncodeError, match="complex128"):
        encode(np.zeros(2, dtype=np.clongdouble))


# --- unsupported torch tensors and values ---------------------------------------------


def test_quantized_tensor_is_an_encode_error() -> None:
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor(torch.rand(4), scale=0.1, zero_point=0, dtype=torch.qint8)
    with pytest.raises(EncodeError, match="dequantize"):
        encode(q)


def test_sparse_tensor_is_an_encode_error() -> None:
    with pytest.raises(EncodeError, match="to_dense"):
        encode(torch.eye(3).to_sparse())


def test_meta_tensor_is_an_encode_error() -> None:
    with pytest.raises(EncodeError, match="meta"):
        encode(torch.empty(4, device="meta"))


@pytest.mark.parametrize(
    "value",
    [object(), {1, 2}, datetime.datetime(2020, 1, 1), uuid.uuid4(), 1 << 70, np.float32(1.0)],
    ids=["object", "set", "datetime", "uuid", "bigint", "numpy-scalar"],
)
def test_unsupported_values_are_encode_errors(value: object) -> None:
    with pytest.raises(EncodeError):
        encode({"nested": [value]})


def test_rank_over_the_wire_limit_is_an_encode_error() -> None:
    with pytest.raises(EncodeError, match="rank 33"):
        encode(torch.zeros([1] * 33))
    with pytest.raises(EncodeError, match="rank 33"):
        encode(np.zeros([1] * 33))
    got, _ = roundtrip(torch.zeros([1] * 32))
    assert got.shape == (1,) * 32


def test_too_deep_nesting_is_an_encode_error() -> None:
    deep: list[Any] = []
    inner = deep
    for _ in range(1000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(EncodeError, match="Recursion"):
        encode(deep)
    with pytest.raises(DecodeError):
        decode(b"\x91" * 100_000 + b"\xc0", [])


def test_zero_d_arrays_keep_their_shape_when_placed() -> None:
    transport = DictTransport()
    array = np.array(2.5)
    encoded = encode(array, CodecConfig(inline_threshold=0), placer=transport)
    assert transport.offered[0].shape == ()
    got = decode(encoded.payload, [], CodecConfig(inline_threshold=0), resolver=transport)
    assert_same_array(got, array)


def test_unknown_type_error_names_the_type() -> None:
    class Opaque:
        pass

    with pytest.raises(EncodeError, match="Opaque"):
        encode([Opaque()])


@pytest.mark.parametrize("key", [b"k", None, 1.5, (1, 2), False])
def test_dict_keys_other_than_str_and_int_are_an_encode_error(key: object) -> None:
    with pytest.raises(EncodeError, match="map keys are str or int"):
        encode([{"a": 1}, {1: "a", key: "b"}])
    assert decode(encode({1: "a", "b": 2}).payload) == {1: "a", "b": 2}


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports a CUDA device, to drive the device checks without a GPU."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda:0")

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


def test_device_tensor_without_allow_cuda_copy_says_how_to_allow_it() -> None:
    tensor = torch.arange(1000, dtype=torch.float32).as_subclass(FakeCudaTensor)
    with pytest.raises(EncodeError, match="allow_cuda_copy=True"):
        encode(tensor)
    with pytest.raises(EncodeError, match="allow_cuda_copy=True"):
        encode(tensor[:3])


def test_device_tensor_with_allow_cuda_copy_is_copied_to_host() -> None:
    values = torch.arange(1000, dtype=torch.float32)
    config = CodecConfig(allow_cuda_copy=True)
    got, encoded = roundtrip(values.as_subclass(FakeCudaTensor), config)
    assert len(encoded.buffers) == 1
    assert_same_tensor(torch.Tensor(got), values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_round_trips_through_host_copy() -> None:  # pragma: no cover
    tensor = torch.randn(64, 64, device="cuda")
    with pytest.raises(EncodeError, match="allow_cuda_copy"):
        encode(tensor)
    got, encoded = roundtrip(tensor, CodecConfig(allow_cuda_copy=True))
    assert len(encoded.buffers) == 1
    assert_same_tensor(got, tensor.cpu())


def test_requires_grad_tensor_is_detached() -> None:
    tensor = torch.randn(300, requires_grad=True)
    got, _ = roundtrip(tensor * 2)
    assert not got.requires_grad
    assert_same_tensor(got, (tensor * 2).detach())


def test_conjugate_and_negative_views_are_resolved() -> None:
    base = torch.randn(200, dtype=torch.complex64)
    got, _ = roundtrip([base.conj(), torch._neg_view(base)])
    assert_same_tensor(got[0], base.conj().resolve_conj())
    assert_same_tensor(got[1], torch._neg_view(base).resolve_neg())


def test_inline_tensors_carry_their_values_whatever_their_view() -> None:
    # Small tensors ride inline; a contiguous real one is copied from its memory as is,
    # so every view whose memory is not its values must take the other path.
    real = torch.randn(24)
    cplx = torch.randn(6, dtype=torch.complex64)
    tensors = [
        real,
        real[3:11],  # an offset into the storage
        real[::3],  # not contiguous
        real.view(4, 6).t(),
        real.view(1, 24, 1)[:, 2:5],
        torch._neg_view(real),
        torch._neg_view(real)[1:4],
        cplx.conj(),
        torch._neg_view(cplx),
        real.to(torch.bfloat16),
        real > 0,
        torch.arange(10, dtype=torch.int64)[2:],
    ]
    encoded = _codec.encode(tensors)
    assert encoded.buffers == []  # all inline
    got = _codec.decode(encoded.payload, encoded.buffers)
    for sent, back in zip(tensors, got, strict=True):
        assert_same_tensor(back, sent.resolve_conj().resolve_neg().contiguous())


# --- plain values ---------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Inner:
    name: str
    weights: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class Outer:
    items: tuple[Inner, ...]
    color: Color
    level: Level
    extra: dict[str, Any]


def test_dataclasses_enums_and_tuples_become_maps_values_and_arrays() -> None:
    weights = torch.randn(1000)
    value = Outer(
        items=(Inner("a", weights), Inner("b", torch.ones(2))),
        color=Color.BLUE,
        level=Level.HIGH,
        extra={"t": (1, 2.5, "x", b"\x00", None, True, False)},
    )
    got, encoded = roundtrip(value)
    assert len(encoded.buffers) == 1
    assert got["color"] == "blue"
    assert got["level"] == 2
    assert got["extra"] == {"t": [1, 2.5, "x", b"\x00", None, True, False]}
    assert got["items"][0]["name"] == "a"
    assert_same_tensor(got["items"][0]["weights"], weights)
    assert_same_tensor(got["items"][1]["weights"], torch.ones(2))


def test_tensors_frames_follow_their_order_in_the_value() -> None:
    tensors = [torch.full((200,), float(i)) for i in range(5)]
    got, encoded = roundtrip({"xs": tensors})
    assert len(encoded.buffers) == 5
    for i, t in enumerate(got["xs"]):
        assert t[0].item() == float(i)


def test_same_tensor_twice_is_sent_twice() -> None:
    tensor = torch.randn(1000)
    got, encoded = roundtrip([tensor, tensor])
    assert len(encoded.buffers) == 2
    assert_same_tensor(got[0], tensor)
    assert_same_tensor(got[1], tensor)


# --- zero-copy decode -----------------------------------------------------------------


def address_range(buf: object) -> tuple[int, int]:
    array = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
    return array.ctypes.data, array.ctypes.data + array.nbytes


def test_decode_builds_tensors_on_writable_buffers_without_copying() -> None:
    tensor = random_tensor(torch.bfloat16, (16, 128))
    array = np.arange(1000, dtype=np.float64)
    encoded = encode([tensor, array])
    buffers = [bytearray(b) for b in encoded.buffers]
    got = decode(encoded.payload, buffers)
    lo, hi = address_range(buffers[0])
    assert lo <= got[0].data_ptr() < hi
    lo, hi = address_range(buffers[1])
    assert lo <= got[1].ctypes.data < hi
    assert_same_tensor(got[0], tensor)
    got[0].view(torch.int16)[0, 0] = 7
    assert buffers[0][:2] == (7).to_bytes(2, "little")


def test_decoded_tensor_keeps_its_buffer_alive() -> None:
    tensor = random_tensor(torch.float32, (4096,))
    encoded = encode(tensor)
    buffers = [bytearray(encoded.buffers[0])]
    got = decode(encoded.payload, buffers)
    del buffers, encoded
    gc.collect()
    assert_same_tensor(got, tensor)


def test_read_only_buffers_are_copied_into_writable_tensors_without_warnings() -> None:
    tensor = random_tensor(torch.float16, (1024,))
    array = np.arange(512, dtype=np.int32)
    encoded = encode({"t": tensor, "a": array})
    frozen = [bytes(b) for b in encoded.buffers]
    got = decode(encoded.payload, frozen)
    assert_same_tensor(got["t"], tensor)
    assert_same_array(got["a"], array)
    got["t"] += 1
    got["a"] += 1
    assert frozen[0] == bytes(encoded.buffers[0])


def test_misaligned_buffer_is_copied_to_aligned_memory() -> None:
    tensor = torch.arange(256, dtype=torch.float64)
    encoded = encode(tensor)
    backing = bytearray(tensor.nbytes + 1)
    window = memoryview(backing)[1:]
    window[:] = encoded.buffers[0]
    got = decode(encoded.payload, [window])
    assert got.data_ptr() % 8 == 0
    assert_same_tensor(got, tensor)


def test_decode_accepts_zmq_frames_directly() -> None:
    tensor = torch.randn(1000)
    encoded = encode(tensor)
    frames = [zmq.Frame(encoded.payload), zmq.Frame(bytes(encoded.buffers[0]))]
    got = decode(frames[0], frames[1:])  # type: ignore[arg-type]
    assert_same_tensor(got, tensor)


# --- descriptors and limits at decode -------------------------------------------------


def valid_desc() -> list[Any]:
    return ["float32", [2, 3], Location.INLINE, bytes(24)]


def test_valid_handcrafted_descriptor_decodes() -> None:
    got = decode(ext(ExtCode.TORCH, valid_desc()), [])
    assert got.shape == (2, 3)
    assert got.dtype == torch.float32


@pytest.mark.parametrize(
    ("desc", "message"),
    [
        ("not a list", "dtype, shape, loc, ref"),
        (["float32", [2, 3], 0], "dtype, shape, loc, ref"),
        (["float32", [2, 3], 0, bytes(24), 1], "dtype, shape, loc, ref"),
        ([1, [2, 3], 0, bytes(24)], "string"),
        (["object", [2, 3], 0, bytes(24)], "not allowed"),
        (["qint8", [2, 3], 0, bytes(24)], "not allowed"),
        (["float32", [2, -3], 0, bytes(24)], "non-negative"),
        (["float32", [2, 3.0], 0, bytes(24)], "non-negative"),
        (["float32", [2, True], 0, bytes(24)], "non-negative"),
        (["float32", [1] * 33, 0, bytes(4)], "at most 32"),
        (["float32", [1 << 40, 1 << 40], 0, b""], "too large"),
        (["float32", [0, 1 << 40, 1 << 40], 0, b""], "too large"),
        (["float32", [1 << 38], 0, b""], "max_tensor_bytes"),
        (["float32", [2, 3], 0, bytes(23)], "needs 24 bytes"),
        (["float32", [2, 3], 0, "x" * 24], "must be bytes"),
        (["float32", [2, 3], 7, bytes(24)], "unknown tensor location"),
        (["float32", [2, 3], "0", bytes(24)], "location must be an int"),
        (["float32", [2, 3], 1, 0], "out of range"),
        (["float32", [2, 3], 2, ["shm", b"h"]], "no resolver"),
        (["float32", [2, 3], 2, "shm"], "transport, handle"),
        (["float32", [2, 3], 2, ["", b"h"]], "transport name"),
        (["float32", [2, 3], 2, ["x" * 65, b"h"]], "transport name"),
        (["float32", [2, 3], 2, ["shm", "h"]], "handle"),
        (["float32", [2, 3], 2, ["shm", bytes(4097)]], "handle"),
    ],
)
def test_bad_descriptors_are_decode_errors(desc: object, message: str | None) -> None:
    with pytest.raises(DecodeError, match=message):
        decode(ext(ExtCode.TORCH, desc), [])
    with pytest.raises(DecodeError, match=message):
        decode(ext(ExtCode.NUMPY, desc), [])


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "complex32", "float128"])
def test_numpy_descriptors_allow_only_numpy_dtypes(name: str) -> None:
    with pytest.raises(DecodeError, match="not allowed"):
        decode(ext(ExtCode.NUMPY, [name, [1], 0, bytes(2)]), [])


def test_unknown_ext_code_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="ext code 9"):
        decode(ext(9, valid_desc()), [])


def test_descriptor_that_is_not_msgpack_is_a_decode_error() -> None:
    bad = ormsgpack.packb(ormsgpack.Ext(ExtCode.TORCH, b"\xc1"))
    with pytest.raises(DecodeError, match="malformed tensor descriptor"):
        decode(bad, [])


def test_malformed_payload_is_a_decode_error_not_a_value_error() -> None:
    with pytest.raises(DecodeError, match="malformed msgpack") as info:
        decode(b"\x92\x01", [])
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("trailer", [b"\x00", b"\xc0", b"\x80\x05", b"\xc1\xc1"])
def test_trailing_bytes_after_the_payload_are_a_decode_error(trailer: bytes) -> None:
    encoded = encode({"x": [1, 2, 3]})
    with pytest.raises(DecodeError, match=r"trailing bytes|malformed"):
        decode(encoded.payload + trailer, [])


def test_a_forged_end_marker_is_trailing_bytes() -> None:
    # The marker is a bin of a per-process random nonce: a guessed one is trailing bytes.
    for forged in (bytes(16), _codec._END_NONCE[:-1] + b"?"):
        with pytest.raises(DecodeError, match="trailing bytes"):
            decode(ormsgpack.packb(1) + ormsgpack.packb(forged), [])
    with pytest.raises(DecodeError, match="ext code 127"):
        decode(ormsgpack.packb([ormsgpack.Ext(127, bytes(16))]), [])


def test_payload_that_is_not_a_buffer_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="not a buffer"):
        decode(42, [])  # type: ignore[arg-type]
    payload = ext(ExtCode.TORCH, ["float32", [1], 1, 0])
    with pytest.raises(DecodeError, match="not a buffer"):
        decode(payload, [42])  # type: ignore[list-item]


def test_frame_referenced_twice_is_a_decode_error() -> None:
    desc = ["float32", [256], Location.FRAME, 0]
    payload = ormsgpack.packb(
        [ormsgpack.Ext(ExtCode.TORCH, ormsgpack.packb(desc))] * 2,
    )
    with pytest.raises(DecodeError, match="referenced twice"):
        decode(payload, [bytearray(1024), bytearray(1024)])


def test_missing_and_extra_buffers_are_decode_errors() -> None:
    encoded = encode([torch.randn(300), torch.randn(300)])
    with pytest.raises(DecodeError, match="out of range"):
        decode(encoded.payload, encoded.buffers[:1])
    with pytest.raises(DecodeError, match="3 buffers but references 2"):
        decode(encoded.payload, [*encoded.buffers, bytearray(8)])
    with pytest.raises(DecodeError, match="1 buffers but references 0"):
        decode(ormsgpack.packb(1), [bytearray(8)])


def test_frame_with_the_wrong_length_is_a_decode_error() -> None:
    encoded = encode(torch.randn(300))
    with pytest.raises(DecodeError, match="needs 1200 bytes, got 1196"):
        decode(encoded.payload, [bytearray(1196)])


def test_terabyte_claim_fails_fast_without_allocating() -> None:
    desc = ["uint8", [1 << 40], Location.FRAME, 0]
    config = CodecConfig(max_tensor_bytes=1 << 41)
    with pytest.raises(DecodeError, match="needs 1099511627776 bytes"):
        decode(ext(ExtCode.TORCH, desc), [bytearray(16)], config)


def test_decode_limits() -> None:
    encoded = encode([torch.randn(1000), torch.randn(1000)])
    with pytest.raises(DecodeError, match="max_payload_bytes"):
        decode(encoded.payload, encoded.buffers, CodecConfig(max_payload_bytes=10))
    with pytest.raises(DecodeError, match="max_tensors"):
        decode(encoded.payload, encoded.buffers, CodecConfig(max_tensors=1))
    with pytest.raises(DecodeError, match="max_tensor_bytes"):
        decode(encoded.payload, encoded.buffers, CodecConfig(max_tensor_bytes=3999))
    small = encode([torch.ones(2)] * 3)
    with pytest.raises(DecodeError, match="max_tensors=2"):
        decode(small.payload, [], CodecConfig(max_tensors=2))


def test_encode_limits() -> None:
    with pytest.raises(EncodeError, match="max_tensor_bytes=100"):
        encode({"x": torch.zeros(26)}, CodecConfig(max_tensor_bytes=100))
    with pytest.raises(EncodeError, match="max_tensor_bytes=100"):
        encode({"x": np.zeros(26, np.float32)}, CodecConfig(max_tensor_bytes=100))
    with pytest.raises(EncodeError, match="max_tensors=2"):
        encode([torch.zeros(1), np.zeros(1), torch.zeros(1)], CodecConfig(max_tensors=2))
    with pytest.raises(EncodeError, match="max_payload_bytes=50"):
        encode("x" * 100, CodecConfig(max_payload_bytes=50))


def test_codec_errors_are_tensorrpc_errors() -> None:
    assert issubclass(DecodeError, tensorrpc._exceptions.TensorRPCError)
    with pytest.raises(tensorrpc._exceptions.SerializationError):
        decode(b"\xc1", [])


# --- placers and resolvers ------------------------------------------------------------


class DictTransport:
    """An in-memory transport: handles are keys into a dict shared by both ends."""

    def __init__(self, *, take: bool = True) -> None:
        self.store: dict[bytes, torch.Tensor] = {}
        self.take = take
        self.offered: list[torch.Tensor] = []

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        self.offered.append(tensor)
        if not self.take:
            return None
        handle = str(len(self.store)).encode()
        self.store[handle] = tensor.clone()
        return ("dict", handle)

    def resolve(
        self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        if transport != "dict" or handle not in self.store:
            raise TensorTransportError(f"unknown handle {handle!r}")
        return self.store[handle]


def test_placed_tensors_travel_by_handle() -> None:
    transport = DictTransport()
    tensor = torch.randn(1000)
    array = np.arange(1000, dtype=np.int16)
    value = {"t": tensor, "a": array, "small": torch.ones(2)}
    encoded = encode(value, placer=transport)
    assert encoded.buffers == []
    assert len(transport.offered) == 2
    got = decode(encoded.payload, [], resolver=transport)
    assert_same_tensor(got["t"], tensor)
    assert_same_array(got["a"], array)
    assert_same_tensor(got["small"], torch.ones(2))


def test_declined_tensors_go_in_frames() -> None:
    transport = DictTransport(take=False)
    encoded = encode([torch.randn(1000), np.zeros(1000)], placer=transport)
    assert len(encoded.buffers) == 2
    assert len(transport.offered) == 2


def test_placer_sees_detached_tensors() -> None:
    transport = DictTransport()
    encode(torch.randn(1000, requires_grad=True), placer=transport)
    assert not transport.offered[0].requires_grad


def test_resolver_errors_propagate() -> None:
    encoded = encode(torch.randn(1000), placer=DictTransport())
    with pytest.raises(TensorTransportError, match="unknown handle"):
        decode(encoded.payload, [], resolver=DictTransport())


def test_placer_errors_propagate() -> None:
    class Broken:
        def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
            raise TensorTransportError("no space")

    with pytest.raises(TensorTransportError, match="no space"):
        encode([torch.randn(1000)], placer=Broken())


@pytest.mark.parametrize(
    "answer",
    [("shm",), ("shm", "handle"), ("", b"h"), ("x" * 65, b"h"), ("shm", bytes(4097)), "shm"],
)
def test_malformed_placer_answers_are_encode_errors(answer: object) -> None:
    class Odd:
        def place(self, tensor: torch.Tensor) -> Any:
            return answer

    with pytest.raises(EncodeError, match="placer returned"):
        encode(torch.randn(1000), placer=Odd())


def test_resolver_returning_the_wrong_tensor_is_a_decode_error() -> None:
    class Liar:
        def resolve(
            self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
        ) -> torch.Tensor:
            return torch.zeros(3, dtype=torch.float64)

    encoded = encode(torch.randn(1000), placer=DictTransport())
    with pytest.raises(DecodeError, match="wrong tensor"):
        decode(encoded.payload, [], resolver=Liar())


# --- module hygiene -------------------------------------------------------------------


@pytest.mark.parametrize("module", ["_codec.py", "transports/_base.py"])
def test_sans_io_modules_import_no_io_library(module: str) -> None:
    path = pathlib.Path(tensorrpc.__file__).parent / module
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"zmq", "asyncio", "anyio", "trio", "pickle"})


def test_wire_enums_have_the_documented_values() -> None:
    assert [int(c) for c in ExtCode] == [1, 2, 3]
    assert [int(loc) for loc in Location] == [0, 1, 2, 3]


def test_check_message_size_uses_the_smaller_positive_limit() -> None:
    encoded = _codec.encode({"x": torch.zeros(1024, dtype=torch.uint8)})
    assert len(encoded.buffers) == 1
    # No limit on either side, or limits that fit: nothing raised.
    _codec.check_message_size(encoded, -1, 0, lambda: ("w", "engine 'e'"))
    _codec.check_message_size(encoded, 4096, 2048, lambda: ("w", "engine 'e'"))
    # Our own limit applies when the peer announced none.
    with pytest.raises(EncodeError, match=r"w include a tensor of 1024 bytes.*maxmsgsize=512\)"):
        _codec.check_message_size(encoded, 512, 0, lambda: ("w", "engine 'e'"))
    # The peer's smaller limit wins and is named.
    with pytest.raises(EncodeError, match=r"engine 'e' takes at most its maxmsgsize=1000\)"):
        _codec.check_message_size(encoded, 4096, 1000, lambda: ("w", "engine 'e'"))
    # The payload frame is checked too.
    with pytest.raises(EncodeError, match=r"w take \d+ encoded bytes"):
        _codec.check_message_size(encoded, 4, 0, lambda: ("w", "engine 'e'"))


# --- maps keyed by ints (dict[int, T]) -------------------------------------------------


class CountingResolver(DictTransport):
    def __init__(self) -> None:
        super().__init__()
        self.resolved = 0

    def resolve(
        self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        self.resolved += 1
        return super().resolve(transport, handle, dtype, shape)


def test_int_keyed_maps_travel_and_tensors_before_them_are_placed_once() -> None:
    transport = CountingResolver()
    big, framed, small = torch.randn(1000), torch.arange(300.0), torch.ones(2)
    # The tensors come before the int-keyed map: the first pass met them already.
    value = {"a": big, "b": [framed, np.arange(3)], "ids": {7: small, -1: "x", 1 << 63: None}}
    encoded = encode(value, placer=transport)
    assert len(transport.offered) == len(transport.store) == 2  # big and framed, once
    back = decode(encoded.payload, encoded.buffers, resolver=transport)
    assert transport.resolved == 2
    assert list(back["ids"]) == [7, -1, 1 << 63]
    assert torch.equal(back["a"], big)
    assert torch.equal(back["b"][0], framed)
    assert torch.equal(back["ids"][7], small)
    # Without a placer: one frame each, referenced once (decode checks every buffer).
    encoded = encode(value)
    assert len(encoded.buffers) == 2
    back = decode(encoded.payload, encoded.buffers)
    assert torch.equal(back["b"][0], framed)
    assert back["ids"][-1] == "x"


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"\x81\xc4\x01a\x02", "bytes"),  # {b"a": 2}
        (b"\x91\x81\xc0\x02", "NoneType"),  # [{None: 2}]
        (b"\x81\x91\x01\x02", "tuple"),  # {[1]: 2}
        (b"\x81\xc3\x01", "bool"),  # {True: 1}
        (b"\x81\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x01", "float"),  # {1.0: 1}
    ],
)
def test_map_keys_other_than_str_and_int_are_refused(payload: bytes, kind: str) -> None:
    with pytest.raises(tensorrpc.ValidationError, match=f"a key of type {kind}; map keys are"):
        decode(payload)


def test_a_cycle_with_an_int_keyed_map_is_an_encode_error_not_a_hang() -> None:
    cycle: list[object] = [{1: "a"}]
    cycle.append(cycle)
    with pytest.raises(EncodeError):
        encode(cycle)
