"""Wire additions for the torch_shm transport: RELEASE, SHM_* flags, the pid hint; no PROOF."""

from __future__ import annotations

import ormsgpack
import pytest

from tensorrpc._exceptions import LocalProtocolError, RemoteProtocolError
from tensorrpc._protocol import (
    Flags,
    Hello,
    MessageKind,
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


def test_no_handshake_field_carries_a_probe_challenge_or_proof():
    # Identity comes from the kernel: no field of a handshake claims to prove it.
    for body in (Hello, Welcome):
        assert not {"probe", "challenge", "proof"} & set(body.__dataclass_fields__)
    assert "PROOF" not in MessageKind.__members__
    with pytest.raises(ValueError, match="15"):
        MessageKind(15)  # the kind PROOF had is unused
