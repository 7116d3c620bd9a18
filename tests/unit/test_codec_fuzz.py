"""Fuzzing decode: random and mutated payloads, descriptors and buffers.

Every input must give a value or a :class:`DecodeError`, nothing else, and decoding must
not allocate more than the input justifies. Allocations are measured with tracemalloc,
which sees Python objects, numpy arrays and the ``bytearray`` copies the codec makes;
torch never allocates data during decode (tensors are views on buffers, and empty tensors
hold nothing), so tracemalloc covers every byte decode could be tricked into allocating.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ormsgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from tensorrpc._codec import CodecConfig, ExtCode, Location, decode, encode
from tensorrpc._exceptions import DecodeError, ValidationError

from .codec_helpers import NUMPY_DTYPE_NAMES, TORCH_DTYPE_NAMES

# 100 examples per property (the suite's time budget on a 2-core CI machine); raise it
# here for a longer local run when changing the codec.
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Python objects built from msgpack cost up to ~75 bytes per input byte (an empty map
#: is one byte on the wire and a dict in memory); anything beyond this is a bug.
BYTES_PER_INPUT_BYTE = 128
SLACK = 256 * 1024
CONFIG = CodecConfig(max_tensors=16, max_tensor_bytes=1 << 20, max_payload_bytes=1 << 20)


def decode_bounded(payload: bytes, buffers: Sequence[Any]) -> Any:
    """Decode; assert only DecodeError escapes and the peak allocation is bounded.

    A ValidationError is the one other outcome: well-formed msgpack with a map key that is
    neither a str nor an int (a value no peer may send, answered INVALID_ARGUMENT by an
    engine).
    tracemalloc runs around the decode only: traced, hypothesis's own work costs more than
    the decode (its random state is saved and restored for every example).
    """
    size = len(payload) + sum(memoryview(b).nbytes for b in buffers)
    tracemalloc.start()
    try:
        try:
            value = decode(payload, buffers, CONFIG)
        except (DecodeError, ValidationError):
            value = DecodeError
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= BYTES_PER_INPUT_BYTE * size + SLACK, (peak, size)
    return value


def frames(max_count: int = 3) -> st.SearchStrategy[list[Any]]:
    kinds: dict[str, Callable[[bytes], Any]] = {
        "bytes": bytes,
        "bytearray": bytearray,
        "memoryview": _writable_view,
    }
    buffer = st.builds(
        lambda raw, kind: kinds[kind](raw), st.binary(max_size=2048), st.sampled_from(sorted(kinds))
    )
    return st.lists(buffer, max_size=max_count)


def _writable_view(raw: bytes) -> memoryview:
    return memoryview(bytearray(raw))


# --- random bytes ---------------------------------------------------------------------


@FUZZ
@given(payload=st.binary(max_size=4096), buffers=frames())
def test_random_bytes_decode_or_raise_decode_error(payload: bytes, buffers: list[Any]) -> None:
    decode_bounded(payload, buffers)


# --- mutated valid messages -----------------------------------------------------------


def templates() -> list[tuple[bytes, list[bytes]]]:
    values: list[object] = [
        {"x": torch.arange(300, dtype=torch.float32), "ids": [1, 2, 3], "s": "hello"},
        [torch.ones(3, dtype=torch.bfloat16), np.arange(200, dtype=np.int64), b"raw"],
        {"nested": {"t": torch.zeros(2, 3, dtype=torch.float8_e4m3fn), "n": None}},
        (np.zeros((0, 4)), torch.tensor(1.5), 2.5, True),
        [torch.randn(130), torch.randn(140)],
    ]
    out = []
    for value in values:
        encoded = encode(value, CONFIG)
        out.append((encoded.payload, [bytes(b) for b in encoded.buffers]))
    return out


TEMPLATES = templates()


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, list[Any]]:
    payload, buffers = draw(st.sampled_from(TEMPLATES))
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC1, 0xC7, 0xDD, 0xDF, 0xFF]))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[pos : pos + draw(st.integers(1, 8))]
    new_buffers: list[Any] = [bytearray(b) for b in buffers]
    change = draw(st.sampled_from(["keep", "drop", "add", "resize", "swap"]))
    if change == "drop" and new_buffers:
        new_buffers.pop(draw(st.integers(0, len(new_buffers) - 1)))
    elif change == "add":
        new_buffers.append(bytearray(draw(st.binary(max_size=64))))
    elif change == "resize" and new_buffers:
        i = draw(st.integers(0, len(new_buffers) - 1))
        new_buffers[i] = new_buffers[i][: draw(st.integers(0, len(new_buffers[i])))]
    elif change == "swap":
        new_buffers.reverse()
    return bytes(data), new_buffers


@FUZZ
@given(message=mutated())
def test_mutated_messages_decode_or_raise_decode_error(message: tuple[bytes, list[Any]]) -> None:
    payload, buffers = message
    decode_bounded(payload, buffers)


def test_templates_decode_unmutated() -> None:
    for payload, buffers in TEMPLATES:
        assert decode_bounded(payload, [bytearray(b) for b in buffers]) is not DecodeError


# --- forged descriptors ---------------------------------------------------------------

junk = st.none() | st.booleans() | st.floats() | st.text(max_size=4) | st.binary(max_size=4)
dims = st.integers(-3, 8) | st.sampled_from([2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1, 2**64 - 1])
shapes_on_wire = st.lists(dims, max_size=6) | st.lists(dims, min_size=30, max_size=40) | junk
dtype_names = st.sampled_from([*TORCH_DTYPE_NAMES, *NUMPY_DTYPE_NAMES]) | st.sampled_from(
    ["object", "float128", "qint8", "str", "", "float32 ", "torch.float32", "<f4"]
)
locations = st.sampled_from([int(loc) for loc in Location]) | st.integers(-2, 5) | junk
refs = (
    st.binary(max_size=256)
    | st.integers(-2, 4)
    | st.integers(2**32, 2**63)
    | st.tuples(st.text(max_size=70), st.binary(max_size=5000)).map(list)
    | st.lists(junk, max_size=3)
    | junk
)
descriptors = st.tuples(dtype_names | junk, shapes_on_wire, locations, refs).map(list) | st.lists(
    junk, max_size=5
)
codes = st.sampled_from([int(c) for c in ExtCode]) | st.integers(0, 127)


@st.composite
def forged(draw: st.DrawFn) -> tuple[bytes, list[Any]]:
    exts = []
    for _ in range(draw(st.integers(1, 3))):
        desc = draw(descriptors)
        try:
            data = ormsgpack.packb(desc)
        except TypeError:  # e.g. an int over 64 bits: not representable, skip it
            assume(False)
        exts.append(ormsgpack.Ext(draw(codes), data))
    payload = ormsgpack.packb({"a": exts} if draw(st.booleans()) else exts)
    return payload, draw(frames(max_count=4))


@FUZZ
@given(message=forged())
def test_forged_descriptors_decode_or_raise_decode_error(message: tuple[bytes, list[Any]]) -> None:
    payload, buffers = message
    value = decode_bounded(payload, buffers)
    if value is not DecodeError:
        tensors = value["a"] if isinstance(value, dict) else value
        for tensor in tensors:
            assert isinstance(tensor, (torch.Tensor, np.ndarray))


@st.composite
def well_formed(draw: st.DrawFn) -> tuple[bytes, list[Any], int]:
    """Descriptors valid in every respect but one random size: only sizes can be wrong."""
    code = draw(st.sampled_from([ExtCode.TORCH, ExtCode.NUMPY]))
    name = draw(st.sampled_from(TORCH_DTYPE_NAMES if code == ExtCode.TORCH else NUMPY_DTYPE_NAMES))
    itemsize = getattr(torch, name).itemsize
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    numel = int(np.prod(shape)) if shape else 1
    nbytes = numel * itemsize + draw(st.sampled_from([0, 0, 0, -1, 1, itemsize]))
    assume(nbytes >= 0)
    loc = draw(st.sampled_from([Location.INLINE, Location.FRAME]))
    if loc == Location.INLINE:
        desc = [name, shape, int(loc), bytes(nbytes)]
        buffers: list[Any] = []
    else:
        desc = [name, shape, int(loc), 0]
        buffers = [bytearray(nbytes)]
    payload = ormsgpack.packb(ormsgpack.Ext(int(code), ormsgpack.packb(desc)))
    return payload, buffers, numel * itemsize


@FUZZ
@given(message=well_formed())
def test_size_mismatch_is_the_only_way_a_well_formed_descriptor_fails(
    message: tuple[bytes, list[Any], int],
) -> None:
    payload, buffers, needed = message
    have = sum(len(b) for b in buffers) or len(payload)
    value = decode_bounded(payload, buffers)
    if value is DecodeError:
        assert not buffers or len(buffers[0]) != needed
    else:
        assert isinstance(value, (torch.Tensor, np.ndarray))
        assert have >= 0


def test_pickle_payloads_are_refused() -> None:
    pickled = b"\x80\x05\x95\x0b\x00\x00\x00\x00\x00\x00\x00\x8c\x07os.path\x94."
    with pytest.raises(DecodeError):
        decode(pickled, [], CONFIG)
