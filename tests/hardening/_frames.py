"""Hostile frame generators for the live fuzz tests: hypothesis strategies and a seeded mutator.

Everything here builds raw ZMQ message frames (``list[bytes]``, without the routing-id
frame): headers packed by hand with ``struct`` (so that every field can be wrong), codec
payloads with forged tensor descriptors, truncations and byte flips of valid messages.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import ormsgpack
from hypothesis import strategies as st

from tensorrpc import _codec
from tensorrpc._protocol import MessageKind, pack_call_header, pack_reply_header

HEADER = struct.Struct("<2sBBHHQI")

#: Kinds that legitimately end or change a session (a peer may always say BYE or REJECT,
#: an engine may re-introduce itself); the fuzzers send them only through garbage bodies.
SESSION_KINDS = frozenset({MessageKind.HELLO, MessageKind.REJECT, MessageKind.BYE})
#: Methods a fuzzed CALL may name: they never block (``block``/``sync_wait``/streams would
#: turn a valid-by-chance call into a wait), plus names that do not exist.
FUZZ_METHODS = (b"add", b"mul", b"scale", b"fail", b"bad_result", b"nope", b"", b"\xff\xfe")
#: Call ids the fuzzers use; the tests' own sentinel calls use ids from 2**62 on.
FUZZ_CALL_IDS = st.one_of(st.just(0), st.integers(1, 2**40), st.just(2**62 - 1), st.just(2**64 - 1))
SENTINEL_BASE = 2**62

DTYPES = ("float32", "int64", "bfloat16", "bool", "uint8", "complex32", "float8_e4m3fn")
BAD_DTYPES = ("object", "", "float128", "V16", "<f4", "x" * 300, "torch.float32")


def _kinds() -> st.SearchStrategy[int]:
    allowed = [int(k) for k in MessageKind if k not in SESSION_KINDS]
    return st.one_of(st.sampled_from(allowed), st.integers(0, 255).filter(lambda k: k > 14))


@st.composite
def headers(draw: st.DrawFn, kinds: st.SearchStrategy[int] | None = None) -> bytes:
    """A header frame whose every field may be valid or wrong (plus a method tail)."""
    magic = draw(st.sampled_from([b"TR", b"TR", b"TR", b"RT", b"\x00\x00"]))
    version = draw(st.sampled_from([1, 1, 1, 0, 2, 255]))
    kind = draw(kinds if kinds is not None else _kinds())
    flags = draw(st.sampled_from([0, 0, 1, 2, 3, 4, 8, 16, 0xFFFF]))
    reserved = draw(st.sampled_from([0, 0, 0, 1, 0xFFFF]))
    call_id = draw(FUZZ_CALL_IDS)
    timeout_ms = draw(st.sampled_from([0, 0, 1, 5_000, 0xFFFF_FFFF]))
    tail = draw(st.one_of(st.sampled_from(FUZZ_METHODS), st.binary(max_size=300)))
    frame = HEADER.pack(magic, version, kind, flags, reserved, call_id, timeout_ms) + tail
    cut = draw(st.sampled_from([None, None, None, 0, 1, 19]))
    return frame if cut is None else frame[:cut]


@st.composite
def forged_tensors(draw: st.DrawFn) -> Any:
    """A tensor descriptor that lies: dtype, shape, location or reference."""
    dtype = draw(st.one_of(st.sampled_from(DTYPES), st.sampled_from(BAD_DTYPES)))
    dim = st.one_of(st.integers(0, 8), st.sampled_from([-1, 2**31, 2**40, 2**62, 2**63 - 1]))
    shape = draw(
        st.one_of(
            st.lists(dim, max_size=4),
            st.lists(st.just(1), min_size=33, max_size=40),  # rank over the limit
            st.sampled_from(["4", None, [1.5], [[2]]]),
        )
    )
    loc = draw(st.sampled_from([0, 1, 2, 3, -1, "frame"]))
    ref = draw(
        st.one_of(
            st.binary(max_size=64),
            st.sampled_from([0, 1, 2, 1024, -1, 2**32]),
            st.sampled_from([["torch_shm", b"TRSH" + b"\x00" * 60], ["x" * 100, b""], [], None]),
        )
    )
    code = draw(st.sampled_from([1, 1, 1, 2, 3, 100, 127]))
    return ormsgpack.Ext(code, ormsgpack.packb([dtype, shape, loc, ref]))


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A payload frame: random bytes, msgpack of the wrong shape, or forged descriptors."""
    choice = draw(st.integers(0, 4))
    if choice == 0:
        return draw(st.binary(max_size=200))
    values = st.recursive(
        st.one_of(_leaves, forged_tensors()),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=8,
    )
    value = draw(st.lists(values, max_size=4)) if choice < 4 else draw(values)
    packed = ormsgpack.packb(value)
    if choice == 3 and packed:  # truncated or with trailing garbage
        cut = draw(st.integers(0, len(packed)))
        packed = packed[:cut] + draw(st.binary(max_size=8))
    return packed


def buffers() -> st.SearchStrategy[list[bytes]]:
    """Out-of-band frames: none, small, or more than a message may carry."""
    return st.one_of(
        st.lists(st.binary(max_size=64), max_size=3),
        st.just([b"\x00" * 16] * 5),
    )


@st.composite
def engine_bound(draw: st.DrawFn) -> list[bytes]:
    """Frames a hostile client sends to an engine."""
    family = draw(st.integers(0, 3))
    if family == 0:  # a random frame list
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
    if family == 1:  # a CALL that parses, with a hostile payload and buffers
        method = draw(st.sampled_from(["add", "mul", "scale", "fail", "nope"]))
        call_id = draw(st.integers(1, 2**40))
        header = pack_call_header(call_id, method, draw(st.sampled_from([0, 1, 2])))
        return [header, draw(payloads()), *draw(buffers())]
    frames = [draw(headers()), draw(payloads()), *draw(buffers())]
    if family == 3:  # wrong frame count
        frames = frames[: draw(st.integers(1, len(frames)))]
    return frames


@st.composite
def client_bound(draw: st.DrawFn, call_id: int) -> list[bytes]:
    """Frames a hostile engine sends to a client that has ``call_id`` in flight."""
    family = draw(st.integers(0, 3))
    target = draw(st.one_of(st.just(call_id), FUZZ_CALL_IDS))
    if family == 0:
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
    if family == 1:  # a reply to the live call with a hostile body
        kind = draw(
            st.sampled_from(
                [
                    MessageKind.RESULT,
                    MessageKind.ERROR,
                    MessageKind.STREAM_ITEM,
                    MessageKind.STREAM_END,
                ]
            )
        )
        return [pack_reply_header(kind, call_id), draw(payloads()), *draw(buffers())]
    kinds = st.sampled_from([int(k) for k in MessageKind if k not in SESSION_KINDS])
    raw = bytearray(draw(headers(kinds)))
    if len(raw) >= 20:
        raw[8:16] = target.to_bytes(8, "little")
    frames = [bytes(raw), draw(payloads()), *draw(buffers())]
    if family == 3:
        frames = frames[: draw(st.integers(1, len(frames)))]
    return frames


# -- a seeded mutator (for the memory test: many messages, no hypothesis overhead) -----------


def valid_messages() -> list[list[bytes]]:
    """A few valid CALLs to mutate (``add``; ``scale`` with an out-of-band tensor)."""
    import torch

    small = _codec.encode([1, 2])
    big = _codec.encode([torch.arange(1024, dtype=torch.float32), 2.0])
    return [
        [pack_call_header(7, "add"), small.payload],
        [pack_call_header(8, "scale"), big.payload, *(bytes(b) for b in big.buffers)],
    ]


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One random mutation: flip bytes, truncate, drop/duplicate/add a frame."""
    out = [bytearray(f) for f in frames]
    op = rng.randrange(6)
    i = rng.randrange(len(out))
    if op == 0 and out[i]:
        for _ in range(rng.randint(1, 4)):
            j = rng.randrange(len(out[i]))
            out[i][j] = rng.randrange(256)
    elif op == 1:
        del out[i][rng.randrange(len(out[i]) + 1) :]
    elif op == 2 and len(out) > 1:
        del out[i]
    elif op == 3:
        out.insert(i, bytearray(out[i]))
    elif op == 4:
        out.append(bytearray(rng.randbytes(rng.randrange(64))))
    else:
        out[i] = bytearray(rng.randbytes(rng.randrange(64)))
    # the mutator never forges a session-ending kind
    if len(out[0]) >= 4 and out[0][3] in {int(k) for k in SESSION_KINDS}:
        out[0][3] = int(MessageKind.CALL)
    return [bytes(f) for f in out]
