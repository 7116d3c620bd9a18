"""Values ⇄ ``[payload, *buffers]``: msgpack with out-of-band tensor buffers (sans-I/O).

The payload is msgpack written by ormsgpack (dataclasses go as maps, enums as their value,
tuples as arrays). Every ``torch.Tensor`` and ``numpy.ndarray`` in the value becomes a
msgpack Ext whose data is ``[dtype, shape, loc, ref]`` (docs/protocol.md): ``ref`` is the
C-contiguous little-endian bytes (``INLINE``, below
[`CodecConfig.inline_threshold`][tensorrpc.CodecConfig.inline_threshold]), an index into
the buffers (``FRAME``: one buffer on the tensor's memory, not copied) or ``[transport,
handle]`` (``HANDLE``, when a `TensorPlacer` takes it). Decoding validates every
descriptor before touching memory and builds tensors on the received buffers without
copying. Per-call state lives in `_Encoder` / `_Decoder`, never on the module.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Final

import ormsgpack

from tensorrpc import _compression
from tensorrpc._exceptions import DecodeError, EncodeError, ValidationError
from tensorrpc._lazy import LazyModule
from tensorrpc._protocol import count_msgpack_objects

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import numpy as np
    import torch
    from typing_extensions import Buffer

    from tensorrpc._compression import Compression
    from tensorrpc.transports._base import TensorPlacer, TensorResolver
else:
    np = LazyModule("numpy", globals(), "np")
    torch = LazyModule("torch", globals())

__all__ = [
    "DEFAULT",
    "CodecConfig",
    "Encoded",
    "ExtCode",
    "Location",
    "OffLoop",
    "check_message_size",
    "compressed_bytes",
    "decode",
    "frame_limit",
    "encode",
]


class ExtCode(IntEnum):
    """msgpack Ext type codes used by tensorrpc."""

    #: A ``torch.Tensor``; decodes to a ``torch.Tensor``.
    TORCH = 1
    #: A ``numpy.ndarray``; decodes to a ``numpy.ndarray``.
    NUMPY = 2
    #: A compressed payload: the whole payload is this one Ext, whose data is a zstd frame
    #: holding the real payload (never inside a payload).
    ZSTD = 3


class Location(IntEnum):
    """Where a tensor's bytes are, third element of a tensor descriptor."""

    #: ``ref`` is the raw bytes, inside the payload.
    INLINE = 0
    #: ``ref`` is an index into the message's buffers (one out-of-band frame per tensor).
    FRAME = 1
    #: ``ref`` is ``[transport, handle]``, resolved by a ``TensorResolver``.
    HANDLE = 2
    #: ``ref`` is an index into the buffers, whose buffer is one zstd frame of the bytes.
    ZSTD_FRAME = 3


@dataclass(frozen=True, slots=True)
class CodecConfig:
    """Limits and policies of the codec, the same on both ends of a connection."""

    #: Tensors with ``nbytes`` below this go inline in the payload; the others go out of band.
    inline_threshold: int = 512
    #: Largest tensor accepted, in bytes, both directions.
    max_tensor_bytes: int = 1 << 34
    #: Most tensors (and out-of-band buffers) in one message.
    max_tensors: int = 1024
    #: Largest msgpack payload, in bytes, both directions.
    max_payload_bytes: int = 1 << 28
    #: Most msgpack objects (every value, container and map key counts one) in a payload,
    #: both directions. Decoding builds a Python object of ~30-70 bytes per msgpack object
    #: of as little as one byte, so this bounds the memory (about 20 MB) and CPU a payload
    #: can cost the receiver, whatever its size: a receiver counts the objects of any
    #: payload larger than this many bytes before decoding it. Tensors are one object
    #: each, whatever their size; send long lists of numbers as tensors.
    max_payload_objects: int = 1 << 18
    #: On the frames and inline paths, copy non-CPU (e.g. CUDA) tensors to host memory;
    #: when False such a tensor is an [`EncodeError`][tensorrpc.EncodeError].
    allow_cuda_copy: bool = False


#: The configuration used when none is given.
DEFAULT: Final = CodecConfig()


@dataclass(slots=True)
class Encoded:
    """One encoded message: a msgpack payload and its out-of-band buffers."""

    #: The msgpack frame.
    payload: bytes
    #: One 1-D byte ``memoryview`` per out-of-band tensor, referencing its memory.
    buffers: list[memoryview] = field(default_factory=list)
    #: Objects owning the memory of ``buffers`` (the tensors, or their contiguous/host
    #: temporaries). Hold them until the transport is done with the buffers (ZMQ tracker).
    keepalive: list[object] = field(default_factory=list)


class OffLoop(Exception):
    """`encode` met at least its ``off_loop`` bytes to compress (payload and frames
    together): the shell encodes again on a worker thread, without a placer (nothing was
    placed: compression never goes by torch_shm)."""


# Wire limits that do not depend on the configuration.
_MAX_RANK: Final = 32
#: Bound on prod(max(dim, 1)) * itemsize, so that no shape can overflow numpy/torch sizes.
_MAX_EXTENT_BYTES: Final = 1 << 62
_MAX_TRANSPORT_NAME: Final = 64
_MAX_HANDLE_BYTES: Final = 4096

#: Decode appends this bin after the payload to detect trailing bytes (a marker that
#: needs no ``ext_hook`` call). The nonce is random per process, so a peer cannot forge it.
_END_NONCE: Final = os.urandom(16)
_END_MARK: Final = ormsgpack.packb(_END_NONCE)

_TORCH: Final = int(ExtCode.TORCH)
_NUMPY: Final = int(ExtCode.NUMPY)
_INLINE: Final = int(Location.INLINE)
_FRAME: Final = int(Location.FRAME)
_HANDLE: Final = int(Location.HANDLE)
_ZSTD_FRAME: Final = int(Location.ZSTD_FRAME)
_ZSTD_EXT: Final = int(ExtCode.ZSTD)
# msgpack ext 8/16/32 headers: marker -> bytes of the length field.
_EXT_HEADERS: Final = {0xC7: 1, 0xC8: 2, 0xC9: 4}


#: The wire's dtype names, torch's (those the running torch has); numpy has the first 16
#: but bfloat16 and complex32.
_DTYPE_NAMES: Final = (
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 "
    "complex32 complex64 complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn_x2 bits8 bits16 bits1x8 bits2x4 bits4x2"
)
_TORCH_DTYPE_NAMES: Final = _DTYPE_NAMES.split()
_NUMPY_DTYPE_NAMES: Final = [
    n for n in _TORCH_DTYPE_NAMES[:16] if n not in ("bfloat16", "complex32")
]

# The dtype tables need torch and numpy, which a process that never sees a tensor does
# not import (seconds of start-up): `_load_arrays` fills them in on the first tensor.
_TORCH_NAMES: Final[dict[torch.dtype, str]] = {}
#: numpy dtype (native = little-endian; checked at import) -> wire name.
_NUMPY_NAMES: Final[dict[np.dtype[Any], str]] = {}
#: torch dtypes whose ``.numpy()`` buffer can be recast to bytes (single-char formats).
_CASTABLE: Final[set[torch.dtype]] = set()
#: A decode table's entry: torch dtype, numpy dtype of the same bytes (or None), item
#: size in bytes, and the alignment a tensor built on received bytes needs.
_DecodeEntry = tuple["torch.dtype", "np.dtype[Any] | None", int, int]
#: Wire name -> `_DecodeEntry`, the allowlists of ``ExtCode.TORCH`` and ``ExtCode.NUMPY``.
_TORCH_DECODE: Final[dict[str, _DecodeEntry]] = {}
_NUMPY_DECODE: Final[dict[str, _DecodeEntry]] = {}
_STRIDED: torch.layout
_arrays_loaded = False


def _load_arrays() -> None:
    """Import torch and numpy (module globals from then on) and fill in the dtype tables."""
    global _STRIDED, _arrays_loaded
    to_numpy: dict[torch.dtype, np.dtype[Any]] = {}
    for name in _NUMPY_DTYPE_NAMES:
        np_dtype = to_numpy[getattr(torch, name)] = np.dtype(name)
        _NUMPY_NAMES[np_dtype] = name
        if np_dtype.kind != "c":
            _CASTABLE.add(getattr(torch, name))
    for name in _TORCH_DTYPE_NAMES:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            _TORCH_NAMES[dtype] = name
            entry = (dtype, to_numpy.get(dtype), dtype.itemsize, min(dtype.itemsize, 8))
            _TORCH_DECODE[name] = entry
            if name in _NUMPY_DTYPE_NAMES:
                _NUMPY_DECODE[name] = entry
    _STRIDED = torch.strided
    _arrays_loaded = True


if sys.byteorder != "little":  # pragma: no cover - no big-endian host to test on
    raise ImportError("tensorrpc's codec needs a little-endian host")

_PACK_OPTIONS: Final = ormsgpack.OPT_PASSTHROUGH_DATETIME | ormsgpack.OPT_PASSTHROUGH_UUID
_INT_KEY_OPTIONS: Final = _PACK_OPTIONS | ormsgpack.OPT_NON_STR_KEYS


def _host_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A C-contiguous CPU tensor with the values of ``tensor`` (CPU, detached): itself
    when contiguous, else one temporary; and a 1-D byte view of it that keeps it alive."""
    if tensor.numel() == 0:
        return tensor, memoryview(b"")
    if tensor.is_contiguous() and tensor.dtype in _CASTABLE:
        # The cheapest zero-copy route (about 1 µs): numpy's buffer, recast to bytes.
        # numpy() refuses tensors with the conj/neg bit set; those take the path below.
        try:
            return tensor, tensor.numpy().data.cast("B")
        except RuntimeError:
            pass
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        if tensor.dtype is torch.complex32:
            # Allocating a complex32 tensor warns ("experimental"); copy its float16 pairs.
            tensor = torch.view_as_real(tensor).contiguous()
        else:
            tensor = tensor.contiguous()
    if tensor.dtype in _CASTABLE:
        return tensor, tensor.numpy().data.cast("B")
    # A contiguous tensor may still carry odd strides on size-1 dims, which view(uint8)
    # refuses; as_strided gives the canonical 1-D view of the same memory.
    flat = tensor.as_strided((tensor.numel(),), (1,))
    return tensor, flat.view(torch.uint8).numpy().data


def _inline_bytes(tensor: torch.Tensor, nbytes: int) -> bytes:
    """The C-contiguous little-endian bytes of the CPU tensor ``tensor`` (a copy)."""
    if nbytes and tensor.dtype in _CASTABLE and tensor.is_contiguous() and not tensor.is_neg():
        return ctypes.string_at(tensor.data_ptr(), nbytes)
    return _host_bytes(tensor)[1].tobytes()


class _Replaying:
    """What an ormsgpack hook made, in order, replayed on a second pass over the same value
    (`again`) so that no tensor is placed, collected or built twice."""

    __slots__ = ("_replay", "error", "made")

    def __init__(self) -> None:
        #: The exception raised inside the hook (ormsgpack replaces it with its own).
        self.error: Exception | None = None
        self.made: list[Any] = []
        self._replay: list[Any] = []

    def again(self) -> None:
        self._replay = self.made[::-1]
        self.made = []
        self.error = None

    def _once(self, make: Callable[..., Any], *args: Any) -> Any:
        if self._replay:
            out = self._replay.pop()
        else:
            try:
                out = make(*args)
            except Exception as exc:
                self.error = exc
                raise
        self.made.append(out)
        return out


class _Encoder(_Replaying):
    """Per-call state of `encode`: the ormsgpack ``default=`` hook and what it collects."""

    __slots__ = (
        "_compression",
        "_config",
        "_count",
        "_off_loop",
        "_placed",
        "_placer",
        "buffers",
        "keepalive",
    )

    def __init__(
        self,
        config: CodecConfig,
        placer: TensorPlacer | None,
        compression: Compression | None = None,
        off_loop: int = 0,
    ) -> None:
        super().__init__()
        self._config = config
        self._placer = placer
        self._compression = compression
        self._off_loop = off_loop
        self._placed = 0
        self._count = 0
        self.buffers: list[memoryview] = []
        self.keepalive: list[object] = []

    def _ext(self, obj: object) -> ormsgpack.Ext:
        if not _arrays_loaded:
            # No value is a tensor or an array before torch or numpy is imported.
            if "torch" not in sys.modules and "numpy" not in sys.modules:
                raise EncodeError(f"cannot encode a value of type {_type_name(obj)}")
            _load_arrays()
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj)
        raise EncodeError(f"cannot encode a value of type {_type_name(obj)}")

    def _one_more(self) -> None:
        self._count += 1
        if self._count > self._config.max_tensors:
            raise EncodeError(
                f"message has more than max_tensors={self._config.max_tensors} tensors"
            )

    def _check_size(self, nbytes: int, shape: list[int]) -> None:
        if len(shape) > _MAX_RANK:
            raise EncodeError(
                f"tensor of rank {len(shape)} is over the wire's limit of {_MAX_RANK}"
            )
        if nbytes > self._config.max_tensor_bytes:
            raise EncodeError(
                f"tensor of shape {shape} has {nbytes} bytes, over "
                f"max_tensor_bytes={self._config.max_tensor_bytes}"
            )

    def _tensor(self, tensor: torch.Tensor) -> ormsgpack.Ext:
        self._one_more()
        dtype = tensor.dtype
        name = _TORCH_NAMES.get(dtype)
        if name is None or tensor.layout is not _STRIDED or tensor.is_nested:
            raise EncodeError(_tensor_kind_error(tensor))
        if tensor.requires_grad:
            tensor = tensor.detach()
        shape = list(tensor.shape)
        nbytes = tensor.nbytes
        if nbytes > self._config.max_tensor_bytes or len(shape) > _MAX_RANK:
            self._check_size(nbytes, shape)
        if nbytes >= self._config.inline_threshold and self._placer is not None:
            placed = self._placer.place(tensor)
            if placed is not None:
                self._placed += 1
                self.keepalive.append(tensor)
                return ormsgpack.Ext(_TORCH, _handle_descriptor(name, shape, placed))
        if not tensor.is_cpu:
            tensor = self._to_host(tensor)
        elif nbytes < self._config.inline_threshold:
            data = _inline_bytes(tensor, nbytes)
            return ormsgpack.Ext(_TORCH, ormsgpack.packb([name, shape, _INLINE, data]))
        elif nbytes and dtype in _CASTABLE and tensor.is_contiguous():
            try:  # _host_bytes's first route, in place (the common case)
                view = tensor.numpy().data.cast("B")
            except RuntimeError:
                pass
            else:
                return ormsgpack.Ext(_TORCH, self._descriptor(name, shape, nbytes, tensor, view))
        owner, view = _host_bytes(tensor)
        return ormsgpack.Ext(_TORCH, self._descriptor(name, shape, nbytes, owner, view))

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        device = tensor.device
        if device.type == "cpu":
            return tensor
        if device.type == "meta":
            raise EncodeError("cannot encode a tensor on the meta device: it has no data")
        if not self._config.allow_cuda_copy:
            raise EncodeError(
                f"a tensor on device '{device}' must be copied to host memory to travel in "
                "the payload or in a frame; pass CodecConfig(allow_cuda_copy=True) to allow "
                "that copy, move it with .cpu() yourself, or use the torch_shm transport"
            )
        return tensor.to("cpu")

    def _descriptor(
        self, name: str, shape: list[int], nbytes: int, owner: object, view: memoryview
    ) -> bytes:
        if nbytes < self._config.inline_threshold:
            return ormsgpack.packb([name, shape, _INLINE, view.tobytes()])
        compression = self._compression
        if compression is not None and nbytes >= compression.min_bytes:
            if self._off_loop:
                self._off_loop -= nbytes  # left to compress on the loop
                if self._off_loop <= 0 and not self._placed:
                    raise OffLoop
            packed = _compression.compress(view, compression)
            if packed is not None:
                self.buffers.append(memoryview(packed))
                return ormsgpack.packb([name, shape, _ZSTD_FRAME, len(self.buffers) - 1])
        self.buffers.append(view)
        self.keepalive.append(owner)
        return ormsgpack.packb([name, shape, _FRAME, len(self.buffers) - 1])

    def _ndarray(self, array: np.ndarray[Any, Any]) -> ormsgpack.Ext:
        self._one_more()
        if isinstance(array, np.ma.MaskedArray):
            raise EncodeError("cannot encode a numpy masked array; use .filled() or send the mask")
        dtype = array.dtype
        name = _NUMPY_NAMES.get(dtype)
        if name is None:
            if dtype.isnative or dtype.byteorder == "|" or dtype.fields is not None:
                raise EncodeError(_numpy_dtype_error(dtype))
            # Big-endian: the wire is little-endian, so convert (one copy).
            native = dtype.newbyteorder("<")
            name = _NUMPY_NAMES.get(native)
            if name is None:
                raise EncodeError(_numpy_dtype_error(dtype))
            array = array.astype(native)
        shape = list(array.shape)
        nbytes = array.nbytes
        self._check_size(nbytes, shape)
        array = np.ascontiguousarray(array)
        if array.ndim != len(shape):  # ascontiguousarray turns 0-d arrays into 1-d ones
            array = array.reshape(shape)
        if (
            nbytes >= self._config.inline_threshold
            and self._placer is not None
            and array.flags.writeable
        ):
            placed = self._placer.place(torch.from_numpy(array))
            if placed is not None:
                self._placed += 1
                self.keepalive.append(array)
                return ormsgpack.Ext(_NUMPY, _handle_descriptor(name, shape, placed))
        view = array.reshape(-1).view(np.uint8).data
        return ormsgpack.Ext(_NUMPY, self._descriptor(name, shape, nbytes, array, view))


def _handle_descriptor(name: str, shape: list[int], placed: object) -> bytes:
    """The descriptor of a placed tensor; checks the placer's answer like a receiver would."""
    if not (
        isinstance(placed, tuple)
        and len(placed) == 2
        and type(placed[0]) is str
        and 0 < len(placed[0]) <= _MAX_TRANSPORT_NAME
        and type(placed[1]) is bytes
        and len(placed[1]) <= _MAX_HANDLE_BYTES
    ):
        raise EncodeError(
            f"a tensor placer returned {placed!r:.100}; expected (transport name of 1 to "
            f"{_MAX_TRANSPORT_NAME} chars, handle of at most {_MAX_HANDLE_BYTES} bytes) or None"
        )
    return ormsgpack.packb([name, shape, _HANDLE, list(placed)])


class _EncodeHook:
    """The ``default=`` hook of one `encode`: makes its `_Encoder` when first called, so
    that a payload without tensors or arrays (most small calls) makes none."""

    __slots__ = ("_compression", "_config", "_off_loop", "_placer", "encoder")

    def __init__(
        self,
        config: CodecConfig,
        placer: TensorPlacer | None,
        compression: Compression | None,
        off_loop: int,
    ) -> None:
        self._config = config
        self._placer = placer
        self._compression = compression
        self._off_loop = off_loop
        self.encoder: _Encoder | None = None

    def __call__(self, obj: object) -> ormsgpack.Ext:
        encoder = self.encoder
        if encoder is None:
            encoder = self.encoder = _Encoder(
                self._config, self._placer, self._compression, self._off_loop
            )
        ext: ormsgpack.Ext = encoder._once(encoder._ext, obj)
        return ext


def _type_name(obj: object) -> str:
    cls = type(obj)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _tensor_kind_error(tensor: torch.Tensor) -> str:
    if tensor.is_quantized:
        return f"cannot encode a quantized tensor ({tensor.dtype}); call .dequantize() first"
    if tensor.layout is not torch.strided or tensor.is_nested:
        kind = "nested" if tensor.is_nested else str(tensor.layout)
        return (
            f"cannot encode a {kind} tensor; only dense (strided) tensors are supported "
            "(call .to_dense() first)"
        )
    return f"cannot encode a tensor of unsupported dtype {tensor.dtype}"


#: numpy dtype kind -> what to call an array of it that cannot travel.
_NUMPY_KINDS: Final = {"O": "object", "S": "string", "U": "string", "a": "string", "V": "void"}


def _numpy_dtype_error(dtype: np.dtype[Any]) -> str:
    if dtype.fields is None and dtype.kind in "fc":
        return (
            f"cannot encode a numpy array of dtype {dtype} ({dtype.itemsize} bytes): extended "
            "precision has no portable byte layout; convert it to float64/complex128"
        )
    what = "structured" if dtype.fields is not None else _NUMPY_KINDS.get(dtype.kind, "non-numeric")
    return (
        f"cannot encode a numpy array of {what} dtype {dtype!r}; only bool, int, uint, "
        "float and complex arrays are supported"
    )


def frame_limit(config: CodecConfig) -> int:
    """The largest frame (a payload or one tensor's bytes) a receiver with ``config``
    accepts: its socket's ``maxmsgsize``, announced in its handshake."""
    return max(config.max_tensor_bytes, config.max_payload_bytes)


def check_message_size(
    encoded: Encoded, own_limit: int, peer_limit: int, describe: Callable[[], tuple[str, str]]
) -> None:
    """Refuse (`EncodeError`) a message with a frame over the smaller positive
    ``maxmsgsize`` of both ends (ZMQ would drop the whole connection without a word).

    ``own_limit`` is our socket's (<= 0: none), ``peer_limit`` the peer's handshake's (0:
    none); ``describe`` is called only to word the error: what the message carries
    (``"Calc.add: the arguments"``) and how to name the peer (``"engine 'e1'"``).
    """
    peer_wins = peer_limit > 0 and (own_limit <= 0 or peer_limit < own_limit)
    limit = peer_limit if peer_wins else own_limit
    if limit <= 0:
        return
    size = len(encoded.payload)
    if size <= limit:
        for buffer in encoded.buffers:
            if buffer.nbytes > limit:
                size = buffer.nbytes
                break
        else:
            return
    what, peer = describe()
    why = (
        f"{peer} takes at most its maxmsgsize={peer_limit}"
        if peer_wins
        else f"socket_options.maxmsgsize={own_limit}"
    )
    if len(encoded.payload) > limit:
        raise EncodeError(f"{what} take {size} encoded bytes, over the largest message ({why})")
    raise EncodeError(f"{what} include a tensor of {size} bytes, over the largest message ({why})")


def encode(
    value: object,
    config: CodecConfig = DEFAULT,
    *,
    placer: TensorPlacer | None = None,
    compression: Compression | None = None,
    off_loop: int = 0,
) -> Encoded:
    """Encode ``value`` into a msgpack payload and out-of-band tensor buffers.

    ``placer`` is offered every tensor of at least ``config.inline_threshold`` bytes (one
    it takes travels by handle, never compressed); ``compression`` compresses the payload
    and tensor frames of at least its ``min_bytes``. Keep ``Encoded.keepalive`` alive until
    the buffers have been sent.

    Raises:
        OffLoop: ``off_loop`` is positive, the payload and frames to compress add up to
            at least ``off_loop`` bytes and ``placer`` placed nothing (then encode again,
            off the loop, without a placer). At most ``off_loop`` bytes were compressed.
        EncodeError: Unsupported type or dtype, sparse/quantized/meta tensor, a device
            tensor without ``allow_cuda_copy``, or a limit exceeded.
        TensorTransportError: The placer failed.
    """
    off_loop = off_loop if compression else 0
    hook = _EncodeHook(config, placer, compression, off_loop)
    try:
        payload = ormsgpack.packb(value, default=hook, option=_PACK_OPTIONS)
    except TypeError as exc:  # MsgpackEncodeError is TypeError in ormsgpack 1.13
        if hook.encoder is not None and hook.encoder.error is not None:
            raise hook.encoder.error from None
        if str(exc) != _NOT_STR_KEY:
            raise EncodeError(f"cannot encode value: {exc}") from exc
        payload = _encode_int_keys(value, hook)
    encoder = hook.encoder
    if len(payload) > config.max_payload_bytes:
        raise EncodeError(
            f"payload of {len(payload)} bytes is over max_payload_bytes="
            f"{config.max_payload_bytes} (lower inline_threshold or send less)"
        )
    budget = config.max_payload_objects
    if len(payload) > budget and count_msgpack_objects(payload, budget) > budget:
        raise EncodeError(
            f"payload holds more than max_payload_objects={budget} values; the receiver "
            "refuses it (send long lists of numbers as a tensor)"
        )
    if compression is not None and len(payload) >= compression.min_bytes:
        if encoder is not None:
            off_loop, placed = encoder._off_loop, encoder._placed
        else:
            placed = 0
        if off_loop and off_loop <= len(payload) and not placed:
            raise OffLoop
        packed = _compression.compress(payload, compression)
        if packed is not None:
            payload = ormsgpack.packb(ormsgpack.Ext(_ZSTD_EXT, packed))
    if encoder is None:
        return Encoded(payload, [], [])
    return Encoded(payload, encoder.buffers, encoder.keepalive)


#: ormsgpack's refusal of a map key that is not a str (without OPT_NON_STR_KEYS).
_NOT_STR_KEY: Final = "Dict key must be str"


def _encode_int_keys(value: object, hook: _EncodeHook) -> bytes:
    """The cold second pass for a value with int map keys (``dict[int, T]``), which cost
    ormsgpack more per key; the tensors the first pass met are replayed, not placed again."""
    bad = _bad_key(value)
    if bad is not None:
        raise EncodeError(
            f"cannot encode a map key of type {_type_name(bad[0])}; map keys are str or int"
        )
    if hook.encoder is not None:
        hook.encoder.again()
    try:
        return ormsgpack.packb(value, default=hook, option=_INT_KEY_OPTIONS)
    except TypeError as exc:
        if hook.encoder is not None and hook.encoder.error is not None:
            raise hook.encoder.error from None
        raise EncodeError(f"cannot encode value: {exc}") from exc


def _bad_key(value: object) -> tuple[object] | None:
    """``(key,)`` for the first map key in maps, lists and tuples that is neither a str nor
    an int (a bool is neither), or None; each container is looked into once."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if not isinstance(item, (dict, list, tuple)) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            for key in item:
                if type(key) is not str and type(key) is not int:
                    return (key,)
            stack.extend(item.values())
        else:
            stack.extend(item)
    return None


def _check_shape(shape: object, itemsize: int) -> tuple[tuple[int, ...], int]:
    """Validate a shape from the wire; return it as a tuple with its element count."""
    if type(shape) is list and len(shape) == 1:  # the common case, checked alike
        dim = shape[0]
        if type(dim) is int and dim >= 0 and dim * itemsize <= _MAX_EXTENT_BYTES:
            return (dim,), dim
    if type(shape) is not list or len(shape) > _MAX_RANK:
        raise DecodeError(f"tensor shape must be a list of at most {_MAX_RANK} ints")
    numel = 1
    extent = itemsize
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise DecodeError(f"tensor shape {shape!r} must hold non-negative ints")
        numel *= dim
        if dim > 1:
            extent *= dim
            if extent > _MAX_EXTENT_BYTES:
                raise DecodeError(f"tensor shape {shape!r} is too large")
    return tuple(shape), numel


def _byte_view(buffer: object) -> memoryview:
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as exc:
        raise DecodeError(f"buffer of type {type(buffer).__qualname__} is not a buffer") from exc
    if not view.c_contiguous:
        raise DecodeError("buffer is not C-contiguous")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _entry_once_loaded(dtype_name: str, as_numpy: bool) -> _DecodeEntry:
    """The decode entry of a dtype not in the tables: they may not be filled in yet."""
    if not _arrays_loaded:
        _load_arrays()
        entry = (_NUMPY_DECODE if as_numpy else _TORCH_DECODE).get(dtype_name)
        if entry is not None:
            return entry
    raise DecodeError(f"tensor dtype {dtype_name!r} is not allowed")


def _torch_on(
    view: memoryview | bytearray, dtype: torch.dtype, align: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor on ``view``'s writable memory (no copy when it is ``align``-ed)."""
    tensor = torch.frombuffer(view, dtype=dtype)
    if tensor.data_ptr() % align:
        tensor = torch.frombuffer(bytearray(view), dtype=dtype)
    return tensor if len(shape) == 1 else tensor.view(shape)


class _Decoder(_Replaying):
    """Per-call state of `decode`: the ormsgpack ``ext_hook`` and frame bookkeeping."""

    __slots__ = ("_buffers", "_config", "_count", "_resolver", "used")

    def __init__(
        self,
        buffers: Sequence[Buffer],
        config: CodecConfig,
        resolver: TensorResolver | None,
    ) -> None:
        super().__init__()
        self._buffers = buffers
        self._config = config
        self._resolver = resolver
        self._count = 0
        #: Indices of the buffers referenced so far.
        self.used: set[int] = set()

    def ext_hook(self, code: int, data: bytes) -> object:
        return self._once(self._ext, code, data)

    def _ext(self, code: int, data: bytes) -> object:
        if code == _TORCH:
            as_numpy = False
        elif code == _NUMPY:
            as_numpy = True
        else:
            raise DecodeError(f"unknown msgpack ext code {code}")
        self._count += 1
        config = self._config
        if self._count > config.max_tensors:
            raise DecodeError(f"message has more than max_tensors={config.max_tensors} tensors")
        # The descriptor [dtype, shape, loc, ref], checked before anything is built.
        try:
            desc = ormsgpack.unpackb(data)
        except ValueError as exc:  # MsgpackDecodeError is ValueError in ormsgpack 1.13
            raise DecodeError(f"malformed tensor descriptor: {exc}") from exc
        if type(desc) is not list or len(desc) != 4:
            raise DecodeError("tensor descriptor must be [dtype, shape, loc, ref]")
        dtype_name, raw_shape, loc, ref = desc
        if type(dtype_name) is not str:
            raise DecodeError("tensor dtype must be a string")
        entry = (_NUMPY_DECODE if as_numpy else _TORCH_DECODE).get(dtype_name)
        if entry is None:
            entry = _entry_once_loaded(dtype_name, as_numpy)
        torch_dtype = entry[0]
        itemsize = entry[2]
        shape, numel = _check_shape(raw_shape, itemsize)
        nbytes = numel * itemsize
        if nbytes > config.max_tensor_bytes:
            raise DecodeError(
                f"tensor of shape {list(shape)} has {nbytes} bytes, over "
                f"max_tensor_bytes={config.max_tensor_bytes}"
            )
        if type(loc) is not int:
            raise DecodeError("tensor location must be an int")
        if loc == _HANDLE:
            return self._resolve(ref, torch_dtype, shape, as_numpy)
        return self._build(dtype_name, entry, shape, numel, loc, ref, as_numpy)

    def _build(
        self,
        dtype_name: str,
        entry: _DecodeEntry,
        shape: tuple[int, ...],
        numel: int,
        loc: int,
        ref: object,
        as_numpy: bool,
    ) -> object:
        """A tensor (or array) on bytes sent inline or in a frame (descriptor checked)."""
        torch_dtype, np_dtype, itemsize, align = entry
        nbytes = numel * itemsize
        data: bytes | memoryview
        if loc == _FRAME:
            data = self._frame(ref)
        elif loc == _INLINE:
            if type(ref) is not bytes:
                raise DecodeError("inline tensor data must be bytes")
            data = ref
        elif loc == _ZSTD_FRAME:
            # Into exactly the tensor's size: a frame that would expand further is refused.
            data = memoryview(_compression.decompress_exact(self._frame(ref), nbytes))
        else:
            raise DecodeError(f"unknown tensor location {loc}")
        if len(data) != nbytes:
            raise DecodeError(
                f"tensor of dtype {dtype_name} and shape {list(shape)} needs {nbytes} bytes, "
                f"got {len(data)}"
            )
        if numel == 0:
            if as_numpy:
                return np.empty(shape, dtype=np_dtype)
            return torch.empty(0, dtype=torch.uint8).view(torch_dtype).reshape(shape)
        # torch has no read-only tensors (frombuffer would warn and hand out a tensor that
        # can write to immutable memory), so read-only bytes (inline ones too) are copied
        # once; numpy follows suit.
        view = data if type(data) is memoryview and not data.readonly else bytearray(data)
        if np_dtype is None or (not as_numpy and len(shape) == 1):
            return _torch_on(view, torch_dtype, align, shape)
        array: np.ndarray[Any, Any] = np.frombuffer(view, dtype=np_dtype)
        if not array.flags.aligned:
            array = np.frombuffer(bytearray(view), dtype=np_dtype)
        array = array.reshape(shape)
        return array if as_numpy else torch.from_numpy(array)

    def _frame(self, ref: object) -> memoryview:
        if type(ref) is not int or not 0 <= ref < len(self._buffers):
            raise DecodeError(
                f"tensor frame index {ref!r} out of range ({len(self._buffers)} buffers)"
            )
        if ref in self.used:
            raise DecodeError(f"tensor frame {ref} referenced twice")
        self.used.add(ref)
        return _byte_view(self._buffers[ref])

    def _resolve(
        self,
        ref: object,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        as_numpy: bool,
    ) -> object:
        if type(ref) is not list or len(ref) != 2:
            raise DecodeError("tensor handle must be [transport, handle]")
        transport, handle = ref
        if type(transport) is not str or not 0 < len(transport) <= _MAX_TRANSPORT_NAME:
            raise DecodeError("tensor transport name must be a short non-empty string")
        if type(handle) is not bytes or len(handle) > _MAX_HANDLE_BYTES:
            raise DecodeError(f"tensor handle must be at most {_MAX_HANDLE_BYTES} bytes")
        if self._resolver is None:
            raise DecodeError(
                f"tensor sent by handle through transport {transport!r}, but no resolver "
                "was given to decode()"
            )
        tensor = self._resolver.resolve(transport, handle, dtype, shape)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.shape != shape:
            raise DecodeError(
                f"transport {transport!r} resolved a handle to the wrong tensor "
                f"(expected {dtype} {list(shape)})"
            )
        if not as_numpy:
            return tensor
        if tensor.device.type != "cpu":
            raise DecodeError(f"transport {transport!r} resolved a numpy array off the CPU")
        if tensor.requires_grad:
            tensor = tensor.detach()
        return tensor.numpy()


class _DecodeHook:
    """The ``ext_hook`` of one `decode`: makes its `_Decoder` when first called, so that a
    payload without tensors or arrays (most small calls) makes none."""

    __slots__ = ("_buffers", "_config", "_resolver", "decoder")

    def __init__(
        self, buffers: Sequence[Buffer], config: CodecConfig, resolver: TensorResolver | None
    ) -> None:
        self._buffers = buffers
        self._config = config
        self._resolver = resolver
        self.decoder: _Decoder | None = None

    def __call__(self, code: int, data: bytes) -> object:
        decoder = self.decoder
        if decoder is None:
            decoder = self.decoder = _Decoder(self._buffers, self._config, self._resolver)
        return decoder._once(decoder._ext, code, data)


def _compressed_payload(view: memoryview) -> memoryview | None:
    """The zstd frame of a compressed payload (one ``ExtCode.ZSTD`` Ext), or None."""
    width = _EXT_HEADERS.get(view[0]) if view.nbytes else None
    if width is None or view.nbytes < 2 + width or view[1 + width] != _ZSTD_EXT:
        return None
    length = int.from_bytes(view[1 : 1 + width], "big")
    if length != view.nbytes - 2 - width:
        raise DecodeError("a compressed payload must be one ext, with nothing after it")
    return view[2 + width :]


def compressed_bytes(payload: Buffer, buffers: Sequence[Buffer]) -> int:
    """How many bytes decoding this message would decompress, as far as its bytes tell
    without decoding it: the size a compressed payload declares, plus the size each
    buffer that looks like a zstd frame declares. The shell decodes a message worth it
    off the loop; a wrong guess costs only that, `decode` checks everything itself."""
    total = 0
    try:
        view = memoryview(payload)
        # a compressed payload starts with an ext header (checked here: the hot path)
        if view.ndim == 1 and view.itemsize == 1 and view.nbytes and view[0] in _EXT_HEADERS:
            packed = _compressed_payload(view)
            if packed is not None:
                total += _compression.content_size(packed)
    except (TypeError, DecodeError):
        pass
    for buffer in buffers:
        total += _compression.content_size(buffer)
    return total


def _payload_view(payload: Buffer, n_buffers: int, config: CodecConfig) -> memoryview:
    """``payload`` as a 1-D byte view (decompressed), checked against the limits."""
    try:
        view = memoryview(payload)
    except TypeError as exc:
        raise DecodeError(f"payload of type {type(payload).__qualname__} is not a buffer") from exc
    if view.ndim != 1 or view.itemsize != 1:
        view = _byte_view(view)
    packed = _compressed_payload(view) if view.nbytes and view[0] in _EXT_HEADERS else None
    if packed is not None:
        size = _compression.declared_size(packed, config.max_payload_bytes)
        view = memoryview(_compression.decompress_exact(packed, size))
    if view.nbytes > config.max_payload_bytes:
        raise DecodeError(
            f"payload of {view.nbytes} bytes is over max_payload_bytes={config.max_payload_bytes}"
        )
    if n_buffers > config.max_tensors:
        raise DecodeError(
            f"message has {n_buffers} buffers, more than max_tensors={config.max_tensors}"
        )
    budget = config.max_payload_objects
    # At most one object per byte: only a payload larger than the budget needs counting.
    if view.nbytes > budget and count_msgpack_objects(view, budget) > budget:
        raise DecodeError(
            f"payload holds more than max_payload_objects={budget} msgpack values "
            f"({view.nbytes} bytes); refused before decoding"
        )
    return view


def _decode_int_keys(exc: ValueError, hook: _DecodeHook, framed: bytes) -> Any:
    """The cold second pass for a payload ormsgpack refused, which may have int map keys:
    admits them, replaying the tensors the first pass built. Any other key is a value the
    peer may not send (``ValidationError``: ``INVALID_ARGUMENT``), not a corrupt one."""
    decoder = hook.decoder
    if decoder is not None:
        if decoder.error is not None:
            raise decoder.error from None
        decoder.again()
    try:
        value = ormsgpack.unpackb(framed, ext_hook=hook, option=ormsgpack.OPT_NON_STR_KEYS)
    except (ValueError, TypeError) as again:
        if hook.decoder is not None and hook.decoder.error is not None:
            raise hook.decoder.error from None
        raise DecodeError(f"malformed msgpack payload: {exc}") from again
    bad = _bad_key(value)
    if bad is not None:
        raise ValidationError(
            f"a map in the payload has a key of type {_type_name(bad[0])}; map keys are "
            "str (parameter names, dataclass fields, dict[str, ...]) or int (dict[int, ...])"
        )
    return value


def decode(
    payload: Buffer,
    buffers: Sequence[Buffer] = (),
    config: CodecConfig = DEFAULT,
    *,
    resolver: TensorResolver | None = None,
) -> Any:
    """Decode a payload and its out-of-band buffers (each referenced exactly once).

    Tensors are built on writable ``buffers`` without copying (a read-only one is copied
    once: torch has no read-only tensors) and keep them alive; ``resolver`` resolves
    tensors sent by handle. Arrays come back as lists, maps (dataclasses) as dicts.

    Raises:
        DecodeError: Malformed msgpack, a bad descriptor, a dtype not allowed, sizes that
            do not match or exceed the limits, bad frame indices, unreferenced buffers.
        ValidationError: A map key that is neither a str nor an int (a value a peer may
            not send: an engine answers ``INVALID_ARGUMENT``).
        TensorTransportError: The resolver failed.
    """
    view = _payload_view(payload, len(buffers), config)
    hook = _DecodeHook(buffers, config, resolver)
    # ormsgpack ignores bytes after the first object; frame the payload as the array
    # [payload, END] so that anything after the object (or a truncated object) fails.
    framed = b"".join((b"\x92", view, _END_MARK))
    try:
        framed_value = ormsgpack.unpackb(framed, ext_hook=hook)
    except ValueError as exc:  # MsgpackDecodeError is ValueError in ormsgpack 1.13
        framed_value = _decode_int_keys(exc, hook, framed)
    end = framed_value[1]
    if type(end) is not bytes or end != _END_NONCE:
        raise DecodeError("trailing bytes after the msgpack payload")
    used = 0 if hook.decoder is None else len(hook.decoder.used)
    if used != len(buffers):
        raise DecodeError(f"message has {len(buffers)} buffers but references {used}")
    return framed_value[0]
