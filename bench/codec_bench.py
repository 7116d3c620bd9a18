"""Codec benchmark: encode + decode of a vLLM EngineCoreRequest-shaped message.

Three serializers encode and decode the same request in the same run:

* ``tensorrpc``: :func:`tensorrpc._codec.encode` / :func:`~tensorrpc._codec.decode` on
  dataclasses (decode yields plain dicts/lists plus tensors). When the schema module is
  available a second row, ``tensorrpc+schema``, also converts the decoded value back into
  the typed dataclasses (``CompiledType.from_wire``), the work msgspec's typed decode does.
* ``msgspec``: typed ``msgspec.Struct`` classes, as vLLM uses (``array_like``,
  ``omit_defaults``, ``gc=False`` for the request, as in ``vllm/v1/engine/__init__.py``).
  Tensors follow vLLM's ``MsgpackEncoder``: an ``enc_hook`` turns a tensor into
  ``(dtype, shape, data)`` where ``data`` is the raw bytes for small tensors and the index
  of an out-of-band buffer (the tensor's memory, not copied) for large ones; the decoder's
  ``dec_hook`` rebuilds the tensor on that buffer. The hooks keep their buffer list on the
  encoder/decoder instance exactly like vLLM does (fine in a single-threaded benchmark).
* ``tensorrpc+recv``: the codec plus the schema's receive-side validation only
  (``from_wire``), no send-side check: the same validation as msgspec's typed decode, which
  checks on receipt and never on encode. ``tensorrpc+schema`` is the full cost tensorrpc
  pays (its send side also checks the value, which msgspec's line does not do).
* ``tensorrpc+convert``: as ``tensorrpc+schema``, but the receiving side validates and
  converts with ``msgspec.convert`` instead of the schema (the decision in issue 23: the
  faster of the two validates).
* ``tensorrpc+msgspec``: as ``tensorrpc+schema``, but the receiving side decodes tensorrpc's
  own payload with msgspec's typed decoder (the codec's limits, Ext hook and frame count
  kept): what decode + validation would cost if msgspec parsed and validated in one pass.
* ``pickle5``: ``pickle.dumps(protocol=5, buffer_callback=...)`` with out-of-band buffers.
  Tensors are reduced to ``torch.from_numpy(ndarray)`` so that their bytes travel out of
  band as ``PickleBuffer``\\ s (torch's own reducer copies them in band). This file is the
  only place in tensorrpc where pickle appears, and only as a peer to compare against.

Cases: ``ids-list`` (2048 prompt token ids as ``list[int]``), ``ids-tensor`` (the ids as an
int64 tensor, 16 KiB, out of band), ``embeds`` (ids as a list plus a 10x4096 float16
``prompt_embeds`` tensor, 80 KiB, out of band). Figures are medians of per-call CPU times
(this process's CPU clock, so that other work on a loaded machine counts less) in
microseconds, measured over batches (the timer's own cost is amortised over a batch).

What each side checks: msgspec's decode checks every type and int range (bool is not an
int), builds the Structs and the enum member, and rebuilds tensors from the peer's dtype
and shape without checking them (vLLM's hook). The schema's ``from_wire`` does the same on
decoded values (int accepted for float, as msgspec does) and the codec also validates each
tensor descriptor (dtype allowlist, shape against bytes, frame references). msgspec's
payload is smaller (``array_like``, ``omit_defaults``); tensorrpc's is maps of every field.

Run: ``python -m bench.codec_bench`` (``--quick`` for a short run). To compare an older
checkout's codec and schema with this benchmark, run this file with that checkout on
``PYTHONPATH``, alternating with the current one::

    cd OLD && PYTHONPATH=$PWD python /path/to/bench/codec_bench.py
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import io
import pickle
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from tensorrpc import DecodeError, _codec
from tensorrpc._schema import guarded

__all__ = ["run"]

PROMPT_LEN = 2048
EMBEDS_SHAPE = (10, 4096)
#: Ratio to msgspec's encode + decode that codec + validation (tensorrpc+schema) aims for.
TARGET_RATIO = 1.5


# --- the message, as tensorrpc dataclasses ----------------------------------------------


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclasses.dataclass(slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int] | None
    prompt_token_tensor: torch.Tensor | None
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    lora_name: str | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: torch.Tensor | None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0


# --- the same message as msgspec Structs (vLLM's shape) ------------------------------


class MsSamplingParams(msgspec.Struct, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


class MsEngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int] | None
    prompt_token_tensor: torch.Tensor | None
    sampling_params: MsSamplingParams
    eos_token_id: int | None
    arrival_time: float
    lora_name: str | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: torch.Tensor | None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0


_MS_INLINE_THRESHOLD = 256  # vLLM's default VLLM_MSGPACK_ZERO_COPY_THRESHOLD


class MsgspecPeer:
    """vLLM ``MsgpackEncoder``/``MsgpackDecoder`` reduced to what this message needs."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self.decoder = msgspec.msgpack.Decoder(MsEngineCoreRequest, dec_hook=self._dec_hook)
        self.aux_buffers: list[Any] = []

    def encode(self, obj: MsEngineCoreRequest) -> list[Any]:
        self.aux_buffers = bufs = [b""]
        bufs[0] = self.encoder.encode(obj)
        return bufs

    def decode(self, bufs: list[Any]) -> MsEngineCoreRequest:
        self.aux_buffers = bufs
        try:
            result: MsEngineCoreRequest = self.decoder.decode(bufs[0])
            return result
        finally:
            self.aux_buffers = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            arr = obj.contiguous().view(torch.uint8).numpy()
            if obj.nbytes < _MS_INLINE_THRESHOLD:
                data: Any = msgspec.msgpack.Ext(1, arr.tobytes())
            else:
                data = len(self.aux_buffers)
                self.aux_buffers.append(arr.data)
            return str(obj.dtype).removeprefix("torch."), list(obj.shape), data
        raise NotImplementedError(type(obj))

    def _dec_hook(self, t: type, obj: Any) -> Any:
        if t is torch.Tensor:
            dtype, shape, data = obj
            buf = data.data if isinstance(data, msgspec.msgpack.Ext) else self.aux_buffers[data]
            torch_dtype = getattr(torch, dtype)
            if not memoryview(buf).nbytes:
                return torch.empty(shape, dtype=torch_dtype)
            arr = torch.frombuffer(
                bytearray(buf) if isinstance(buf, bytes) else buf, dtype=torch.uint8
            )
            return arr.view(torch_dtype).view(shape)
        raise NotImplementedError(t)


# --- pickle protocol 5 peer (bench only) ---------------------------------------------


class _TensorPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return torch.from_numpy, (obj.detach().contiguous().numpy(),)
        return NotImplemented


def pickle_encode(obj: object) -> list[Any]:
    buffers: list[Any] = []
    stream = io.BytesIO()
    _TensorPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    return [stream.getvalue(), *(b.raw() for b in buffers)]


def pickle_decode(frames: list[Any]) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


# --- cases ---------------------------------------------------------------------------


def _make_request(case: str) -> tuple[EngineCoreRequest, MsEngineCoreRequest]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, size=PROMPT_LEN).tolist()
    ids_tensor = torch.tensor(ids, dtype=torch.int64) if case == "ids-tensor" else None
    ids_list = None if case == "ids-tensor" else ids
    embeds = torch.randn(EMBEDS_SHAPE).to(torch.float16) if case == "embeds" else None
    sp = SamplingParams(
        temperature=0.7,
        top_p=0.95,
        top_k=50,
        seed=1234,
        stop=["</s>", "\n\n"],
        stop_token_ids=[2, 32000],
        max_tokens=512,
        logprobs=5,
        output_kind=RequestOutputKind.DELTA,
    )
    req = EngineCoreRequest(
        request_id="cmpl-3f2a9c1e6b7d4e5f8a0b1c2d3e4f5a6b-0",
        prompt_token_ids=ids_list,
        prompt_token_tensor=ids_tensor,
        sampling_params=sp,
        eos_token_id=2,
        arrival_time=1_732_000_000.123456,
        lora_name=None,
        cache_salt=None,
        data_parallel_rank=None,
        prompt_embeds=embeds,
        client_index=0,
        current_wave=3,
        priority=0,
    )
    ms_sp = MsSamplingParams(**dataclasses.asdict(sp))
    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    fields["sampling_params"] = ms_sp
    return req, MsEngineCoreRequest(**fields)


def _time_interleaved(
    fns: dict[str, Callable[[], object]], *, seconds: float, batch: int
) -> dict[str, float]:
    """Median per-call time (µs) of each function, over batches of ``batch`` calls.

    The functions take turns batch by batch for about ``seconds`` in all, so that noise
    from the rest of the machine (other processes, frequency changes) hits every system
    alike instead of whichever happened to run during a busy moment. The order is shuffled
    every round: in a fixed order a function always ran after the same neighbour, whose
    traces in the caches cost it 12-19% in ids-tensor (tensorrpc's encode measured 6.6 µs
    in its own row and 7.8 µs in ``tensorrpc+recv``'s, which ran after pickle5's decode).
    """
    for fn in fns.values():
        for _ in range(batch):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.process_time_ns
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    stop = time.perf_counter() + seconds
    rounds = 0
    while rounds < 5 or time.perf_counter() < stop:
        shuffle(order)
        for name, fn in order:
            t0 = clock()
            for _ in range(batch):
                fn()
            samples[name].append((clock() - t0) / batch / 1e3)
        rounds += 1
    return {name: statistics.median(values) for name, values in samples.items()}


def _schema_spec() -> Any:
    try:
        from tensorrpc._schema import compile_type
    except ImportError:  # pragma: no cover - the schema module is built separately
        return None
    try:
        return compile_type(EngineCoreRequest, where="bench EngineCoreRequest")
    except Exception:  # pragma: no cover - schema may not support every field yet
        return None


def _check_same(case: str, ours: Any, ms: MsEngineCoreRequest, pk: EngineCoreRequest) -> None:
    """Every peer must decode to the same values, or the comparison means nothing."""
    ours_ids = ours["prompt_token_ids"]
    assert ours_ids == ms.prompt_token_ids == pk.prompt_token_ids, case
    for name in ("prompt_token_tensor", "prompt_embeds"):
        a, b, c = ours[name], getattr(ms, name), getattr(pk, name)
        if a is None:
            assert b is None, case
            assert c is None, case
        else:
            assert torch.equal(a, b), case
            assert torch.equal(a, c), case
    assert ours["sampling_params"]["top_k"] == ms.sampling_params.top_k == 50


Pair = tuple[Callable[[], object], Callable[[], object]]


def _check_typed(case: str, req: EngineCoreRequest, systems: dict[str, Pair]) -> None:
    """Every typed decode must rebuild the request the sender had."""
    for name, (_, decode_fn) in systems.items():
        if "+" not in name:
            continue
        got = decode_fn()
        assert isinstance(got, EngineCoreRequest), (case, name)
        for f in dataclasses.fields(req):
            a, b = getattr(got, f.name), getattr(req, f.name)
            same = torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
            assert same, (case, name, f.name)
            assert type(a) is type(b), (case, name, f.name)


def _systems(
    req: EngineCoreRequest,
    ms_req: MsEngineCoreRequest,
    enc: _codec.Encoded,
    ms_peer: MsgspecPeer,
    ms_frames: list[Any],
    pk_frames: list[Any],
    spec: Any,
) -> dict[str, Pair]:
    """(encode, decode) callables per system, each bound to this case's message."""

    def ours_encode() -> object:
        return _codec.encode(req)

    def ours_decode() -> object:
        return _codec.decode(enc.payload, enc.buffers)

    def ms_encode() -> object:
        return ms_peer.encode(ms_req)

    def ms_decode() -> object:
        return ms_peer.decode(list(ms_frames))

    def pk_encode() -> object:
        return pickle_encode(req)

    def pk_decode() -> object:
        return pickle_decode(pk_frames)

    systems: dict[str, Pair] = {
        "tensorrpc": (ours_encode, ours_decode),
        "msgspec": (ms_encode, ms_decode),
        "pickle5": (pk_encode, pk_decode),
    }
    if spec is not None:
        # Built once, as the runtime builds a method's converters (_service.py).
        check = guarded(spec.fast_check, "", "req")
        from_wire = guarded(spec.fast_from_wire, "", "req")

        def typed_encode() -> object:
            return _codec.encode(check(req))

        def typed_decode() -> object:
            return from_wire(_codec.decode(enc.payload, enc.buffers))

        systems["tensorrpc+recv"] = (ours_encode, typed_decode)
        systems["tensorrpc+schema"] = (typed_encode, typed_decode)

        def convert_decode() -> object:
            value = _codec.decode(enc.payload, enc.buffers)
            return msgspec.convert(value, EngineCoreRequest, dec_hook=_keep_tensor)

        # msgspec.convert as the receiving side's validator, for comparison: it checks
        # nothing on the sending side (the schema's check stays), ignores unknown fields
        # and gives its error path as text only.
        systems["tensorrpc+convert"] = (typed_encode, convert_decode)
        typed_wire = MsgspecTypedWire()

        def msgspec_decode() -> object:
            return typed_wire.decode(enc)

        systems["tensorrpc+msgspec"] = (typed_encode, msgspec_decode)
    return systems


class MsgspecTypedWire:
    """tensorrpc's payload through msgspec's typed decoder, with what ``_codec.decode``
    checks around its parse (limits, tensor descriptors, every frame used once; msgspec
    refuses trailing bytes itself). The Ext hook reaches the call's tensor state through
    the instance, as vLLM's hooks reach their buffers."""

    def __init__(self) -> None:
        self.decoder = msgspec.msgpack.Decoder(
            EngineCoreRequest, ext_hook=self._ext_hook, dec_hook=_keep_tensor
        )
        self.tensors = _codec._Decoder([], _codec.DEFAULT, None)

    def decode(self, enc: _codec.Encoded) -> object:
        view = _codec._payload_view(enc.payload, len(enc.buffers), _codec.DEFAULT)
        self.tensors = tensors = _codec._Decoder(enc.buffers, _codec.DEFAULT, None)
        value = self.decoder.decode(view)
        if len(tensors.used) != len(enc.buffers):
            raise DecodeError("a buffer is not referenced")
        return value

    def _ext_hook(self, code: int, data: memoryview) -> object:
        return self.tensors.ext_hook(code, data)  # type: ignore[arg-type]


def _keep_tensor(tp: type, value: object) -> object:
    if tp is torch.Tensor and isinstance(value, torch.Tensor):
        return value
    raise NotImplementedError(tp)


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark and return its figures.

    Args:
        quick: A short run (for smoke tests and ``make bench`` on slow machines).

    Returns:
        ``{"unit": "us", "target_ratio": 1.5, "cases": {case: {system: {"encode",
        "decode", "total", "ratio_to_msgspec"}}}}``, medians in microseconds.
    """
    seconds = 0.3 if quick else 3.0
    batch = 10 if quick else 50
    spec = _schema_spec()
    ms_peer = MsgspecPeer()
    cases: dict[str, dict[str, dict[str, float]]] = {}
    for case in ("ids-list", "ids-tensor", "embeds"):
        req, ms_req = _make_request(case)
        enc = _codec.encode(req)
        ms_frames = ms_peer.encode(ms_req)
        pk_frames = pickle_encode(req)
        _check_same(
            case,
            _codec.decode(enc.payload, enc.buffers),
            ms_peer.decode(ms_frames),
            pickle_decode(pk_frames),
        )

        systems = _systems(req, ms_req, enc, ms_peer, ms_frames, pk_frames, spec)
        _check_typed(case, req, systems)
        fns: dict[str, Callable[[], object]] = {}
        for name, (encode_fn, decode_fn) in systems.items():
            fns[f"{name}/encode"] = encode_fn
            fns[f"{name}/decode"] = decode_fn
        medians = _time_interleaved(fns, seconds=seconds, batch=batch)
        row: dict[str, dict[str, float]] = {}
        for name in systems:
            e, d = medians[f"{name}/encode"], medians[f"{name}/decode"]
            row[name] = {"encode": e, "decode": d, "total": e + d}
        base = row["msgspec"]["total"]
        for figures in row.values():
            figures["ratio_to_msgspec"] = figures["total"] / base
        cases[case] = row
    return {"unit": "us", "target_ratio": TARGET_RATIO, "cases": cases}


def format_table(result: dict[str, Any]) -> str:
    """The figures of :func:`run` as a text table."""
    lines = [
        f"{'case':<11} {'system':<17} {'encode µs':>10} {'decode µs':>10} "
        f"{'total µs':>10} {'x msgspec':>10}"
    ]
    for case, row in result["cases"].items():
        for system, f in row.items():
            lines.append(
                f"{case:<11} {system:<17} {f['encode']:>10.2f} {f['decode']:>10.2f} "
                f"{f['total']:>10.2f} {f['ratio_to_msgspec']:>10.2f}"
            )
    lines.append(
        f"target: tensorrpc+schema (codec + validation) within {result['target_ratio']}x of msgspec"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run")
    args = parser.parse_args()
    print(format_table(run(quick=args.quick)))


if __name__ == "__main__":
    main()
