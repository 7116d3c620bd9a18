"""The torch_shm proof of a peer's pid (sans-I/O decisions, docs/protocol.md §8.1)."""

from __future__ import annotations

from typing import Any

import pytest

from tensorrpc.transports._shm_auth import (
    CHALLENGE_BYTES,
    ProbeHandle,
    Role,
    ShmLink,
    check_proof,
    decide,
    make_proof,
    new_challenge,
    new_secret,
)

OURS = 100
PEER = 200
SECRET = new_secret()
PROBE = ProbeHandle(PEER, 7, 1, 99).pack()


def _decide(link: ShmLink, **change: Any) -> bool:
    args: dict[str, Any] = {
        "enabled": True,
        "our_pid": OURS,
        "our_host": "h",
        "peer_pid": PEER,
        "peer_host": "h",
        "peer_offers": ("frames", "torch_shm"),
        "probe": PROBE,
        "proof": make_proof(
            SECRET, Role.CLIENT, prover_pid=PEER, verifier_pid=OURS, challenge=link.challenge
        ),
        "peer_role": Role.CLIENT,
        "read_secret": lambda h: SECRET if h == ProbeHandle.unpack(PROBE) else None,
    }
    args.update(change)
    return decide(link, **args)


def test_a_valid_proof_proves_the_pid_and_enables_both_directions():
    link = ShmLink(new_challenge())
    assert _decide(link)
    assert (link.pid, link.send, link.receive, link.settled) == (PEER, True, True, True)
    link.disable(sending=True)
    assert (link.send, link.receive) == (False, True)


@pytest.mark.parametrize(
    "change",
    [
        {"enabled": False},
        {"peer_host": "other"},
        {"peer_offers": ("frames",)},
        {"probe": b""},
        {"probe": b"garbage"},
        {"proof": b""},
        {"proof": bytes(32)},
        {"peer_role": Role.ENGINE},  # a proof never counts in the other direction
        {"peer_pid": PEER + 1},  # the probe must name the claimed pid
        {"our_pid": PEER},  # a peer that claims our own pid is refused
        {"read_secret": lambda h: None},  # cannot read its secret: not proven
        {"read_secret": lambda h: new_secret()},  # another secret
    ],
)
def test_anything_short_of_a_valid_proof_leaves_the_peer_unproven(change):
    link = ShmLink(new_challenge())
    if "our_pid" in change:
        change["probe"] = ProbeHandle(PEER, 7, 1, 99).pack()
    assert not _decide(link, **change)
    assert (link.pid, link.send, link.receive, link.settled) == (0, False, False, True)


def test_a_proof_is_bound_to_the_challenge_and_both_pids():
    c = new_challenge()
    proof = make_proof(SECRET, Role.ENGINE, prover_pid=1, verifier_pid=2, challenge=c)
    ok: dict[str, Any] = {"prover_pid": 1, "verifier_pid": 2, "challenge": c, "proof": proof}
    assert check_proof(SECRET, Role.ENGINE, **ok)
    changes: tuple[dict[str, Any], ...] = (
        {"prover_pid": 3},
        {"verifier_pid": 3},
        {"challenge": new_challenge()},
        {"challenge": c[:-1]},
        {"proof": proof[:-1]},
    )
    for change in changes:
        assert not check_proof(SECRET, Role.ENGINE, **{**ok, **change})
    assert len(c) == CHALLENGE_BYTES


@pytest.mark.parametrize("data", [b"", b"TRPB", bytes(32), ProbeHandle(0, 1, 1, 1).pack(), 7])
def test_malformed_probe_handles_do_not_parse(data):
    assert ProbeHandle.unpack(data) is None
