"""The engine's sockets: opening them, the receive loops, and every send.

`ServerSockets` is the socket half of the engine's I/O shell (`tensorrpc._server`):

* **Dial-in** (``connect=``): one DEALER per client address, routing id
  ``engine_id + "/" + nonce`` (unique per incarnation), with ``ZMQ_IMMEDIATE`` so that a
  HELLO is only queued on a live connection. **Listen** (``bind=``): one ROUTER bound to
  every address; a client is keyed by its routing id.
* One receive loop per socket feeds each message and the time to the protocol, hands an
  accepted call to the shell and lets the shell flush what the protocol queued.
* Small messages are sent without waiting (``send_nowait``; dropped and counted when ZMQ
  is full); a worker's reply may wait a bounded time, and the memory of a zero-copy
  reply is held (`PendingSends`) until ZMQ's tracker says it is done.

Every socket operation happens on the event-loop thread. Sockets are opened through
`tensorrpc._zmq`, the only module that creates them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import zmq

from tensorrpc._exceptions import ClosedError, PeerUnreachableError, TransportError
from tensorrpc._release import later_if_large, nbytes
from tensorrpc._text import peer_text
from tensorrpc._zmq import AsyncSocket, PendingSends, SocketOptions, create_socket

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    from anyio.abc import TaskGroup
    from typing_extensions import Buffer

    from tensorrpc._dispatch import Call
    from tensorrpc._security import CurveConfig
    from tensorrpc._server_protocol import ServerProtocol

__all__ = ["ServerSockets"]

logger = logging.getLogger("tensorrpc.server")

# How long the sockets may keep flushing the last replies and BYEs after close.
_CLOSE_LINGER_MS: Final = 1000


class ServerSockets:
    """An engine's sockets, their receive loops and its sends (see the module docstring).

    Args:
        proto: The engine's protocol (fed what arrives; counts what is dropped).
        engine_id: For log lines.
        routing_id: Dial-in: the DEALERs' routing id.
        binds: Listen mode: the addresses to bind the ROUTER to (empty: dial in).
        addresses: Dial-in mode: the clients' addresses.
        options: Socket options.
        curve: CURVE configuration, or None.
        reply_patience: Seconds a reply may wait for room in ZMQ (``dead_after``).
    """

    def __init__(
        self,
        proto: ServerProtocol,
        *,
        engine_id: str,
        routing_id: bytes,
        binds: Sequence[str],
        addresses: Sequence[str],
        options: SocketOptions,
        curve: CurveConfig | None,
        reply_patience: float,
    ) -> None:
        self._proto = proto
        self._engine_id = engine_id
        self._routing_id = routing_id
        self._binds = tuple(binds)
        self._addresses = tuple(addresses)
        self._options = options
        self._curve = curve
        self._patience = reply_patience
        #: Listen mode: the bound endpoints, in the order of ``binds``.
        self.endpoints: list[str] = []
        self._router: AsyncSocket | None = None
        self._dealers: dict[str, AsyncSocket] = {}
        #: Every socket opened.
        self.sockets: list[AsyncSocket] = []
        self._pending = PendingSends()

    # -- open and close ---------------------------------------------------------------------

    def open(self) -> None:
        """Bind the ROUTER, or connect one DEALER per client (each added to the protocol)."""
        options, curve = self._options, self._curve
        try:
            if self._binds:
                sock = self._router = create_socket(zmq.ROUTER, options=options, curve=curve)
                self.sockets.append(sock)
                self.endpoints.extend(sock.bind(address) for address in self._binds)
                logger.info("engine %r listening on %s", self._engine_id, self.endpoints)
                return
            now = time.monotonic()
            for address in self._addresses:
                sock = create_socket(
                    zmq.DEALER, options=options, routing_id=self._routing_id, curve=curve
                )
                self._dealers[address] = sock
                self.sockets.append(sock)
                # Only queue on a live connection: no HELLOs piling up while the client
                # is down, and sends to a vanished client fail fast.
                sock.socket.setsockopt(zmq.IMMEDIATE, 1)
                sock.connect(address)
                self._proto.add_client(address, now)
            logger.info("engine %r dialling %s", self._engine_id, ", ".join(self._addresses))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close every socket (letting ZMQ flush the last replies and BYEs a while)."""
        for sock in self.sockets:
            if not sock.closed:
                with contextlib.suppress(zmq.ZMQError):
                    sock.socket.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
                sock.close()
        self._pending.clear()

    def housekeeping(self, sweep: bool) -> None:
        """Release the memory of finished zero-copy sends; on ``sweep``, log failed
        handshakes (CURVE) at WARNING."""
        if sweep:
            for sock in self.sockets:
                sock.handshake_failures()
        self._pending.prune()

    # -- receiving --------------------------------------------------------------------------

    def start(
        self, tg: TaskGroup, accepted: Callable[[Call, int], None], flush: Callable[[], None]
    ) -> None:
        """Start one receive loop per socket in ``tg``.

        Args:
            tg: Where the loops run.
            accepted: Called with each call the protocol accepted and its size in bytes.
            flush: Called after a message that left something queued: do it.
        """
        if self._router is not None:
            tg.start_soon(self._receive_loop, self._router, None, accepted, flush)
        for address, sock in self._dealers.items():
            tg.start_soon(self._receive_loop, sock, address, accepted, flush)

    async def _receive_loop(
        self,
        sock: AsyncSocket,
        address: str | None,
        accepted: Callable[[Call, int], None],
        flush: Callable[[], None],
    ) -> None:
        """Feed every message of ``sock`` to the protocol: a ROUTER's (``address`` None)
        keyed by its routing id frame, a DEALER's by the client ``address``."""
        recv = sock.recv
        proto = self._proto
        receive = proto.receive
        monotonic = time.monotonic
        while True:
            try:
                frames = await recv()
            except ClosedError:
                return
            try:
                size = sum(map(len, frames))  # no loop variable left holding a frame
                if address is None:
                    route = frames[0].bytes
                    body = cast("list[Buffer]", frames[1:])
                    call = receive(route, body, monotonic(), size - len(route))
                    del body
                else:
                    call = receive(address, cast("list[Buffer]", frames), monotonic(), size)
                if call is not None:
                    accepted(call, size)
                    del call
                if proto.pending:
                    flush()
            except Exception:  # one bad message must never stop the loop
                proto.unhandled(address)
                logger.exception("error handling a message from %s", address or "a peer")
            # Not held until the next message arrives: a large one is freed off the loop.
            later_if_large(frames, size)
            del frames

    # -- sending ----------------------------------------------------------------------------

    def _socket_for(self, key: Hashable) -> tuple[AsyncSocket | None, list[Buffer]]:
        if self._router is not None:
            return self._router, [cast("bytes", key)]
        return self._dealers.get(cast("str", key)), []

    def send_now(self, key: object, frames: list[bytes]) -> bool:
        """Send a small message without waiting; False when it could not go (ZMQ full,
        no connection): the caller tells the protocol (``send_failed``)."""
        sock, prefix = self._socket_for(key)
        if sock is None:
            return False
        try:
            sock.send_nowait([*prefix, *frames])
        except (anyio.WouldBlock, PeerUnreachableError, ClosedError) as exc:
            logger.debug("dropped a message to %r: %r", key, exc)
            return False
        except TransportError as exc:
            logger.warning("cannot send to %r: %s", key, exc)
            return False
        return True

    async def send_reply(
        self, call: Call, frames: list[Buffer], keepalive: list[object] | None
    ) -> None:
        """Send a (possibly large, zero-copy) reply from a worker, waiting a bounded time.

        The wait (ZMQ full, or a DEALER whose client is not connected) ends after
        ``reply_patience``, or when the call is cancelled (CANCEL, its session ended);
        a reply that could not go is counted by the protocol (``send_failed``).
        """
        sock = self._router  # `_socket_for`, inline (the hot path)
        key: Any = call.key  # a routing id (ROUTER) or a client address (DEALERs)
        if sock is not None:
            parts: list[Buffer] = [key, *frames]
        else:
            sock = self._dealers.get(key)
            if sock is None:
                self._proto.send_failed(key, frames, time.monotonic())
                return
            parts = frames
        track = keepalive is not None
        try:
            try:
                tracker = sock.send_nowait(parts, track=track)
            except anyio.WouldBlock:
                tracker = await self._send_waiting(call, sock, parts, track)
        except (anyio.WouldBlock, PeerUnreachableError, ClosedError) as exc:
            self._proto.send_failed(key, frames, time.monotonic())
            logger.debug("dropped a reply to %s: %r", peer_text(call.session.name), exc)
            return
        except TransportError as exc:
            self._proto.send_failed(key, frames, time.monotonic())
            logger.warning("cannot send a reply to %s: %s", peer_text(call.session.name), exc)
            return
        if keepalive is not None:
            self._pending.add(tracker, keepalive, nbytes(frames))

    async def _send_waiting(
        self, call: Call, sock: AsyncSocket, parts: list[Buffer], track: bool
    ) -> zmq.MessageTracker | None:
        if call.cancelled:
            raise anyio.WouldBlock
        with anyio.move_on_after(self._patience) as scope:
            borrowed = call.scope is None  # unary: no scope of its own any more
            if borrowed:
                call.scope = scope
            try:
                return await sock.send(parts, track=track)
            finally:
                if borrowed:
                    call.scope = None
        raise anyio.WouldBlock
