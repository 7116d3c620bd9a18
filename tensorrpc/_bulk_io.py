"""The bulk connections' shell: one side's bulk sockets, readers and routes (issue 26).

docs/design.md ("A bulk connection per peer") gives the design and `tensorrpc._bulk`
its rules; this shell only opens sockets, reads what the kernel or a key says about a
connection (`tensorrpc._zmq.connection_voucher`) and acts on the rules' answers. Both
the client and the engine hold one `BulkLinks`:

* **Listening** (the side whose control socket is bound): one ROUTER bound beside the
  first control endpoint that something can vouch for (`tensorrpc._bulk.listen_endpoint`),
  announced in the handshake with a per-session token. A dialer's first message on it
  must be ATTACH; `BulkBinder` binds the connection (its routing id, 128 random bits the
  dialer drew) to the session only for the right token **and** the same key or process
  as the session's control connection, and the answer (ATTACH) goes back on it. The
  ROUTER never hands a routing id over to a newer connection, so a bound routing id
  stays with the connection that attached it.
* **Dialing**: one DEALER per session, dialed to the announced endpoint
  (`tensorrpc._bulk.dial_endpoint`), whose first message is ATTACH; it carries large
  messages only once the listener's answer came.

Messages on a bound bulk connection are handed to the owner's ``deliver`` under the
session's control key, as if they had come on the control connection (the owner tells its
machine which connection it was: a BYE comes on both, rule 4).

**Connections, not just routing ids** (rules 2 and 5): the listening ROUTER's monitor
reports each connection (its descriptor) coming and going, and each message says which
descriptor it came on (``ZMQ_SRCFD``); `tensorrpc._bulk.Wires` ties a pipe to the
connection its ATTACH came on. So the listener sees a bound pipe's connection end (the
owner's ``on_lost``, after the messages it carried last are handled), and closes the
connection of a pipe that breaks the rules (its first message is no ATTACH, or one
refused): such a peer gets one message in, not a stream of them up to ``maxmsgsize``
each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import stat
from typing import TYPE_CHECKING, Final, cast

import anyio
import zmq

from tensorrpc._background import lower_zmq_bulk_thread
from tensorrpc._bulk import (
    BULK_THRESHOLD,
    MAX_ATTACH_BYTES,
    TOKEN_BYTES,
    BulkBinder,
    Voucher,
    Wires,
    dial_endpoint,
    listen_endpoint,
)
from tensorrpc._exceptions import ClosedError, RemoteProtocolError, TensorRPCError
from tensorrpc._protocol import (
    Attach,
    Bye,
    MessageKind,
    decode_control,
    encode_control,
    split_frames,
)
from tensorrpc._release import later_if_large, nbytes
from tensorrpc._text import peer_text
from tensorrpc._zmq import (
    AsyncSocket,
    SocketOptions,
    connection_voucher,
    create_socket,
    shut_connection,
    source_fd,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    _Handler = Callable[[list[zmq.Frame], int], None]

    from anyio.abc import TaskGroup
    from typing_extensions import Buffer

    from tensorrpc._protocol import Welcome
    from tensorrpc._security import CurveConfig
    from tensorrpc._server_protocol import Session

__all__ = ["BulkLinks"]

logger = logging.getLogger("tensorrpc.security")

_ATTACH: Final = MessageKind.ATTACH
_ATTACH_BYTE: Final = int(MessageKind.ATTACH)
#: Refusals logged at WARNING (then DEBUG: a stranger retrying must not flood the log).
_MAX_LOGGED: Final = 16
#: Messages handled at most when a lost connection's last ones are read at once.
_DRAIN_LIMIT: Final = 4096


class _Dialed:
    """A bulk connection this side dialed for one session."""

    __slots__ = ("bound", "epoch", "sock")

    def __init__(self, sock: AsyncSocket, epoch: int) -> None:
        self.sock = sock
        self.epoch = epoch
        self.bound = False


def _pipe_id() -> bytes:
    """A fresh routing id for a dialed bulk connection: 128 random bits (not 0-led)."""
    rid = secrets.token_bytes(TOKEN_BYTES)
    return rid if rid[0] else b"\x01" + rid[1:]


def _kind(frames: Sequence[object]) -> int:
    """The header's kind byte of a message (0: no header)."""
    if not frames:
        return 0
    header = memoryview(frames[0])  # type: ignore[arg-type]
    return header[3] if header.nbytes > 3 else 0


def _path_taken(endpoint: str) -> str | None:
    """Why the bulk socket must not bind ``endpoint`` (None: it may).

    ZMQ removes whatever is at an ``ipc://`` path before binding it. The control path is
    the user's to choose; ``PATH.bulk`` beside it is derived, so anything there but a
    socket file of our own user (a stale one of ours) is left alone: a file, a
    directory, a symlink (never followed) or another user's socket turns the bulk path
    off instead.
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    path = endpoint[len("ipc://") :]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
        return None
    return f"{path} exists and is not a socket of ours"


class BulkLinks:
    """One side's bulk connections (see the module docstring).

    Args:
        options: The control socket's options (the bulk sockets take the same).
        curve: The control socket's CURVE configuration (None: plaintext).
        deliver: ``deliver(key, frames, size)`` handles a message of a bound bulk
            connection as if it came on the control connection of the session ``key``
            (``frames``: after any routing id).
        threshold: Out-of-band bytes from which a CALL or unary RESULT goes on the bulk
            connection.
        on_lost: ``on_lost(key, epoch, listening)``: the bound bulk connection of the
            session ``key`` broke (rule 5), after what it carried last was delivered.
            ``epoch`` is the listener's epoch of that session: ours when ``listening``.
            None: this side does not watch its bulk connections (the other side does).
        on_bound: ``on_bound(key, epoch, listening)``: the session ``key``'s bulk
            connection was bound (same arguments): a BYE will come on it too (rule 4).
    """

    def __init__(
        self,
        options: SocketOptions,
        curve: CurveConfig | None,
        deliver: Callable[[Hashable, list[zmq.Frame], int], None],
        *,
        threshold: int = BULK_THRESHOLD,
        on_lost: Callable[[Hashable, int, bool], None] | None = None,
        on_bound: Callable[[Hashable, int, bool], None] | None = None,
    ) -> None:
        self._options = options
        self._on_lost = on_lost
        self._on_bound = on_bound
        self._curve = curve
        self._deliver = deliver
        self.threshold = threshold
        self.binder = BulkBinder()
        #: The listening ROUTER's connections (which one carries which pipe).
        self.wires = Wires()
        #: Bound listening pipes whose connection ended: lost once what is queued is read.
        self._dying: list[Hashable] = []
        #: Bound listening pipe -> its session's epoch (ours).
        self._epochs: dict[Hashable, int] = {}
        #: The listening ROUTER (None: this side does not listen for bulk connections).
        self.router: AsyncSocket | None = None
        #: The endpoint the handshake announces ("" when none).
        self.address = ""
        self._dialed: dict[Hashable, _Dialed] = {}
        self._tg: TaskGroup | None = None
        self._closed = False
        #: ATTACHes refused (a wrong token, another process or key, no such session) and
        #: pipes whose first message was no ATTACH.
        self.refused = 0
        #: Connections of refused pipes this side closed.
        self.shut = 0

    # -- lifecycle --------------------------------------------------------------------------

    def listen(self, *controls: str) -> str:
        """Bind the listening ROUTER beside the first bound control endpoint of
        ``controls`` that something can vouch for.

        Returns:
            The endpoint to announce ("" when nothing could vouch for a connection
            there: plain tcp, inproc).
        """
        if self.router is not None:
            return self.address
        curve = self._curve is not None
        endpoint = next(
            (e for c in controls if (e := listen_endpoint(c, curve=curve)) is not None), None
        )
        if endpoint is None:
            return self.address
        if (why := _path_taken(endpoint)) is not None:
            logger.warning("no bulk connection: %s", peer_text(why, 256))
            return self.address
        # A bound routing id is never handed over to a newer connection that claims it.
        options = dataclasses.replace(self._options, router_handover=False)
        sock = create_socket(
            zmq.ROUTER, options=options, curve=self._curve, watch_connections=True, bulk=True
        )
        try:
            self.address = sock.bind(endpoint)
        except TensorRPCError as exc:
            sock.close()
            logger.warning("no bulk connection: %s", peer_text(str(exc), 256))
            return self.address
        except BaseException:
            sock.close()
            raise
        self.router = sock
        return self.address

    def start(self, tg: TaskGroup) -> None:
        """Start the listening ROUTER's reader and watch in ``tg`` (dialed readers start
        there too)."""
        self._tg = tg
        router = self.router
        if router is not None:
            tg.start_soon(self._read, router, self._on_router_message, name="tensorrpc bulk reader")
            tg.start_soon(self._router_watch, router, name="tensorrpc bulk watch")

    def close(self, linger_ms: int | None = None, *, bye: str = "") -> None:
        """Close every bulk socket (their readers end); ``linger_ms``: let ZMQ flush what
        is queued on them (the last RESULTs and BYEs) that long (None: the sockets'
        own linger); ``bye``: first say BYE with that reason on each bound one
        (`goodbye`)."""
        if bye and not self._closed:
            self.goodbye(bye)
        self._closed = True
        sockets = [d.sock for d in self._dialed.values()]
        self._dialed.clear()
        router, self.router = self.router, None
        if router is not None:
            sockets.append(router)
        for sock in sockets:
            if linger_ms is not None and not sock.closed:
                with contextlib.suppress(zmq.ZMQError):
                    sock.socket.setsockopt(zmq.LINGER, linger_ms)
            sock.close()

    # -- sessions ---------------------------------------------------------------------------

    def offer(self, peer: Hashable, epoch: int, voucher: Voucher, token: bytes) -> None:
        """Listening: the session ``peer`` (our handshake gave it ``token`` for ``epoch``;
        ``voucher``: what vouches for its control connection) may attach a bulk
        connection."""
        if self.router is None or not token:
            return
        self.binder.offer(peer, epoch, voucher, token)
        parked = self.binder.parked(epoch)
        if parked is not None:  # its ATTACH overtook the handshake
            pipe, token_got, voucher = parked
            self._bind(pipe, epoch, token_got, voucher)

    def session_started(self, session: Session, welcome: Welcome, frame: object) -> None:
        """The engine's side: a session began (its client's WELCOME, on ``frame``): offer
        it our bulk endpoint (listening), or dial the client's (dial-in)."""
        self.forget(session.key)
        if session.bulk_token:
            voucher = connection_voucher(frame) if frame is not None else Voucher("none")
            self.offer(session.key, session.epoch, voucher, session.bulk_token)
        elif welcome.bulk and isinstance(session.key, str):  # dial-in: key is the address
            self.dial(session.key, welcome.bulk, session.key, welcome.epoch, welcome.bulk_token)

    def dial(self, peer: Hashable, announced: str, control: str, epoch: int, token: str) -> None:
        """Dialing: the session ``peer``'s handshake announced a bulk endpoint: dial it
        and ATTACH (``control``: the address the control connection dialed)."""
        self.forget(peer)
        tg = self._tg
        endpoint = dial_endpoint(announced, control)
        if tg is None or self._closed or endpoint is None or not announced or not token:
            return
        try:
            attach = encode_control(_ATTACH, Attach(epoch, token))
            sock = create_socket(
                zmq.DEALER,
                options=self._options,
                routing_id=_pipe_id(),
                curve=self._curve,
                watch_connections=self._on_lost is not None,
                bulk=True,
            )
        except (TensorRPCError, ValueError) as exc:
            logger.debug("no bulk connection to %s: %s", peer_text(announced), exc)
            return
        try:
            sock.connect(endpoint)
            sock.send_nowait(attach)  # queued until the connection is up
        except (TensorRPCError, anyio.WouldBlock) as exc:
            sock.close()
            logger.debug("no bulk connection to %s: %r", peer_text(announced), exc)
            return
        dialed = self._dialed[peer] = _Dialed(sock, epoch)
        handle = functools.partial(self._on_dealer_message, peer, dialed)
        tg.start_soon(self._read, sock, handle, name="tensorrpc bulk reader")
        if self._on_lost is not None:
            tg.start_soon(self._dealer_watch, peer, dialed, handle, name="tensorrpc bulk watch")

    def forget(self, peer: Hashable) -> None:
        """The session ``peer`` ended (or starts anew): its bulk connection goes."""
        self._unbind(self.binder.forget(peer))
        self._close_dialed(peer)

    def _unbind(self, pipe: Hashable | None) -> None:
        if pipe is not None:
            self.wires.drop(pipe)
            self._epochs.pop(pipe, None)

    def _close_dialed(self, peer: Hashable) -> None:
        dialed = self._dialed.pop(peer, None)
        if dialed is not None:
            dialed.sock.close()

    # -- sending ----------------------------------------------------------------------------

    def route(
        self,
        peer: Hashable,
        frames: Sequence[Buffer],
        oob: Sequence[Buffer],
        stream: int = 0,
        *,
        routed: bool = False,
    ) -> tuple[AsyncSocket, list[Buffer]] | None:
        """Where a CALL or unary RESULT to ``peer`` goes (rule 3): the bulk socket and
        the parts to send there, or None (the control connection).

        Args:
            peer: The session's control key.
            frames: The message (header, payload, buffers).
            oob: Its out-of-band buffers.
            stream: Non-zero for a streaming call's CALL (it stays on control).
            routed: ``frames`` start with the control connection's routing id.
        """
        if stream or not oob or nbytes(oob) < self.threshold:
            return None
        if routed:
            frames = frames[1:]
        dialed = self._dialed.get(peer)
        if dialed is not None:
            return (dialed.sock, list(frames)) if dialed.bound else None
        if self.router is None:
            return None
        pipe = self.binder.pipe_of(peer)
        if pipe is None:
            return None
        return self.router, [pipe, *frames]  # type: ignore[list-item]

    def goodbye(self, reason: str) -> None:
        """Rule 4: a draining side's BYE goes on every bound bulk connection too, behind
        any RESULT still on it (one that cannot be queued is left out: the connection's
        end says the same)."""
        frames = encode_control(MessageKind.BYE, Bye(reason))
        targets: list[tuple[AsyncSocket, list[Buffer]]] = [
            (d.sock, list(frames)) for d in self._dialed.values() if d.bound
        ]
        router = self.router
        if router is not None:
            targets += [(router, [pipe, *frames]) for pipe in self.binder.bound()]  # type: ignore[list-item]
        for sock, parts in targets:
            try:
                sock.send_nowait(parts)
            except (TensorRPCError, anyio.WouldBlock) as exc:
                logger.debug("no BYE on a bulk connection: %r", exc)

    def lost(self, peer: Hashable) -> None:
        """A send on ``peer``'s bulk connection failed (it is gone): control only now."""
        pipe = self.binder.pipe_of(peer)
        if pipe is not None:
            self.binder.pipe_lost(pipe)
            self._unbind(pipe)
        self._close_dialed(peer)

    # -- receiving --------------------------------------------------------------------------

    async def _read(self, sock: AsyncSocket, handle: _Handler) -> None:
        """A bulk socket's reader: every message to ``handle``, then freed off the loop if
        large; lost connections found meanwhile are handled after it."""
        while True:
            try:
                frames = await sock.recv()
            except ClosedError:
                return
            except TensorRPCError as exc:
                logger.warning("bulk reader stopped: %s", exc)
                return
            _handle(handle, frames)
            del frames
            if self._dying:
                self._bury()

    def _on_router_message(self, frames: list[zmq.Frame], size: int) -> None:
        pipe = frames[0].bytes
        body = frames[1:]
        session = self.binder.session_of(pipe)
        if session is not None:
            if self.wires.moved(pipe, source_fd(body[0])):
                # The dialer reconnected: the first connection ended and what it carried
                # last may be lost, so the pipe is lost (rule 5).
                self.wires.drop(pipe)
                self._dying.append(pipe)
                return
            self._deliver(session, body, size - len(pipe))
            return
        self._sync()  # what the monitor says of the descriptors, before trusting one
        fd = source_fd(body[0])
        if _kind(body) != _ATTACH_BYTE or size - len(pipe) > MAX_ATTACH_BYTES:
            # Rule 2: a pipe's first message is its ATTACH, and it sends nothing else
            # before the answer. Dropped, and its connection closed.
            self._refused(pipe, "a bulk pipe sent something other than ATTACH")
            if self.wires.pipe_on(fd) in (None, pipe):
                self._shut(pipe, fd)
            return
        if not self.wires.live(fd):
            return  # its connection ended already: nothing to bind, nobody to answer
        self._on_attach(pipe, body, fd)

    def _on_attach(self, pipe: bytes, frames: list[zmq.Frame], fd: int) -> None:
        try:
            header, payload, _ = split_frames(cast("list[Buffer]", frames))
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            self._refused(pipe, f"malformed ATTACH: {exc}")
            self._shut(pipe, fd)
            return
        assert isinstance(body, Attach)
        try:
            token = bytes.fromhex(body.token)
        except ValueError:
            token = b""
        if len(token) != TOKEN_BYTES:
            self._refused(pipe, "malformed bulk token")
            self._shut(pipe, fd)
            return
        voucher = connection_voucher(frames[1])
        self.wires.wire(pipe, fd)
        evicted = self.binder.opened(pipe, voucher)
        if evicted is not None:
            self.refused += 1
            self._shut(evicted, self.wires.fd_of(evicted))
        self._bind(pipe, body.epoch, token, voucher)

    def _bind(self, pipe: Hashable, epoch: int, token: bytes, voucher: Voucher) -> None:
        got = self.binder.attach(pipe, epoch, token, voucher)
        if got.parked:
            return
        if got.session is None:
            self._refused(pipe, got.refused)
            self._shut(pipe, self.wires.fd_of(pipe))
            return
        router = self.router
        if router is None:
            return
        try:
            router.send_nowait([pipe, *encode_control(_ATTACH, Attach(epoch))])  # type: ignore[list-item]
        except (TensorRPCError, anyio.WouldBlock) as exc:
            self.binder.pipe_lost(pipe)
            self.wires.drop(pipe)
            logger.debug("could not answer an ATTACH: %r", exc)
            return
        self._epochs[pipe] = epoch
        lower_zmq_bulk_thread()
        if self._on_bound is not None:
            self._on_bound(got.session, epoch, True)

    def _refused(self, pipe: Hashable, why: str) -> None:
        self.refused += 1
        log = logger.warning if self.refused <= _MAX_LOGGED else logger.debug
        log("refused a bulk connection: %s", peer_text(why, 256))

    def _shut(self, pipe: Hashable, fd: int) -> None:
        """Close the connection of a refused pipe (``fd``, if it still carries it)."""
        self.wires.drop(pipe)
        if fd >= 0 and self.wires.live(fd) and shut_connection(fd):
            self.shut += 1

    def _sync(self) -> None:
        """Apply the listening ROUTER's connection events: a bound pipe whose connection
        ended is lost (`_bury`); one not bound is forgotten."""
        router = self.router
        if router is None:
            return
        wires = self.wires
        for up, fd in router.connection_events():
            if up:
                wires.up(fd)
                continue
            pipe = wires.down(fd)
            if pipe is None:
                continue
            if self.binder.session_of(pipe) is not None:
                self._dying.append(pipe)
            else:
                self.binder.pipe_lost(pipe)

    async def _router_watch(self, router: AsyncSocket) -> None:
        """Rule 5, listening: a bound pipe's connection ended: its session is over."""
        while True:
            try:
                await router.disconnected()
            except ClosedError:
                return
            self._sync()
            if self._dying:
                self._bury()

    def _bury(self) -> None:
        """The bound pipes whose connection ended are lost, once the messages already
        received are handled: libzmq queues what a connection carried before it reports
        its end, so a RESULT or BYE sent just before is not lost with it."""
        router = self.router
        while self._dying:
            if router is not None and not router.closed:
                _drain(router, self._on_router_message)
            dying, self._dying = self._dying, []
            for pipe in dying:
                epoch = self._epochs.pop(pipe, None)
                session = self.binder.pipe_lost(pipe)
                self.wires.drop(pipe)
                if session is not None and epoch is not None and self._on_lost is not None:
                    self._on_lost(session, epoch, True)

    def _on_dealer_message(
        self, peer: Hashable, dialed: _Dialed, frames: list[zmq.Frame], size: int
    ) -> None:
        if dialed.bound:
            self._deliver(peer, frames, size)
        elif _kind(frames) == _ATTACH_BYTE:
            header, payload, _ = split_frames(cast("list[Buffer]", frames))
            body = decode_control(header, payload)
            if isinstance(body, Attach) and body.epoch == dialed.epoch:
                dialed.bound = True  # large messages may go on it from now on
                lower_zmq_bulk_thread()
                if self._on_bound is not None:
                    self._on_bound(peer, dialed.epoch, False)

    async def _dealer_watch(self, peer: Hashable, dialed: _Dialed, handle: _Handler) -> None:
        """Rule 5, dialling: the connection broke after its ATTACH was answered: the
        session is over (``on_lost``, once what it carried last is handled); one that
        breaks before carried nothing."""
        on_lost = self._on_lost
        assert on_lost is not None
        sock = dialed.sock
        while True:
            try:
                await sock.disconnected()
            except ClosedError:
                return
            sock.connection_events()  # not needed here: not kept
            if self._dialed.get(peer) is not dialed:
                return
            _drain(sock, handle)  # the answer, or a BYE that ends the session first
            if dialed.bound and self._dialed.get(peer) is dialed:
                self._close_dialed(peer)
                on_lost(peer, dialed.epoch, False)
                return


def _handle(handle: _Handler, frames: list[zmq.Frame]) -> None:
    """One bulk message to ``handle``; a large one is then freed off the loop."""
    size = nbytes(frames)
    try:
        handle(frames, size)
    except RemoteProtocolError as exc:
        logger.debug("dropped a bulk message: %s", peer_text(str(exc), 256))
    except Exception:  # one bad message must never stop the reader
        logger.exception("error handling a bulk message")
    later_if_large(frames, size)


def _drain(sock: AsyncSocket, handle: _Handler) -> None:
    """Handle the messages ``sock`` holds now (bounded), without waiting."""
    for _ in range(_DRAIN_LIMIT):
        try:
            frames = sock.recv_nowait()
        except (anyio.WouldBlock, TensorRPCError):  # ClosedError: a handler closed it
            return
        _handle(handle, frames)
        del frames
