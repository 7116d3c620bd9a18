"""Who may use ``torch_shm`` with whom: proof of a peer's process id by possession (sans-I/O).

A ``torch_shm`` handle names memory in the sender's process, opened by the receiver through
``/proc/<pid>/fd/<n>``. The pid comes from the peer's handshake message, so it is a
*claim*; it is only used once *proven* (docs/protocol.md §8.1):

* each side keeps a secret (`SECRET_BYTES` random bytes) in a sealed memfd, its
  *probe*; the secret never travels, the probe handle (`ProbeHandle`) names the
  memfd;
* the verifier sends a fresh random challenge (`new_challenge`); the prover answers
  with `make_proof`, an HMAC-SHA256 keyed by its secret over a fixed label, its
  role, both pids and the challenge;
* the verifier reads the secret through ``/proc/<claimed pid>/fd/<n>`` (the I/O part:
  `TorchShmTransport.read_peer_secret`) and checks the answer with
  `check_proof`. Only a process that can open the prover's descriptors can read the
  secret, and the proof names the prover's pid, so a proof proves "the claimed pid is a
  process whose descriptors I can open, and the peer holds its secret".

`ShmLink` records, per peer, what was decided; `decide` is the one decision
both the client and the engine make. Nothing here touches the network, files or clocks.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "CHALLENGE_BYTES",
    "PROOF_BYTES",
    "SECRET_BYTES",
    "ProbeHandle",
    "Role",
    "ShmLink",
    "check_proof",
    "decide",
    "make_proof",
    "new_challenge",
    "new_secret",
]

#: Bytes of a challenge (HELLO, WELCOME).
CHALLENGE_BYTES: Final = 32
#: Bytes of a secret (the content of a probe memfd).
SECRET_BYTES: Final = 32
#: Bytes of a proof (HMAC-SHA256).
PROOF_BYTES: Final = 32

_LABEL: Final = b"tensorrpc-torch_shm-proof-v1"
_PIDS = struct.Struct("<QQ")
_PROBE_MAGIC: Final = b"TRPB"
_PROBE_VERSION: Final = 1
# magic, version, pad, pid, fd, dev, ino
_PROBE = struct.Struct("<4sB3xqiQQ")


class Role(Enum):
    """Which side computes a proof; part of the HMAC input, so proofs never cross over."""

    #: The client answers the engine's HELLO challenge (in WELCOME).
    CLIENT = b"C"
    #: The engine answers the client's WELCOME challenge (in PROOF).
    ENGINE = b"E"


def new_challenge() -> bytes:
    """A fresh random challenge."""
    return secrets.token_bytes(CHALLENGE_BYTES)


def new_secret() -> bytes:
    """A fresh random secret for a probe memfd."""
    return secrets.token_bytes(SECRET_BYTES)


def make_proof(
    secret: bytes, role: Role, *, prover_pid: int, verifier_pid: int, challenge: bytes
) -> bytes:
    """The answer to ``challenge`` by the holder of ``secret``.

    Args:
        secret: The prover's own secret (the content of its probe memfd).
        role: The prover's role.
        prover_pid: The prover's own pid (the pid it claims).
        verifier_pid: The pid the verifier claimed.
        challenge: The verifier's challenge, as received.

    Returns:
        `PROOF_BYTES` bytes.
    """
    msg = _LABEL + role.value + _PIDS.pack(prover_pid & (2**64 - 1), verifier_pid & (2**64 - 1))
    return hmac.new(secret, msg + challenge, hashlib.sha256).digest()


def check_proof(
    secret: bytes,
    role: Role,
    *,
    prover_pid: int,
    verifier_pid: int,
    challenge: bytes,
    proof: bytes,
) -> bool:
    """Whether ``proof`` answers ``challenge`` for the holder of ``secret`` (constant time)."""
    if len(secret) != SECRET_BYTES or len(challenge) != CHALLENGE_BYTES:
        return False
    if len(proof) != PROOF_BYTES:
        return False
    expected = make_proof(
        secret, role, prover_pid=prover_pid, verifier_pid=verifier_pid, challenge=challenge
    )
    return hmac.compare_digest(expected, proof)


@dataclass(frozen=True, slots=True)
class ProbeHandle:
    """Names a process's probe memfd: ``/proc/<pid>/fd/<fd>``, with its device and inode."""

    #: The process that holds the memfd.
    pid: int
    #: Its descriptor number there.
    fd: int
    #: ``st_dev`` of the memfd.
    dev: int
    #: ``st_ino`` of the memfd.
    ino: int

    def pack(self) -> bytes:
        """The wire form (HELLO's and WELCOME's ``probe``)."""
        return _PROBE.pack(_PROBE_MAGIC, _PROBE_VERSION, self.pid, self.fd, self.dev, self.ino)

    @classmethod
    def unpack(cls, data: bytes) -> ProbeHandle | None:
        """Parse a peer's probe handle; None when it is not one (any malformation)."""
        if not isinstance(data, bytes) or len(data) != _PROBE.size:
            return None
        magic, version, pid, fd, dev, ino = _PROBE.unpack(data)
        if magic != _PROBE_MAGIC or version != _PROBE_VERSION:
            return None
        if pid <= 0 or not 0 <= fd < (1 << 20):
            return None
        return cls(pid, fd, dev, ino)


@dataclass(slots=True)
class ShmLink:
    """``torch_shm`` with one peer, as one side decided it at the handshake.

    Until `decide` accepts the peer, ``pid`` is 0 and both flags are False: no
    handle goes to the peer and every handle from it is refused.
    """

    #: The challenge we sent the peer (fresh per connection).
    challenge: bytes
    #: The peer's proven pid; 0 while unproven.
    pid: int = 0
    #: We may send the peer tensors by handle.
    send: bool = False
    #: We resolve the peer's handles (its pid is proven).
    receive: bool = False
    #: The handshake is over (accepted or not).
    settled: bool = False
    #: The peer's challenge to us, when it sent one (to tell a repeated handshake message
    #: from a new session).
    peer_challenge: bytes = b""
    #: What the peer claimed in its handshake message, kept until its proof arrives:
    #: ``(pid, host id, transports, probe)``.
    claim: tuple[int, str, tuple[str, ...], bytes] | None = None

    @property
    def proven(self) -> bool:
        """Whether the peer's pid was proven."""
        return self.pid > 0

    def disable(self, *, sending: bool) -> None:
        """The peer could not attach to our handles (or we to its): stop that direction."""
        if sending:
            self.send = False
        else:
            self.receive = False


def decide(
    link: ShmLink,
    *,
    enabled: bool,
    our_pid: int,
    our_host: str,
    peer_pid: int,
    peer_host: str,
    peer_offers: Sequence[str],
    probe: bytes,
    proof: bytes,
    peer_role: Role,
    read_secret: Callable[[ProbeHandle], bytes | None],
) -> bool:
    """Decide ``torch_shm`` with a peer from its handshake message; update ``link``.

    The peer is accepted when ``torch_shm`` is on here, the host ids are equal, it offers
    ``torch_shm``, its probe handle parses and names its claimed pid, which is not ours,
    and ``proof`` answers ``link.challenge`` under the secret that ``read_secret`` reads from that
    probe. ``read_secret`` is only called when every cheaper check passed.

    Args:
        link: Our state for this peer (its ``challenge`` is the one we sent).
        enabled: ``torch_shm`` is on here and our own probe works.
        our_pid: Our pid.
        our_host: Our host id.
        peer_pid: The pid the peer claims (its probe must name the same pid).
        peer_host: The host id the peer claims.
        peer_offers: The transports the peer claims it can receive.
        probe: The peer's probe handle.
        proof: The peer's answer to ``link.challenge``.
        peer_role: The peer's role (the role its proof was made under).
        read_secret: Reads the secret a probe names (I/O), None when it cannot.

    Returns:
        Whether the peer was accepted (``link.pid`` is then its proven pid).
    """
    link.settled = True
    link.pid = 0
    link.send = link.receive = False
    if not enabled or not probe or not proof or peer_host != our_host:
        return False
    handle = ProbeHandle.unpack(probe) if "torch_shm" in peer_offers else None
    if handle is None or handle.pid != peer_pid or handle.pid == our_pid:
        return False
    secret = read_secret(handle)
    if secret is None or not check_proof(
        secret,
        peer_role,
        prover_pid=handle.pid,
        verifier_pid=our_pid,
        challenge=link.challenge,
        proof=proof,
    ):
        return False
    link.pid = handle.pid
    link.send = link.receive = True
    return True
