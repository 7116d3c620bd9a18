"""Who the peer of a connection is, as the kernel says, and what we may map of it.

``torch_shm`` never trusts a pid, host id or proof carried in a message. On ``ipc://`` the
kernel knows the peer of every connection: libzmq reads ``SO_PEERCRED`` when the
connection is made and attaches it to each message of that connection as the
``Peer-Address`` property (``"<host>:<uid>:<gid>:<pid>"``); the shell takes a pidfd of the
very process at the handshake (`tensorrpc._zmq.peer_credentials`). A `KernelPeer`
holds both, and a descriptor of that process's ``/proc/<pid>/fd`` directory opened while
the pidfd said it lived. Handles from the peer are resolved against its pid only, and
its descriptors are looked up relative to that directory: once the process has exited,
every lookup there fails, whoever has taken its pid since (the directory belongs to the
process, not to the number). Each message is also checked against the pidfd before any
of its handles is resolved, kept mappings included.

`alias_gate` decides whether torch's own shared files (``share_memory_()``, both
sharing strategies), which cannot be sealed, may be mapped between us and the peer (see
docs/security.md, "The unsealed-alias gate").

The shells gather these facts for a handshake message (`PeerFacts`: reading the kernel
and ``/proc`` is I/O) and hand them to the protocol machines as data; `shm_terms`, pure,
decides from them and the message what torch_shm may do with that peer (`ShmTerms`).
"""

from __future__ import annotations

import contextlib
import os
import select
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

from tensorrpc.transports._shm_handle import TRANSPORT_NAME

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "ALIAS_SETTINGS",
    "UNSEALED_OFFER",
    "AliasSetting",
    "KernelPeer",
    "PeerFacts",
    "ShmTerms",
    "alias_gate",
    "parse_peer_address",
    "shm_terms",
]

#: In a HELLO's or WELCOME's ``transports``: "I map torch's unsealed shared files from
#: you when my gate holds for you" (``shm_alias_unsealed="same-user"``). A hint only: the
#: receiver checks its own gate.
UNSEALED_OFFER: Final = "torch_shm_unsealed"
#: ``shm_alias_unsealed`` values.
AliasSetting = Literal["same-user", "never"]
#: The accepted values of `AliasSetting`.
ALIAS_SETTINGS: Final = frozenset({"same-user", "never"})


def parse_peer_address(address: str | None) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` from libzmq's ``Peer-Address`` of an ``ipc://`` connection.

    None for any other form (tcp: an IP address; no ``SO_PEERCRED``: no numbers).
    """
    if not address:
        return None
    parts = address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if pid <= 0 or uid < 0 or gid < 0:
        return None
    return pid, uid, gid


_FD_DIR_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def _pidfd_pid(pidfd: int) -> int:
    """The pid a pidfd refers to, in our pid namespace (-1: it exited; 0: not visible)."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return 0


@dataclass(eq=False, slots=True)
class KernelPeer:
    """The process at the other end of one connection, pinned by a pidfd.

    ``address`` is the connection's ``Peer-Address`` (the kernel's credentials, bound
    to that connection): a later message must carry the same one to use this identity.
    ``pidfd`` is -1 for a peer trusted without attestation (``shm_trust_unattested``
    over tcp), whose pid is only what it claimed.
    """

    #: The peer's pid (in our pid namespace).
    pid: int
    #: Its uid and gid when it connected (``SO_PEERCRED``); -1 when not attested.
    uid: int
    gid: int
    #: The connection's ``Peer-Address``; "" when not attested.
    address: str
    #: A pidfd of the process; -1 when not attested.
    pidfd: int = -1
    #: The pidfd's inode (unique per process while it lives, on pidfs); -1: unknown.
    ino: int = -1
    #: An ``O_PATH`` descriptor of the process's ``/proc/<pid>/fd``, opened while the
    #: pidfd said it lived (`pinned`); -1: none (its descriptors are opened by path,
    #: each checked against the pidfd afterwards).
    fd_dir: int = -1
    #: `alive`'s poll object on the pidfd (made on first use: a ``select`` per message
    #: cost three times as much).
    _poller: select.poll | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def attested(self) -> bool:
        """Whether the kernel attested this peer (else it is trusted by configuration)."""
        return self.pidfd >= 0

    @property
    def key(self) -> tuple[int, int]:
        """Identifies the process while it lives: ``(pid, pidfd inode)``.

        Two connections of one process have equal keys (per-process budgets)."""
        return (self.pid, self.ino)

    def alive(self) -> bool:
        """Whether the pinned process still runs (its pid cannot have been reused then).

        A peer without a pidfd (not attested) counts as alive: nothing pins it; a
        closed one (its session ended) never does.
        """
        fd = self.pidfd
        if fd < 0:
            return not self._closed
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(fd, select.POLLIN)
        try:
            return not poller.poll(0)  # a pidfd polls readable once its process has exited
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Close the pidfd and the ``/proc`` directory (the session ended). Idempotent."""
        self._closed = True
        self._poller = None
        for fd in (self.pidfd, self.fd_dir):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pidfd = self.fd_dir = -1

    @classmethod
    def pinned(cls, address: str, pidfd: int) -> KernelPeer | None:
        """The peer ``address`` names, pinned by ``pidfd`` (taken from the same connection).

        The pidfd must refer to the pid the address names: the connection's descriptor
        number could have been reused by another connection between the message and the
        pidfd, and then they disagree. Closes ``pidfd`` and returns None on any mismatch.
        """
        creds = parse_peer_address(address)
        if creds is None or _pidfd_pid(pidfd) != creds[0]:
            with contextlib.suppress(OSError):
                os.close(pidfd)
            return None
        try:
            ino = os.fstat(pidfd).st_ino
        except OSError:
            ino = -1
        try:
            # O_PATH: no read permission needed here; each lookup in it is checked.
            fd_dir = os.open(f"/proc/{creds[0]}/fd", _FD_DIR_FLAGS)
        except OSError:
            fd_dir = -1
        peer = cls(creds[0], creds[1], creds[2], address, pidfd, ino, fd_dir)
        if not peer.alive():  # (alive after the open: the directory is that process's)
            peer.close()
            return None
        return peer


def _status(pid: int | str) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _uids(status: dict[str, str]) -> tuple[int, ...]:
    return tuple(int(x) for x in status["Uid"].split())


def _same_namespaces(pid: int) -> bool:
    for ns in ("pid", "user"):
        if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"):
            return False
    return True


def alias_gate(peer: KernelPeer) -> tuple[bool, bool]:
    """Whether torch's unsealed shared files may be mapped between us and ``peer``.

    Both sides need: the kernel attested the peer; the peer's real, effective, saved and
    filesystem uids all equal ours, and ours are equal to each other (no setuid on
    either side); the peer shares our pid and user namespaces. Then the peer may already
    kill us and open our descriptors, so a truncation (SIGBUS) costs nothing new,
    provided the receiver holds no capability the sender lacks.

    Returns:
        ``(we map theirs, they map ours)``: the first also needs our effective
        capabilities to be a subset of the peer's, the second the peer's a subset of ours.
        ``(False, False)`` on any doubt (unreadable ``/proc``, the peer exited).
    """
    if not peer.attested:
        return (False, False)
    try:
        ours = _status("self")
        theirs = _status(peer.pid)
        our_uids, their_uids = _uids(ours), _uids(theirs)
        if len(set(our_uids)) != 1 or set(their_uids) != set(our_uids):
            return (False, False)
        if not _same_namespaces(peer.pid):
            return (False, False)
        our_caps = int(ours["CapEff"], 16)
        their_caps = int(theirs["CapEff"], 16)
    except (OSError, KeyError, ValueError):
        return (False, False)
    if not peer.alive():  # what we read may be another process's, under a reused pid
        return (False, False)
    return (our_caps & ~their_caps == 0, their_caps & ~our_caps == 0)


@dataclass(frozen=True, slots=True)
class PeerFacts:
    """What our side knows of the sender of one handshake message, gathered by the shell
    (`tensorrpc.transports._policy.TransportPolicy.facts`) and handed to a protocol
    machine as data.

    Nothing in it comes from the message: the kernel's credentials of the connection it
    came on, and what ``/proc`` says of that process and of us.
    """

    #: The process the kernel says sent the message, pinned by a pidfd; None when the
    #: kernel cannot say (tcp, loopback included).
    kernel: KernelPeer | None
    #: Our pid (a message from ourselves never gets torch_shm).
    our_pid: int
    #: `alias_gate` for ``kernel``: (we map its torch files, it may map ours); both
    #: False with ``shm_alias_unsealed="never"``.
    unsealed: tuple[bool, bool] = (False, False)
    #: The peer can open our descriptors through ``/proc``: our uid, or root.
    opens_ours: bool = False
    #: False: no torch_shm with this sender whatever it says (it is ourselves, or
    #: torch_shm is off here).
    usable: bool = True


@dataclass(frozen=True, slots=True)
class ShmTerms:
    """torch_shm with one peer, as `shm_terms` decided at its handshake."""

    #: Whom the peer's handles resolve against: the kernel's process, pinned; or (trusted
    #: unattested, ``pidfd`` -1) the pid the peer claimed.
    kernel: KernelPeer
    #: We send it tensors by handle (it can open our descriptors).
    send: bool
    #: We map torch's unsealed shared files it sends (our gate holds for it).
    unsealed_in: bool
    #: It may map ours (its gate holds, and it offered to).
    unsealed_out: bool

    @property
    def pid(self) -> int:
        """The peer's pid, as the kernel says (or, trusted, as it claims)."""
        return self.kernel.pid


def shm_terms(
    facts: PeerFacts | None,
    offers: Sequence[str],
    claimed_pid: int,
    same_host: bool,
    *,
    trust_unattested: bool,
) -> ShmTerms | None:
    """Decide torch_shm with the sender of a handshake message (HELLO or WELCOME); pure.

    Args:
        facts: What the shell gathered about the message's connection; None (not
            gathered) or not ``usable``: torch_shm is off with it.
        offers: The transports the message lists (a hint: it only ever turns things off).
        claimed_pid: The pid the message claims; used only with ``trust_unattested``, for
            a peer the kernel cannot attest.
        same_host: The message's host id equals ours (also only for that case).
        trust_unattested: ``shm_trust_unattested`` (docs/security.md).

    Returns:
        None when torch_shm is off with this peer. A peer the kernel attested is taken
        for what the kernel says, whatever it claims.
    """
    if facts is None or not facts.usable or TRANSPORT_NAME not in offers:
        return None
    kernel = facts.kernel
    if kernel is None:
        if not trust_unattested or not same_host or claimed_pid <= 0:
            return None
        kernel = KernelPeer(claimed_pid, -1, -1, "")
    if kernel.pid == facts.our_pid:
        return None
    we_map, they_map = facts.unsealed if kernel.attested else (False, False)
    return ShmTerms(
        kernel,
        send=not kernel.attested or facts.opens_ours,
        unsealed_in=we_map,
        unsealed_out=they_map and UNSEALED_OFFER in offers,
    )
