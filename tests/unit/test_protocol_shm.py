"""Wire additions for the torch_shm transport: RELEASE, SHM_* flags, probe and pid fields."""

from __future__ import annotations

import ormsgpack
import pytest

from tensorrpc._exceptions import LocalProtocolError, RemoteProtocolError
from tensorrpc._protocol import (
    Flags,
    Hello,
    MessageKind,
    Proof,
    Release,
    Welcome,
    decode_control,
    encode_control,
    pack_call_header,
    split_frames,
    unpack_header,
)


def test_release_round_trips_as_a_connection_level_message():
    frames = encode_control(MessageKind.RELEASE, Release((1, 7, 2**63 - 1)))
    header, payload, buffers = split_frames(frames)
    assert header.kind is MessageKind.RELEASE
    assert header.call_id == 0
    assert buffers == ()
    assert decode_control(header, payload) == Release((1, 7, 2**63 - 1))


@pytest.mark.parametrize("leases", [(), (0,), (-1,), (2**63,), (True,), ("1",)])
def test_release_refuses_bad_lease_ids(leases):
    with pytest.raises(LocalProtocolError):
        encode_control(MessageKind.RELEASE, Release(leases))
    frames = encode_control(MessageKind.RELEASE, Release((1,)))
    bad = ormsgpack.packb({"leases": list(leases)})
    with pytest.raises(RemoteProtocolError):
        decode_control(unpack_header(frames[0]), bad)


def test_shm_result_flags_are_known_call_flags():
    frame = pack_call_header(3, "m", int(Flags.SHM_RESULTS | Flags.STREAM))
    assert unpack_header(frame).flags == Flags.SHM_RESULTS | Flags.STREAM
    frame = pack_call_header(3, "m", int(Flags.SHM_RESULTS_ALL))
    assert unpack_header(frame).flags == Flags.SHM_RESULTS_ALL


def test_probe_and_pid_are_optional_for_older_peers():
    hello = Hello("e", "S", "f", 1, "h", 5, ("frames",), 1, 1000, ("m",), probe=b"\x01" * 80)
    frames = encode_control(MessageKind.HELLO, hello)
    assert decode_control(unpack_header(frames[0]), frames[1]) == hello
    old = ormsgpack.packb(
        {
            "client_id": "c",
            "host_id": "h",
            "transports": ["frames"],
            "heartbeat_ms": 1000,
            "stream_window": 16,
        }
    )
    header = unpack_header(encode_control(MessageKind.WELCOME, Welcome("c", "h"))[0])
    welcome = decode_control(header, old)
    assert welcome == Welcome("c", "h", ("frames",), 1000, 16, pid=0, probe=b"")


def test_probe_must_be_bytes():
    header = unpack_header(encode_control(MessageKind.WELCOME, Welcome("c", "h"))[0])
    body = {
        "client_id": "c",
        "host_id": "h",
        "transports": [],
        "heartbeat_ms": 1,
        "stream_window": 1,
        "pid": 1,
        "probe": "not bytes",
    }
    with pytest.raises(RemoteProtocolError, match="probe"):
        decode_control(header, ormsgpack.packb(body))


def test_challenge_and_proof_fields_round_trip_and_default_to_empty():
    hello = Hello("e", "S", "f", 1, "h", 5, challenge=b"\x02" * 32)
    frames = encode_control(MessageKind.HELLO, hello)
    assert decode_control(unpack_header(frames[0]), frames[1]) == hello
    welcome = Welcome("c", "h", pid=9, challenge=b"\x03" * 32, proof=b"\x04" * 32)
    frames = encode_control(MessageKind.WELCOME, welcome)
    assert decode_control(unpack_header(frames[0]), frames[1]) == welcome
    assert Hello("e", "S", "f", 1, "h", 5).challenge == b""
    assert Welcome("c", "h").proof == Welcome("c", "h").challenge == b""


def test_proof_is_a_connection_level_message():
    frames = encode_control(MessageKind.PROOF, Proof(b"\x05" * 32))
    header, payload, _buffers = split_frames(frames)
    assert header.kind is MessageKind.PROOF
    assert header.call_id == 0
    assert decode_control(header, payload) == Proof(b"\x05" * 32)
    assert decode_control(header, ormsgpack.packb({"proof": b""})) == Proof(b"")
    with pytest.raises(RemoteProtocolError, match="missing"):
        decode_control(header, ormsgpack.packb({}))


@pytest.mark.parametrize("value", ["text", b"\x00" * 65, 7])
def test_oversized_or_mistyped_challenge_and_proof_are_refused(value):
    frames = encode_control(MessageKind.PROOF, Proof(b""))
    with pytest.raises(RemoteProtocolError, match="proof"):
        decode_control(unpack_header(frames[0]), ormsgpack.packb({"proof": value}))
    frames = encode_control(MessageKind.HELLO, Hello("e", "S", "f", 1, "h", 5))
    body = ormsgpack.unpackb(frames[1])
    body["challenge"] = value
    with pytest.raises(RemoteProtocolError, match="challenge"):
        decode_control(unpack_header(frames[0]), ormsgpack.packb(body))
