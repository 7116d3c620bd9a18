"""Property tests: arbitrary nested values with tensors and arrays round-trip through the
codec bit-exactly, with one out-of-band buffer per tensor at or above the threshold."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tensorrpc._codec import CodecConfig, decode, encode

from .codec_helpers import (
    NUMPY_DTYPE_NAMES,
    TORCH_DTYPE_NAMES,
    assert_same_array,
    assert_same_tensor,
    random_tensor,
)

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple) | st.sampled_from(
    [(300,), (17, 33), (1, 1024), (0,)]
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = getattr(torch, draw(st.sampled_from(TORCH_DTYPE_NAMES)))
    shape = draw(shapes)
    tensor = random_tensor(dtype, shape, seed=draw(st.integers(0, 2**32 - 1)))
    layout = draw(st.sampled_from(["as-is", "transpose", "step", "expand", "offset"]))
    if layout == "transpose" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, tensor.dim() - 1)
    elif layout == "step" and tensor.dim() >= 1:
        tensor = tensor[::2]
    elif layout == "expand":
        tensor = tensor.unsqueeze(0).expand(3, *tensor.shape)
    elif layout == "offset" and tensor.dim() >= 1 and tensor.shape[0] > 1:
        tensor = tensor[1:]
    return tensor


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPE_NAMES)))
    shape = draw(shapes)
    count = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=count, max_size=count)) if count <= 64 else None
    if raw is None:
        seed = draw(st.integers(0, 2**32 - 1))
        raw = np.random.default_rng(seed).integers(0, 256, count, dtype=np.uint8).tobytes()
    if dtype.kind == "b":
        raw = bytes(b & 1 for b in raw)
    array = np.frombuffer(raw, dtype=np.uint8).copy().view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["as-is", "fortran", "reverse", "bigendian"]))
    if layout == "fortran":
        array = np.asfortranarray(array)
    elif layout == "reverse" and array.ndim >= 1:
        array = array[::-1]
    elif layout == "bigendian":
        array = array.astype(dtype.newbyteorder(">"))
    return array


class Tag(enum.Enum):
    A = "a"
    B = 2


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    label: str
    tag: Tag
    payload: Any


leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | tensors()
    | arrays()
)

values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        | st.builds(Node, st.text(max_size=5), st.sampled_from(Tag), inner)
    ),
    max_leaves=12,
)

configs = st.builds(CodecConfig, inline_threshold=st.sampled_from([0, 1, 64, 512, 4096]))


def out_of_band(value: object, config: CodecConfig) -> int:
    """How many tensors in ``value`` the codec must send out of band."""
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size() >= config.inline_threshold)
    if isinstance(value, np.ndarray):
        return int(value.nbytes >= config.inline_threshold)
    if isinstance(value, (list, tuple)):
        return sum(out_of_band(v, config) for v in value)
    if isinstance(value, dict):
        return sum(out_of_band(v, config) for v in value.values())
    if isinstance(value, Node):
        return out_of_band(value.payload, config)
    return 0


def assert_equivalent(got: object, want: object) -> None:
    """``got`` is what decoding ``want`` must give (tuples→lists, dataclasses→dicts...)."""
    if isinstance(want, torch.Tensor):
        assert_same_tensor(got, want)
    elif isinstance(want, np.ndarray):
        assert_same_array(got, want)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_equivalent(g, w)
    elif isinstance(want, dict):
        assert isinstance(got, dict)
        assert got.keys() == want.keys()
        for key, w in want.items():
            assert_equivalent(got[key], w)
    elif isinstance(want, Node):
        assert isinstance(got, dict)
        assert got.keys() == {"label", "tag", "payload"}
        assert got["label"] == want.label
        assert got["tag"] == want.tag.value
        assert_equivalent(got["payload"], want.payload)
    else:
        assert type(got) is type(want)
        assert got == want


@SETTINGS
@given(value=values, config=configs)
def test_nested_values_round_trip_with_one_buffer_per_large_tensor(
    value: object, config: CodecConfig
) -> None:
    encoded = encode(value, config)
    assert len(encoded.buffers) == out_of_band(value, config)
    assert all(b.ndim == 1 and b.format == "B" for b in encoded.buffers)
    assert decode(encoded.payload, encoded.buffers, config) is not None or value is None
    assert_equivalent(decode(encoded.payload, encoded.buffers, config), value)


@SETTINGS
@given(value=values, config=configs)
def test_round_trip_through_copied_writable_frames(value: object, config: CodecConfig) -> None:
    encoded = encode(value, config)
    frames = [bytearray(b) for b in encoded.buffers]
    got = decode(bytes(encoded.payload), frames, config)
    del encoded
    assert_equivalent(got, value)


@SETTINGS
@given(tensor=tensors(), config=configs)
def test_every_tensor_round_trips_alone(tensor: torch.Tensor, config: CodecConfig) -> None:
    encoded = encode(tensor, config)
    expected = int(tensor.numel() * tensor.element_size() >= config.inline_threshold)
    assert len(encoded.buffers) == expected
    got = decode(encoded.payload, [bytes(b) for b in encoded.buffers], config)
    assert_same_tensor(got, tensor)
    assert got.is_contiguous()


@SETTINGS
@given(array=arrays(), config=configs)
def test_every_array_round_trips_alone(array: np.ndarray[Any, Any], config: CodecConfig) -> None:
    encoded = encode(array, config)
    assert len(encoded.buffers) == int(array.nbytes >= config.inline_threshold)
    got = decode(encoded.payload, encoded.buffers, config)
    assert_same_array(got, array)
    assert got.flags.writeable
