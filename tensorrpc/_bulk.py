"""The rules of a bulk connection per peer (issue 26): sans-I/O.

Under ``transport="frames"`` one connection per peer is one ordered stream, so a small
call's messages wait behind a large message's bytes. docs/design.md ("A bulk connection
per peer") gives the design: large CALLs and unary RESULTs go on a second connection of
the same session. This module holds its decisions; the shell (`tensorrpc._bulk_io`)
opens that connection, feeds this module what the kernel or a key said about each
connection and acts on its answers:

* `pipe_for`: which connection a message goes on (rule 3).
* `BulkBinder`: which session a bulk connection belongs to (rules 2 and 5). A token
  proves nothing alone (a third party could relay it): the bulk connection must be
  vouched for by the **same** key (CURVE) or the **same** process (kernel credentials
  over ``ipc://``) as the session's control connection. Nothing vouches over plain
  ``tcp://``, and the bulk path is then off.
* `Wires`: which connection (the descriptor the socket monitor and ``ZMQ_SRCFD`` name)
  carries each listening pipe that sent an ATTACH, so that a pipe's loss is seen (rule
  5) and a pipe that breaks the rules is closed (rule 2).
* `EarlyCancels`: a CANCEL that overtook its CALL (rule 4).
* `listen_endpoint` / `dial_endpoint`: where the listener binds its bulk socket, and
  what the dialer accepts to dial (rule 1).

No I/O, no clock, no randomness of its own: the shell passes tokens in (from
``secrets``) and says when a connection is gone.
"""

from __future__ import annotations

import enum
import hmac
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from tensorrpc._protocol import MessageKind

if TYPE_CHECKING:
    from collections.abc import Hashable

__all__ = [
    "BULK_THRESHOLD",
    "MAX_IPC_PATH",
    "MAX_ATTACH_BYTES",
    "TOKEN_BYTES",
    "Attached",
    "BulkBinder",
    "EarlyCancels",
    "Pipe",
    "Voucher",
    "Wires",
    "dial_endpoint",
    "listen_endpoint",
    "pipe_for",
]

#: Messages whose out-of-band frames reach this many bytes may go on the bulk pipe.
BULK_THRESHOLD: Final = 1 << 20
#: Size of a session's attach token (128 bits).
TOKEN_BYTES: Final = 16
#: The most bytes an ATTACH may take (header and body; it is some 60): a larger first
#: message of a pipe is no ATTACH, and its connection is closed.
MAX_ATTACH_BYTES: Final = 256
#: Longest ``ipc://`` path a unix socket address holds (``sun_path`` less its NUL).
MAX_IPC_PATH: Final = 107


class Pipe(enum.Enum):
    """The two connections of one session."""

    CONTROL = "control"
    BULK = "bulk"


_BULK_KINDS: Final = frozenset({MessageKind.CALL, MessageKind.RESULT})


def pipe_for(
    kind: MessageKind,
    oob_bytes: int,
    *,
    stream: bool,
    bound: bool,
    threshold: int = BULK_THRESHOLD,
) -> Pipe:
    """Rule 3: the connection a message goes on.

    Only a CALL or a unary RESULT whose out-of-band frames reach ``threshold`` goes on a
    bound bulk pipe; everything else (handshake, heartbeats, CANCEL, CREDIT, RELEASE,
    ERROR, BYE, stream items and their CALL) stays on control, in today's order.
    """
    if bound and not stream and oob_bytes >= threshold and kind in _BULK_KINDS:
        return Pipe.BULK
    return Pipe.CONTROL


def listen_endpoint(control: str, *, curve: bool) -> str | None:
    """Rule 1: where a listener binds its bulk socket, beside a bound control endpoint.

    ``ipc://PATH`` gives ``ipc://PATH.bulk`` (the kernel vouches for both); ``tcp://``
    gives the same host on an ephemeral port, with CURVE only (nothing vouches for a
    plain tcp connection). None: no bulk path (plain tcp, inproc, a path too long).
    """
    if control.startswith("ipc://"):
        path = control[len("ipc://") :] + ".bulk"
        if not path or len(path.encode()) > MAX_IPC_PATH:
            return None
        return "ipc://" + path
    if control.startswith("tcp://") and curve:
        host, sep, _port = control[len("tcp://") :].rpartition(":")
        return f"tcp://{host}:0" if sep and host else None
    return None


def dial_endpoint(announced: str, control: str) -> str | None:
    """Rule 1: the endpoint a dialer dials for a peer's announced bulk endpoint.

    The dialer dials only what it can tie to the peer it dialed, whatever the peer
    announced: over ``ipc://`` the control path with ``.bulk`` added (what
    `listen_endpoint` binds), over ``tcp://`` the control connection's host with the
    announced port (under CURVE, the same server key then proves the peer). The
    announcement only says that there is a bulk endpoint, and its tcp port. None:
    another transport, or a malformed announcement (not dialed).
    """
    for scheme in ("ipc://", "tcp://"):
        if control.startswith(scheme):
            break
    else:
        return None
    if not announced.startswith(scheme) or len(announced) <= len(scheme):
        return None
    if scheme == "ipc://":
        return listen_endpoint(control, curve=False)
    _host, sep, port = announced[len(scheme) :].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = control[len(scheme) :].rpartition(":")[0]
    return f"tcp://{host}:{int(port)}" if host else None


@dataclass(frozen=True, slots=True)
class Voucher:
    """What vouches for one connection, as the shell read it.

    ``kind`` is ``"curve"`` (``proof``: the peer's public key, the ZAP User-Id),
    ``"kernel"`` (``proof``: the peer process's pid, uid and start time, from the
    credentials of the very socket) or ``"none"`` (nothing: plain ``tcp://``).
    """

    kind: str
    proof: bytes | tuple[int, ...] = b""

    @property
    def attested(self) -> bool:
        """Whether a key or the kernel vouches for the connection at all."""
        return self.kind in ("curve", "kernel") and bool(self.proof)


@dataclass(slots=True)
class _Offer:
    session: Hashable
    token: bytes
    voucher: Voucher


@dataclass(frozen=True, slots=True)
class Attached:
    """`BulkBinder.attach`'s answer: the session (None: refused, ``refused`` says why;
    or ``parked``: no offer for that epoch yet, see `BulkBinder.parked`)."""

    session: Hashable | None
    refused: str = ""
    parked: bool = False


class BulkBinder:
    """The listening side's table: sessions that may attach a bulk pipe, and bound pipes.

    Capped: at most ``max_sessions`` offers (the oldest goes first) and
    ``max_unbound`` bulk pipes whose ATTACH waits for its session's offer (parked), of
    which at most ``max_unbound_per_peer`` per process or key: a flood from one peer
    evicts its own oldest pipes, never another peer's. An ATTACH that nothing vouches
    for is refused at once (it could never bind), so it costs nothing kept.
    """

    def __init__(
        self, *, max_sessions: int = 4096, max_unbound: int = 64, max_unbound_per_peer: int = 4
    ) -> None:
        if max_sessions < 1 or max_unbound < 1 or max_unbound_per_peer < 1:
            raise ValueError("the bulk binder's caps must be >= 1")
        self._max_sessions = max_sessions
        self._max_unbound = max_unbound
        self._max_per_peer = max_unbound_per_peer
        #: epoch (public, from the handshake) -> what that session may attach
        self._offers: OrderedDict[Hashable, _Offer] = OrderedDict()
        #: bulk pipe -> its session
        self._bound: dict[Hashable, Hashable] = {}
        #: session -> its bulk pipe
        self._pipes: dict[Hashable, Hashable] = {}
        #: bulk pipes opened, not yet attached (oldest first), with what vouches for each
        self._unbound: OrderedDict[Hashable, Voucher] = OrderedDict()
        #: epoch -> an ATTACH that came before its session's offer (the dialer's bulk
        #: connection may overtake the handshake's last message on the control one)
        self._parked: dict[Hashable, tuple[Hashable, bytes, Voucher]] = {}
        #: pipes whose ATTACH was refused (the newest ``max_sessions``): never another
        self._spent: OrderedDict[Hashable, None] = OrderedDict()

    def offer(self, session: Hashable, epoch: Hashable, voucher: Voucher, token: bytes) -> bool:
        """A session's handshake goes out: may it attach a bulk pipe with ``token``?

        Returns:
            False (no bulk path: the handshake announces none) when nothing vouches for
            the control connection; True when the token is on offer.

        Raises:
            ValueError: ``token`` is not `TOKEN_BYTES` long.
        """
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a bulk token is {TOKEN_BYTES} bytes, not {len(token)}")
        self.forget(session)  # a new epoch of a known session: its old pipe is gone
        if not voucher.attested:
            return False
        while len(self._offers) >= self._max_sessions:
            self._offers.popitem(last=False)
        self._offers[epoch] = _Offer(session, token, voucher)
        return True

    def opened(self, pipe: Hashable, voucher: Voucher) -> Hashable | None:
        """A bulk pipe sent its ATTACH (``voucher``: what vouches for its connection);
        returns a pipe to close now, or None: past the per-peer cap, that peer's oldest
        unbound pipe; else past the total cap, the oldest unbound pipe."""
        self._unbound.pop(pipe, None)
        mine = [p for p, v in self._unbound.items() if v == voucher]
        self._unbound[pipe] = voucher
        if len(mine) >= self._max_per_peer:
            oldest: Hashable = mine[0]
            del self._unbound[oldest]
        elif len(self._unbound) > self._max_unbound:
            oldest, _ = self._unbound.popitem(last=False)
        else:
            return None
        self._unpark(oldest)
        return oldest

    def _unpark(self, pipe: Hashable) -> None:
        for epoch in [e for e, parked in self._parked.items() if parked[0] == pipe]:
            del self._parked[epoch]

    def parked(self, epoch: Hashable) -> tuple[Hashable, bytes, Voucher] | None:
        """The ATTACH parked for ``epoch`` (pipe, token, voucher), taken: after `offer`,
        the shell attaches it now."""
        return self._parked.pop(epoch, None)

    def attach(self, pipe: Hashable, epoch: Hashable, token: bytes, voucher: Voucher) -> Attached:
        """Rule 2: bind ``pipe`` to the session whose handshake gave ``token``.

        One ATTACH per pipe, whatever its outcome. Refused (the shell closes the pipe;
        the session goes on, control only): an unknown or bound pipe, an unknown epoch,
        a wrong token, a token already used, a session that has a bulk pipe, or a
        connection not vouched for by the same key or process as the session's control
        connection.
        """
        if pipe in self._spent:
            self._unbound.pop(pipe, None)
            return Attached(None, "one ATTACH per bulk pipe")
        got = self._attach(pipe, epoch, token, voucher)
        if got.session is None and not got.parked and pipe not in self._bound:
            self._spent[pipe] = None
            if len(self._spent) > self._max_sessions:
                self._spent.popitem(last=False)
        return got

    def _attach(self, pipe: Hashable, epoch: Hashable, token: bytes, voucher: Voucher) -> Attached:
        if pipe in self._bound:
            return Attached(None, "this bulk pipe is attached already")
        opened_by = self._unbound.pop(pipe, None)
        if opened_by is None:
            return Attached(None, "unknown bulk pipe")
        if not voucher.attested:
            return Attached(None, "nothing vouches for the bulk connection")
        offer = self._offers.get(epoch)
        if offer is None:
            if epoch in self._parked:
                return Attached(None, "a bulk pipe waits for this epoch already")
            # Perhaps the session's handshake is not done here yet: wait for its offer
            # (an unbound pipe still, capped as one).
            self._unbound[pipe] = opened_by
            self._parked[epoch] = (pipe, token, voucher)
            return Attached(None, parked=True)
        if not hmac.compare_digest(offer.token, token):
            return Attached(None, "wrong bulk token")
        # The token was right: used once, whatever follows (a relayed token is spent).
        del self._offers[epoch]
        if voucher != offer.voucher:
            what = "key" if offer.voucher.kind == "curve" else "process"
            return Attached(
                None, f"the bulk connection is not vouched for by the control connection's {what}"
            )
        if offer.session in self._pipes:
            return Attached(None, "this session has a bulk pipe already")
        self._bound[pipe] = offer.session
        self._pipes[offer.session] = pipe
        return Attached(offer.session)

    def session_of(self, pipe: Hashable) -> Hashable | None:
        """The session a bulk pipe is bound to; None: drop what it sent (constant cost)."""
        return self._bound.get(pipe)

    def bound(self) -> list[Hashable]:
        """The bound bulk pipes."""
        return list(self._bound)

    def pipe_of(self, session: Hashable) -> Hashable | None:
        """The session's bound bulk pipe, if any (`pipe_for`'s ``bound``)."""
        return self._pipes.get(session)

    def pipe_lost(self, pipe: Hashable) -> Hashable | None:
        """Rule 5: a bulk pipe disconnected; returns its session (whose calls on it fail
        as on an engine death), or None."""
        self._unbound.pop(pipe, None)
        self._unpark(pipe)
        session = self._bound.pop(pipe, None)
        if session is not None:
            self._pipes.pop(session, None)
        return session

    def forget(self, session: Hashable) -> Hashable | None:
        """The session ended (or a new epoch began): its offer and pipe go; returns the
        pipe to close, or None."""
        for epoch in [e for e, o in self._offers.items() if o.session == session]:
            del self._offers[epoch]
        pipe = self._pipes.pop(session, None)
        if pipe is not None:
            self._bound.pop(pipe, None)
        return pipe


class Wires:
    """The listening side's connections, by the descriptor libzmq holds for each.

    A ROUTER names a peer by routing id, but its monitor names connections by
    descriptor (accepted, disconnected), and a message tells its descriptor
    (``ZMQ_SRCFD``). The shell feeds both here in the order libzmq reported them:
    libzmq reports a connection before any message of it can be received, and its end
    before it closes (and may reuse) the descriptor. So, read just after a message, a
    descriptor that is still up carries the connection that message came on (unless that
    one ended and a new one took the number in between: then the new one is the one
    `wire` ties to the pipe, and a later message of the pipe on another descriptor shows
    the mix-up: `moved`).

    Bounded by the connections open: a descriptor is forgotten when its connection ends.
    """

    __slots__ = ("_fds", "_live", "_pipes")

    def __init__(self) -> None:
        self._live: set[int] = set()
        #: descriptor -> the pipe whose ATTACH came on it
        self._pipes: dict[int, Hashable] = {}
        #: pipe -> its descriptor
        self._fds: dict[Hashable, int] = {}

    def up(self, fd: int) -> None:
        """The monitor reported a connection on ``fd``."""
        self._live.add(fd)

    def down(self, fd: int) -> Hashable | None:
        """The monitor reported the connection on ``fd`` ended; returns the pipe it
        carried (None: none that sent an ATTACH)."""
        self._live.discard(fd)
        pipe = self._pipes.pop(fd, None)
        if pipe is not None:
            del self._fds[pipe]
        return pipe

    def live(self, fd: int) -> bool:
        """Whether ``fd`` carries a connection now (one the monitor reported, not ended)."""
        return fd in self._live

    def fd_of(self, pipe: Hashable) -> int:
        """The descriptor ``pipe``'s ATTACH came on (-1: none known)."""
        return self._fds.get(pipe, -1)

    def pipe_on(self, fd: int) -> Hashable | None:
        """The pipe whose ATTACH came on ``fd`` (None: none)."""
        return self._pipes.get(fd)

    def wire(self, pipe: Hashable, fd: int) -> bool:
        """Tie ``pipe`` (its ATTACH came on ``fd``) to that connection; False: the
        connection has ended already (the pipe is gone)."""
        if fd not in self._live:
            return False
        self.drop(pipe)
        old = self._pipes.get(fd)
        if old is not None:
            del self._fds[old]
        self._pipes[fd] = pipe
        self._fds[pipe] = fd
        return True

    def moved(self, pipe: Hashable, fd: int) -> bool:
        """A message of ``pipe`` came on ``fd``: True when that is not the connection its
        ATTACH came on (the dialer reconnected: what the first connection carried last
        may be lost, as on its loss)."""
        wired = self._fds.get(pipe)
        return wired is not None and wired != fd

    def drop(self, pipe: Hashable) -> None:
        """Forget ``pipe`` (its session ended, or it was refused)."""
        fd = self._fds.pop(pipe, None)
        if fd is not None:
            del self._pipes[fd]

    def __len__(self) -> int:
        return len(self._fds)


class EarlyCancels:
    """Rule 4: CANCELs for calls not seen yet (the CALL may be behind on the bulk pipe).

    Bounded per session (``limit`` ids, the oldest forgotten first): a CALL whose id is
    remembered here is dropped instead of run.
    """

    def __init__(self, limit: int = 1024) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self._limit = limit
        self._ids: OrderedDict[int, bool] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def cancelled(self, call_id: int) -> None:
        """A CANCEL came for a call id the session does not know."""
        self._ids[call_id] = True
        self._ids.move_to_end(call_id)
        while len(self._ids) > self._limit:
            self._ids.popitem(last=False)

    def take(self, call_id: int) -> bool:
        """A CALL arrived: True when it was cancelled already (drop it)."""
        return self._ids.pop(call_id, False)
