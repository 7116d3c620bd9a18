"""Decode bombs: a peer must cost bounded memory and CPU, whatever it sends.

msgpack spends one byte on an empty array that Python spends ~64 bytes (and the garbage
collector's time) on, so a payload of millions of empty arrays used to cost ~80x its size
in memory: 20 control messages of 4 MiB took an engine +368 MB and 35 s of CPU, a 16 MiB
CALL payload took it from 245 MB to 1.57 GB. Control bodies now have a size cap per kind
and an object budget, checked before decoding, and value payloads have an object budget
(``CodecConfig.max_payload_objects``) checked by a pre-scan before ormsgpack builds
anything. Memory is measured with tracemalloc (every Python object allocation, in this
process: the engine or client under attack runs in-process).
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import anyio
import ormsgpack
import pytest
import zmq

from tensorrpc import _codec
from tensorrpc._client import Client
from tensorrpc._codec import CodecConfig
from tensorrpc._exceptions import (
    DecodeError,
    EncodeError,
    ErrorCode,
    RemoteProtocolError,
    ValidationError,
)
from tensorrpc._protocol import (
    MAX_BODY_BYTES,
    MAX_CONTROL_OBJECTS,
    Header,
    MessageKind,
    count_msgpack_objects,
    decode_control,
    pack_call_header,
    pack_reply_header,
)
from tensorrpc._zmq import create_socket
from tests.integration.fake_engine import FakeEngine
from tests.integration.services import Calculator

from ._live import live_engine

WAIT = 20.0
MiB = 1 << 20
#: What a decode of the bomb may allocate at most: a few copies of the payload, never
#: a Python object per byte (before the fix each of these cost 60-300 MB).
PEAK = 12 * MiB


def empty_arrays(nbytes: int) -> bytes:
    """A msgpack array of ``nbytes - 5`` empty arrays (the classic bomb)."""
    count = nbytes - 5
    return b"\xdd" + struct.pack(">I", count) + b"\x90" * count


def nested_pairs(nbytes: int) -> bytes:
    """An array of ``[[]]`` pairs: no run of one-byte objects for a scanner to skip."""
    count = (nbytes - 5) // 2
    return b"\xdd" + struct.pack(">I", count) + b"\x91\x90" * count


def map_with(junk: bytes, **fields: object) -> bytes:
    """A control body: a msgpack map of ``fields`` plus an unknown key holding ``junk``."""
    head = ormsgpack.packb(fields)
    size = len(fields) + 1
    assert size < 16
    return bytes([0x80 | size]) + head[1:] + ormsgpack.packb("junk") + junk


@contextlib.contextmanager
def peak_memory() -> Iterator[list[int]]:
    """Trace Python allocations in the block; the list holds the peak afterwards."""
    result: list[int] = []
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        yield result
        result.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()


# -- pure checks (sans-I/O) -------------------------------------------------------------------

_CONTROL_KINDS = [
    (MessageKind.HELLO, 0),
    (MessageKind.WELCOME, 0),
    (MessageKind.REJECT, 0),
    (MessageKind.BYE, 0),
    (MessageKind.CREDIT, 1),
    (MessageKind.RELEASE, 0),
    (MessageKind.ERROR, 1),
]


def test_every_control_kind_with_a_body_has_a_cap() -> None:
    from tensorrpc._protocol import _BODY_BY_KIND

    assert set(MAX_BODY_BYTES) == set(_BODY_BY_KIND)


@pytest.mark.parametrize("bomb", [empty_arrays, nested_pairs])
@pytest.mark.parametrize(("kind", "call_id"), _CONTROL_KINDS)
def test_control_body_bomb_is_refused_before_decoding(
    kind: MessageKind, call_id: int, bomb: object
) -> None:
    assert callable(bomb)
    payload = map_with(bomb(2 * MiB), reason="x")  # 2 MiB: under the old 4 MiB cap
    with peak_memory() as peak, pytest.raises(RemoteProtocolError, match=r"limit|objects"):
        decode_control(Header(kind, call_id), payload)
    assert peak[0] < PEAK, f"{kind.name}: decoding the bomb allocated {peak[0]} bytes"


@pytest.mark.parametrize(
    ("kind", "call_id", "cap"),
    [
        (MessageKind.CREDIT, 1, 1024),
        (MessageKind.BYE, 0, 8 * 1024),
        (MessageKind.WELCOME, 0, 64 * 1024),
        (MessageKind.RELEASE, 0, 64 * 1024),
        (MessageKind.HELLO, 0, MiB),
    ],
)
def test_control_bodies_are_capped_per_kind(kind: MessageKind, call_id: int, cap: int) -> None:
    assert MAX_BODY_BYTES[kind] == cap
    payload = map_with(ormsgpack.packb("x" * cap), n=1)
    with pytest.raises(RemoteProtocolError, match=f"limit for {kind.name} is {cap}"):
        decode_control(Header(kind, call_id), payload)


def test_a_control_body_that_is_not_a_map_is_refused_at_its_first_byte() -> None:
    with peak_memory() as peak, pytest.raises(RemoteProtocolError, match="map"):
        decode_control(Header(MessageKind.ERROR, 1), empty_arrays(2 * MiB))
    assert peak[0] < PEAK


def test_object_count_stops_at_the_budget() -> None:
    assert count_msgpack_objects(ormsgpack.packb([1, [2, 3], {"a": b"xyz"}]), 100) == 8
    assert count_msgpack_objects(empty_arrays(1000), 100) == 101  # stopped early
    assert count_msgpack_objects(nested_pairs(1000), 100) == 101
    # the fast path over a run of one-byte objects agrees with the slow path
    floats = ormsgpack.packb([float(i) for i in range(1000)])
    assert count_msgpack_objects(floats, 10**6) == 1001
    assert count_msgpack_objects(floats, 999) == 1000
    mixed = ormsgpack.packb([0, 1, [], {}, "", None, True, -3] * 100 + [300, "ab"])
    assert count_msgpack_objects(mixed, 10**6) == 1 + 802
    # truncated or invalid input is the decoder's to report: the count never fails
    assert count_msgpack_objects(b"\x93\x90", 100) == 2
    assert count_msgpack_objects(b"\xdd\x00\x00\x01\x00\x90", 100) == 101  # 256 announced
    assert count_msgpack_objects(b"\xc1", 100) == 1
    assert count_msgpack_objects(b"", 100) == 0
    assert MAX_CONTROL_OBJECTS >= 4 * 4097


@pytest.mark.parametrize("bomb", [empty_arrays, nested_pairs])
def test_value_payload_bomb_is_a_decode_error_with_bounded_memory(bomb: object) -> None:
    assert callable(bomb)
    payload = bomb(4 * MiB)
    with peak_memory() as peak, pytest.raises(DecodeError, match="max_payload_objects"):
        _codec.decode(payload)
    assert peak[0] < PEAK, f"decoding the bomb allocated {peak[0]} bytes"


def test_payload_object_budget_is_configurable_and_checked_on_both_sides() -> None:
    config = CodecConfig(max_payload_objects=1000)
    ok = list(range(999))
    assert _codec.decode(_codec.encode(ok, config).payload, (), config) == ok
    too_many = list(range(1000))
    with pytest.raises(EncodeError, match="max_payload_objects=1000"):
        _codec.encode(too_many, config)
    with pytest.raises(DecodeError, match="max_payload_objects=1000"):
        _codec.decode(_codec.encode(too_many).payload, (), config)
    # the default takes lists of token ids of realistic lengths
    tokens = list(range(200_000))
    assert _codec.decode(_codec.encode(tokens).payload) == tokens


# -- live: an engine and a client under attack --------------------------------------------------


async def test_engine_pays_bounded_memory_for_control_and_call_bombs(tmp_path: Path) -> None:
    bombs = [map_with(empty_arrays(2 * MiB), n=1) for _ in range(3)]
    call_bomb = empty_arrays(4 * MiB)
    async with live_engine(tmp_path) as (server, peer, _):
        with peak_memory() as peak:
            for bomb in bombs:
                peer.send([pack_reply_header(MessageKind.CREDIT, 7), bomb])
                peer.send([pack_reply_header(MessageKind.RELEASE), bomb])
            peer.send([pack_call_header(99, "add"), call_bomb])
            for _ in bombs:  # a bad CREDIT names its call: ERROR(id, PROTOCOL), §11
                refused = (await peer.expect(MessageKind.ERROR, 7)).error()
                assert "the limit for CREDIT" in refused.message
            error = (await peer.expect(MessageKind.ERROR, 99)).error()
            assert "max_payload_objects" in error.message
            call_id = peer.call("add", 2, 3)
            assert await peer.result(call_id) == 5
        assert peak[0] < 4 * PEAK, f"the engine allocated {peak[0]} bytes for the bombs"
        assert server.statistics().calls >= 1


def _zstd_frame_claiming(data: bytes, declared: int) -> bytes:
    """A zstd frame of ``data`` whose header claims ``declared`` bytes (a lie)."""
    zstandard = pytest.importorskip("zstandard")
    frame: bytes = zstandard.ZstdCompressor(level=1).compress(data)
    fhd = frame[4]  # RFC 8878 frame header descriptor: a 4-byte content size here
    assert fhd >> 6 == 2
    at = 5 if (fhd >> 5) & 1 else 6
    return frame[:at] + declared.to_bytes(4, "little") + frame[at + 4 :]


async def test_engine_pays_bounded_memory_for_decompression_bombs(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    zeros = bytes(64 * MiB)
    ext = int(_codec.ExtCode.ZSTD)
    bombs = [
        # claims 64 bytes, expands to 64 MiB
        ormsgpack.packb(ormsgpack.Ext(ext, _zstd_frame_claiming(zeros, 64))),
        # says 4 GiB: over max_payload_bytes, refused from its header
        ormsgpack.packb(ormsgpack.Ext(ext, _zstd_frame_claiming(zeros, (4 << 30) - 1))),
        # says nothing
        ormsgpack.packb(
            ormsgpack.Ext(ext, zstandard.ZstdCompressor(write_content_size=False).compress(zeros))
        ),
    ]
    del zeros
    async with live_engine(tmp_path) as (server, peer, _):
        with peak_memory() as peak:
            for call_id, bomb in enumerate(bombs, 1):
                assert len(bomb) < 64 * 1024
                peer.send([pack_call_header(call_id, "add"), bomb])
                error = (await peer.expect(MessageKind.ERROR, call_id)).error()
                assert error.code == ErrorCode.DECODE
                assert "compressed frame" in error.message
            call_id = peer.call("add", 2, 3)
            assert await peer.result(call_id) == 5
        assert peak[0] < PEAK, f"the engine allocated {peak[0]} bytes for the bombs"
        assert server.statistics().errors == len(bombs)


async def test_client_pays_bounded_memory_for_hello_and_result_bombs(tmp_path: Path) -> None:
    hello_bomb = map_with(empty_arrays(2 * MiB), engine_id="x")
    result_bomb = empty_arrays(4 * MiB)
    async with Client(Calculator, bind=f"ipc://{tmp_path}/client.sock") as client:
        address = client.addresses[0]
        stranger = create_socket(zmq.DEALER, routing_id=b"stranger")
        try:
            stranger.connect(address)
            async with FakeEngine(address, "e1") as engine:
                with peak_memory() as peak:
                    for _ in range(3):
                        await stranger.send([pack_reply_header(MessageKind.HELLO), hello_bomb])
                    assert await engine.join() is not None
                    with anyio.fail_after(WAIT):
                        await client.wait_for_engines(1)
                    async with anyio.create_task_group() as tg:
                        failure: list[BaseException] = []

                        async def call() -> None:
                            try:
                                await client.stub().add(1, 2)
                            except Exception as exc:
                                failure.append(exc)

                        tg.start_soon(call)
                        msg = await engine.next(MessageKind.CALL)
                        await engine.send(
                            [pack_reply_header(MessageKind.RESULT, msg.call_id), result_bomb]
                        )
                    assert failure, "the call did not fail"
                    assert isinstance(failure[0], DecodeError), failure
                    assert "max_payload_objects" in str(failure[0])
                assert peak[0] < 4 * PEAK, f"the client allocated {peak[0]} bytes"
        finally:
            await stranger.aclose()


# -- a map key that is neither str nor int is an invalid argument, not a corrupt message ----


@pytest.mark.parametrize(
    "payload",
    [
        b"\x81\xc4\x01a\x02",  # {b"a": 2}
        b"\x91\x81\xc0\x02",  # [{None: 2}]
        b"\x81\x91\x01\x02",  # {[1]: 2}: not even hashable in Python
    ],
)
def test_a_map_key_that_is_not_a_string_is_a_validation_error(payload: bytes) -> None:
    with pytest.raises(ValidationError, match="map keys are str"):
        _codec.decode(payload)


def test_an_int_map_key_decodes() -> None:
    assert _codec.decode(b"\x81\x01\x02") == {1: 2}  # dict[int, T] travels so


def test_malformed_msgpack_is_still_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="malformed"):
        _codec.decode(b"\x81\x01")  # a map missing its value


async def test_engine_answers_invalid_argument_for_an_int_argument_name(tmp_path: Path) -> None:
    async with live_engine(tmp_path) as (_, peer, _):
        peer.raw_call(5, "add", ormsgpack.packb({"a": 1}, option=ormsgpack.OPT_NON_STR_KEYS))
        peer.raw_call(6, "add", b"\x82\xa1a\x01\x01\x02")  # {"a": 1, 1: 2}
        ok = (await peer.expect(MessageKind.RESULT, 5)).value()
        assert ok == 2
        error = (await peer.expect(MessageKind.ERROR, 6)).error()
        assert error.code == ErrorCode.INVALID_ARGUMENT, error
        assert "argument names must be strings" in error.message
