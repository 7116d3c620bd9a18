"""Helpers shared by the codec tests: dtype lists, tensor builders, bit-exact comparison."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorrpc import _codec

# The codec fills in its dtype tables on its first tensor; these lists are read before.
_codec._load_arrays()
#: Every torch dtype the codec supports, by wire name (what this torch build has).
TORCH_DTYPE_NAMES: list[str] = sorted(_codec._TORCH_DECODE)
#: Every numpy dtype the codec supports, by wire name.
NUMPY_DTYPE_NAMES: list[str] = sorted(_codec._NUMPY_DECODE)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` filled with random bytes (NaNs and all).

    Built from bytes so that every dtype (float8, complex32, bits) works without kernels
    and without complex32's allocation warning.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8).view(dtype).reshape(shape)
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=dtype).view(shape)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's values as C-order raw bytes (works for every dtype, any layout)."""
    if tensor.numel() == 0:
        return b""
    if tensor.dtype is torch.complex32:
        tensor = torch.view_as_real(tensor)
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    flat = tensor.contiguous().as_strided((tensor.numel(),), (1,))
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def assert_same_tensor(got: object, want: torch.Tensor) -> None:
    """``got`` is a tensor with ``want``'s dtype, shape and exact bytes."""
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.device.type == "cpu"
    assert tensor_bytes(got) == tensor_bytes(want)


def assert_same_array(got: object, want: np.ndarray[Any, Any]) -> None:
    """``got`` is an ndarray with ``want``'s dtype (native order), shape and exact bytes."""
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.shape == want.shape
    native = want.astype(want.dtype.newbyteorder("="))
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(native).tobytes()
