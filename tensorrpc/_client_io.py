"""The client's one shell: one ROUTER socket, a reader, a timer task, one flush, wake-ups.

`ClientIO` owns the client's `tensorrpc._client_protocol.ClientProtocol`, its socket
and its tensor transport policy. It feeds every message to the protocol, sends the
frames it hands out (without waiting), runs its timers (heartbeats, dead engines, hello
requests, rejoins), acts on the events it reports (engines joined and lost, dropped
replies and the leases they carry, refusals, reachability questions) and wakes the
callers whose calls it resolved or who wait for capacity. The calls run in their
callers' tasks as functions of this shell (`tensorrpc._client_calls`).

One clock: the event loop's (`tensorrpc._zmq.loop_clock`, ``now``), for the protocol,
the heartbeat nonces and the callers' deadlines alike.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import zmq

from tensorrpc import _codec
from tensorrpc._bulk import Voucher
from tensorrpc._bulk_io import BulkLinks
from tensorrpc._calls import Call, CallState
from tensorrpc._client_events import (
    CheckReachable,
    ClientConfig,
    Dropped,
    EngineJoined,
    EngineLost,
    EngineRefused,
    FactsNeeded,
    Ignored,
    LeasesFreed,
    Pong,
)
from tensorrpc._client_leases import take_item_leases, take_lease
from tensorrpc._client_protocol import ClientProtocol
from tensorrpc._engines import MAX_REJECTED_KEY
from tensorrpc._exceptions import ClosedError, PeerUnreachableError, TensorRPCError
from tensorrpc._logonce import Said
from tensorrpc._release import later_if_large, nbytes
from tensorrpc._streams import CreditGranted
from tensorrpc._text import peer_text
from tensorrpc._zmq import (
    AsyncSocket,
    PendingSends,
    SocketOptions,
    Waiters,
    connection_voucher,
    create_socket,
    loop_clock,
    peer_credentials,
)
from tensorrpc.transports._shm_memory import LeaseCollector

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence

    from typing_extensions import Buffer

    from tensorrpc._engines import Engine
    from tensorrpc._observe import Observer
    from tensorrpc._security import CurveConfig
    from tensorrpc._service import ServiceSpec
    from tensorrpc.transports._policy import TransportPolicy
    from tensorrpc.transports.torch_shm import ShmResolver

__all__ = ["ClientIO", "RefusalLog"]

logger = logging.getLogger("tensorrpc.client")

_REPLIED = CallState.REPLIED


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id (the peer's z85 CURVE public key) of a received frame."""
    try:
        return str(frame.get("User-Id"))
    except (zmq.ZMQError, TypeError, ValueError):  # no CURVE on this connection
        return None


class RefusalLog:
    """Logs handshake refusals at WARNING, bounded: strangers cannot flood the log.

    At most `BURST` refusals are logged one by one per `WINDOW_S` seconds, each with
    the engine id and text cut short; the rest are counted and summed up in one line.
    """

    BURST: Final = 16
    WINDOW_S: Final = 10.0
    TEXT: Final = 512
    __slots__ = ("logged", "said", "skipped", "window_end")

    def __init__(self) -> None:
        self.window_end = 0.0
        self.logged = 0
        self.skipped = 0
        #: Refusals already logged: an engine refused again for the same reason (its
        #: HELLO is retried every second) is logged once, the repeats at DEBUG.
        self.said = Said()

    def log(self, event: EngineRefused, now: float) -> None:
        """Log one refusal (or count it when this window's burst is spent)."""
        if not self.said.first((event.engine_id, event.by_client, event.reason, event.message)):
            logger.debug(
                "engine '%s' refused again (%s)",
                peer_text(event.engine_id, 64),
                peer_text(event.reason),
            )
            return
        if now >= self.window_end:
            if self.skipped:
                logger.warning(
                    "%d more handshake refusals in %g s were not logged one by one "
                    "(see Client.rejected)",
                    self.skipped,
                    self.WINDOW_S,
                )
            self.window_end = now + self.WINDOW_S
            self.logged = self.skipped = 0
        if self.logged >= self.BURST:
            self.skipped += 1
            return
        self.logged += 1
        engine_id = peer_text(event.engine_id, MAX_REJECTED_KEY)
        message = peer_text(event.message, self.TEXT)
        if event.by_client:
            logger.warning("refused engine '%s': %s", engine_id, message)
        else:
            reason = peer_text(event.reason)
            logger.warning("engine %s refused this client: %s %s", engine_id, reason, message)


class ClientIO:
    """The client's one shell around its `ClientProtocol` (made here from ``config``):
    socket, reader, timers, flush, wake-ups, and the state its calls run on."""

    __slots__ = (
        "_bind",
        "_connect",
        "_curve",
        "_refusals",
        "_scopes",
        "_socket_options",
        "addresses",
        "bulk",
        "codec",
        "engines_changed",
        "hello_voucher",
        "holds",
        "maxmsgsize",
        "now",
        "observer",
        "orphans",
        "policy",
        "protocol",
        "retries",
        "schemaless",
        "sock",
        "spec",
        "tg",
        "tick",
        "tracked",
        "waiters",
    )

    def __init__(
        self,
        config: ClientConfig,
        policy: TransportPolicy,
        spec: ServiceSpec,
        codec: _codec.CodecConfig,
        *,
        bind: list[str],
        connect: list[str],
        socket_options: SocketOptions,
        curve: CurveConfig | None,
        observer: Observer | None,
    ) -> None:
        self.protocol = ClientProtocol(config)
        self.policy = policy
        self.holds = policy.memory.holds
        self.spec = spec
        self.schemaless = config.schemaless
        self.codec = codec
        #: The largest frame we send or accept (our socket's; <= 0: none).
        self.maxmsgsize = socket_options.maxmsgsize
        #: Calls retried after an engine's OVERLOADED refusal.
        self.retries = 0
        #: The one clock (the event loop's once open).
        self.now: Callable[[], float] = time.monotonic
        self.observer = observer
        self._bind = bind
        self._connect = connect
        self._socket_options = socket_options
        self._curve = curve
        self._refusals = RefusalLog()
        self._scopes: list[anyio.CancelScope] = []
        #: Addresses actually bound (ephemeral ports resolved).
        self.addresses: list[str] = []
        #: Calls of streams garbage-collected unclosed: cancelled by the next reader pass.
        self.orphans: collections.deque[Call] = collections.deque()
        self.tracked = PendingSends()
        #: The bulk connections (docs/design.md, "a bulk connection per peer").
        self.bulk = BulkLinks(
            options=socket_options,
            curve=curve,
            deliver=functools.partial(_bulk_message, self),
            on_lost=functools.partial(_bulk_lost, self),
            on_bound=functools.partial(_bulk_bound, self),
        )
        # What vouches for the connection of the HELLO being handled (the bulk binding).
        self.hello_voucher: tuple[bytes, Voucher] | None = None
        self.sock: AsyncSocket | None = None
        self.waiters: Waiters | None = None
        self.engines_changed: anyio.Event | None = None
        self.tick: anyio.Event | None = None
        #: The client's task group (request streams' senders run in it).
        self.tg: anyio.abc.TaskGroup | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def open(self) -> None:
        """Open the socket (in the client's event loop)."""
        self.waiters = Waiters()
        self.now = loop_clock()
        self.engines_changed = anyio.Event()
        self.tick = anyio.Event()
        self._open_socket()

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the reader and timer tasks in ``tg``."""
        self.tg = tg
        self.bulk.start(tg)  # its readers end when close() closes its sockets
        tg.start_soon(self._background, self._reader, name="tensorrpc client reader")
        tg.start_soon(self._background, self._housekeeping, name="tensorrpc client housekeeping")

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Run ``fn(*args)`` as a task of the client (a request stream's sender)."""
        if self.tg is None:
            raise ClosedError("the client is closed")
        self.tg.start_soon(fn, *args)

    async def _background(self, fn: Callable[[], Awaitable[None]]) -> None:
        # Each background task runs in its own scope so that close() can stop them from
        # any task without cancelling the body of the user's `async with`.
        if self.protocol.closed:
            return  # closed before this task first ran
        with anyio.CancelScope() as scope:
            self._scopes.append(scope)
            try:
                await fn()
            except ClosedError:
                if not self.protocol.closed:
                    raise

    def close(self) -> None:
        """BYE to every engine, fail the calls in flight, wake everyone, stop the tasks."""
        protocol = self.protocol
        protocol.close(self.now())
        self.flush()
        if self.waiters is not None:
            for token in protocol.capacity.everyone():
                self.waiters.wake(token)
        self.notify_engines()
        for scope in self._scopes:
            scope.cancel()
        self._close_socket()
        self.bulk.close()
        self.policy.close()

    def check_open(self) -> None:
        """Raise ClosedError unless the client is open."""
        if self.protocol.closed:
            raise ClosedError("the client is closed")
        if self.sock is None:
            raise ClosedError("the client is not open: use `async with Client(...)`")

    def _open_socket(self) -> None:
        sock = create_socket(zmq.ROUTER, options=self._socket_options, curve=self._curve)
        self.sock = sock
        aliases: list[tuple[bytes, str]] = []
        try:
            for address in self._bind:
                self.addresses.append(sock.bind(address))
            if self.bulk.listen(*self.addresses):
                self.protocol.announce_bulk(self.bulk.address)
            token = secrets.token_hex(4)
            for i, address in enumerate(self._connect):
                alias = f"@{token}/{i}".encode()
                sock.connect(address, peer_id=alias)
                aliases.append((alias, address))
        except BaseException:
            self._close_socket()
            self.bulk.close()
            raise
        now = self.now()
        for alias, address in aliases:
            self.protocol.dial(alias, address, now)
        self.flush()

    def _close_socket(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        self.tracked.clear()

    # -- output and events ----------------------------------------------------------------

    def flush(self) -> None:
        """Act on the protocol's events and send its frames (no waiting) until it is done."""
        protocol = self.protocol
        while True:  # (callers on the hot path check `pending` first)
            for event in protocol.next_events():
                if type(event) is Call:  # a reply (the hot path), or the client's end
                    if event.state >= _REPLIED:
                        self.ended(event)
                    else:  # a stream item: the engine has attached to the arguments
                        if event.lease is not None:
                            self.policy.memory.release_one(take_lease(event))
                        assert self.waiters is not None
                        self.waiters.wake(event.waiter)
                elif type(event) is CreditGranted:  # a request stream's sender may go on
                    waiter = event.call.request.waiter  # type: ignore[union-attr]
                    if waiter is not None and self.waiters is not None:
                        self.waiters.wake(waiter)
                else:
                    self.event(event)
            sends = protocol.frames_to_send()
            if (sends and not _send_all(self, sends)) or not protocol.pending:
                return

    def take_sent(self) -> list[Any]:
        """The message the protocol queued last, ``[peer, *frames]``, for the caller to
        send itself (zero-copy, perhaps waiting); what was queued before it goes now."""
        sends = self.protocol.frames_to_send()
        peer, frames = sends.pop()
        if sends:
            _send_all(self, sends)
        if self.protocol.pending:
            self.flush()
        return [peer, *frames]

    def release_held(self, engine: Engine, resolver: ShmResolver | None = None) -> None:
        """RELEASE the engine's result leases we are done with (``resolver``: just decoded)."""
        leases = self.policy.memory.releasable(engine.peer, resolver)
        self.protocol.leases.release(engine, leases, self.now())
        self.flush()

    def release_later(self, engine: Engine, resolver: ShmResolver) -> None:
        """A reply was decoded: its finished leases ride in the next CALL to the engine if
        the caller makes one before it yields, else in a RELEASE (`_release_pending`)."""
        leases = self.policy.memory.releasable(engine.peer, resolver)
        if self.protocol.leases.give_back(engine, leases) and self.waiters is not None:
            self.waiters.soon(self._release_pending)

    def _release_pending(self) -> None:
        """The caller yielded: RELEASE the decoded leases no CALL took (a loop callback)."""
        try:
            self.protocol.leases.release_pending(self.now())
            if self.sock is not None:  # (closed: the engines drop our leases themselves)
                self.flush()
        except Exception:  # pragma: no cover - flush logs send errors itself
            logger.exception("could not return torch_shm leases")

    def release_all_held(self) -> None:
        """RELEASE, to every engine, the leases of result tensors freed since (a tick)."""
        policy = self.policy
        engines = self.protocol.engines
        for peer in policy.memory.releasable_peers():
            engine = engines.by_peer(peer) if isinstance(peer, bytes) else None
            if engine is not None:
                self.release_held(engine)
            else:  # gone: nothing to tell it
                policy.memory.releasable(peer)

    def event(self, event: object) -> None:
        """Act on what the protocol reported (other than a call or credit)."""
        if isinstance(event, FactsNeeded):
            _with_facts(self, event)
        elif isinstance(event, EngineLost):
            self._on_lost(event)
        elif isinstance(event, Pong):
            if self.observer is not None:  # observe: heartbeat round trip
                rtt = self.now() - event.nonce / 1e9  # the nonce is its send time
                client_id = self.protocol.config.client_id
                self.observer.heartbeat(client_id, event.engine.engine_id, rtt)
        elif isinstance(event, EngineJoined):
            self._on_joined(event)
        elif isinstance(event, CheckReachable):
            # Its PING waits in frames_to_send: a send that finds no connection ends the
            # live engine's session (send_failed), so it is reachable if still alive.
            sends = self.protocol.frames_to_send()
            sent = _send_all(self, sends) if sends else self.sock is not None
            self.protocol.reachable(event, sent and event.current.alive, self.now())
        elif isinstance(event, Dropped):
            self._on_dropped(event)
        elif isinstance(event, LeasesFreed):
            _on_freed(self, event)
        elif isinstance(event, EngineRefused):
            self._refusals.log(event, self.now())
            self.notify_engines()
        elif isinstance(event, Ignored):
            logger.warning("dropped a message from %r: %s", event.peer, peer_text(event.why, 512))

    def _on_dropped(self, event: Dropped) -> None:
        """A RESULT or stream item nobody decodes: its torch_shm leases go back now."""
        engine = event.engine
        leases = self.leases(engine, event.payload, event.buffers)
        self.protocol.leases.release(engine, leases, self.now())
        if event.call is not None:
            self.ended(event.call)

    def _on_lost(self, event: EngineLost) -> None:
        engine = event.engine
        self.bulk.forget(engine.peer)
        logger.info("engine %r %s", engine.engine_id, peer_text(event.why, 512))
        self.policy.memory.peer_gone(engine.peer, self.policy.peers.drop(engine.peer))
        for call in event.calls:
            self.ended(call)
        self._observe_engine(engine.engine_id, "lost")
        self.wake_all(self.protocol.stranded(engine.engine_id, self.now()))
        self.notify_engines()
        if self.tick is not None:
            self.tick.set()  # a hello request to its address may be due at once

    def _on_joined(self, event: EngineJoined) -> None:
        engine = event.engine
        self.policy.peers.link(engine.peer, event.shm)
        self._bulk_joined(engine)
        engine_id = event.engine.engine_id
        table = self.protocol.engines
        self._observe_engine(engine_id, "rejoined" if engine_id in table.past else "joined")
        self.wake_all(self.protocol.capacity.joined(engine_id, table.max_in_flight))
        self.notify_engines()
        if self.tick is not None:
            self.tick.set()  # its heartbeat may be due sooner than our next tick

    def _bulk_joined(self, engine: Engine) -> None:
        """A session began: offer it our bulk endpoint (listening), or dial the engine's."""
        bulk = self.bulk
        bulk.forget(engine.peer)
        if engine.bulk_token:
            seen = self.hello_voucher
            voucher = seen[1] if seen is not None and seen[0] == engine.peer else Voucher("none")
            bulk.offer(engine.peer, engine.client_epoch, voucher, engine.bulk_token)
        announced, token = engine.bulk_offer
        address = self.protocol.address_of(engine.peer)
        if announced and address is not None:
            bulk.dial(engine.peer, announced, address, engine.epoch, token)

    def _observe_engine(self, engine_id: str, event: str) -> None:
        if self.observer is not None:  # observe: an engine joined, rejoined or was lost
            self.observer.engine_event(self.protocol.config.client_id, engine_id, event)

    def notify_engines(self) -> None:
        """Wake `Client.wait_for_engines`: the live engines (or refusals) changed."""
        if self.engines_changed is not None:
            self.engines_changed.set()
            self.engines_changed = anyio.Event()

    def wake_all(self, tokens: Sequence[Any]) -> None:
        """Wake these capacity waiters."""
        waiters = self.waiters
        if waiters is not None:
            for token in tokens:
                waiters.wake(token)

    def ended(self, call: Call) -> None:
        """A call ended: free its argument lease and slot, wake its caller (and one waiter);
        a request stream's sender stops."""
        request = call.request
        if request is not None and request.scope is not None:
            request.scope.cancel()
        if call.lease is not None:
            # The engine replied (so it attached to the arguments), or never will.
            self.policy.memory.release_one(take_lease(call))
        if request is not None and request.leases:  # its request items' too
            for lease in take_item_leases(call):
                self.policy.memory.release_one(lease)
        waiters = self.waiters
        if waiters is None:
            return
        for token in self.protocol.capacity.released(call.engine.engine_id):
            waiters.wake(token)
        waiters.wake(call.waiter)

    def abandon(self, call: Call, *, error: bool = False) -> None:
        """The caller gave up: tell the engine (``error``: count it as the engine's error)."""
        now = self.now()
        protocol = self.protocol
        if call.items:
            _drop_unread(self, call, now)
        # The engine may still be reading the arguments on our regions: the protocol keeps
        # their lease until its RELEASE (or a late reply, or its end).
        if protocol.cancel(call, now, error=error):
            self.ended(call)
        self.flush()

    def reap_orphans(self) -> None:
        """Cancel the calls of streams that were garbage-collected unclosed."""
        orphans = self.orphans
        while orphans:
            self.abandon(orphans.popleft())

    # -- tensor transports -----------------------------------------------------------------

    def leases(self, engine: Engine, payload: Buffer, buffers: Sequence[Buffer]) -> list[int]:
        """The torch_shm leases a reply nobody will decode carries (to release)."""
        if engine.shm is None:
            return []  # the engine sends us no handles
        collector = LeaseCollector()
        with contextlib.suppress(TensorRPCError):
            _codec.decode(payload, buffers, self.codec, resolver=collector)
        return list(dict.fromkeys(collector.leases))

    # -- background tasks -----------------------------------------------------------------

    async def _reader(self) -> None:
        sock = self.sock
        assert sock is not None
        recv = sock.recv
        recv_nowait = sock.recv_nowait
        assert self.waiters is not None
        checkpoint = self.waiters.checkpoint
        on_message = self._on_message
        yield_due = sock.yield_due  # a busy (or flooded) socket must not starve the callers
        # A message taken off the socket is handled before any yield: the housekeeping
        # tick also handles received messages (`drain_received`) and may run at any yield, so a
        # message held across one would be overtaken by the ones after it.
        while True:
            try:
                frames = recv_nowait()
            except anyio.WouldBlock:
                # Nothing queued: let the callers we just woke run (and decode) before we
                # re-arm the wait on the socket, which costs a little.
                await checkpoint()
                frames = await recv()  # yields (if it must) before it takes the message
            try:
                on_message(frames)
            except Exception:  # one bad message must never stop the reader
                logger.exception("tensorrpc client: error handling a message")
            if len(frames) > 3:  # out-of-band buffers: a large message is freed off the loop
                later_if_large(frames, nbytes(frames))
            del frames  # not held until the next message arrives
            if yield_due():  # after 32 messages or 2 ms of handling them
                await checkpoint()

    def drain_received(self, limit: int = 4096) -> None:
        """Handle the messages already received (the reader may not have run yet)."""
        sock = self.sock
        for _ in range(limit):
            if sock is None:
                return
            try:
                frames = sock.recv_nowait()
            except anyio.WouldBlock:
                return
            try:
                self._on_message(frames)
            except Exception:  # one bad message must never stop the client
                logger.exception("tensorrpc client: error handling a message")
            if len(frames) > 3:
                later_if_large(frames, nbytes(frames))
            del frames

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            logger.warning("dropped a message of %d frames", len(frames))
            return
        protocol = self.protocol
        peer, body = frames[0].bytes, cast("list[Buffer]", frames[1:])
        # Who the engine is comes from its CURVE key (with engine_keys).
        key = _user_id(frames[1]) if protocol.config.engine_keys is not None else None
        protocol.receive(peer, body, self.now(), key)
        if protocol.pending:  # `_handled`, inline (the hot path)
            self.flush()
        if self.orphans:
            self.reap_orphans()

    def handled(self) -> None:
        """After an input: do what the protocol handed out."""
        if self.protocol.pending:
            self.flush()
        if self.orphans:
            self.reap_orphans()

    async def _housekeeping(self) -> None:
        protocol = self.protocol
        interval = protocol.config.heartbeat.interval
        clock = self.now
        next_sweep = clock() + interval
        while True:
            with anyio.move_on_after(protocol.next_tick(clock())):
                assert self.tick is not None
                await self.tick.wait()
            self.tick = anyio.Event()
            if self.sock is not None:
                self.sock.handshake_failures()  # logs failed CURVE handshakes at WARNING
            self.drain_received()  # messages already here prove life: read them before judging
            now = clock()
            protocol.tick(now)
            self.wake_all(protocol.expire_rejoins(now))
            self.flush()
            self.reap_orphans()
            self.release_all_held()
            if now >= next_sweep:
                next_sweep = now + interval
                self.tracked.prune()
                self.policy.memory.sweep()


def _drop_unread(io: ClientIO, call: Call, now: float) -> None:
    """Stream items nobody will read: their leases go back, their frames die off the loop."""
    items = call.items
    assert items is not None
    left = list(items)
    items.clear()
    for payload, buffers in left:
        io.protocol.leases.release(call.engine, io.leases(call.engine, payload, buffers), now)
    del payload, buffers
    later_if_large(left, sum(nbytes(item[1]) for item in left))


def _send_all(io: ClientIO, sends: list[tuple[bytes, list[Any]]]) -> bool:
    """Send the protocol's messages without waiting; False: the socket is closed."""
    for peer, frames in sends:
        sock = io.sock
        if sock is None:
            return False
        try:
            sock.send_nowait([peer, *frames])
        except PeerUnreachableError:
            io.protocol.send_failed(peer, io.now())
            if io.tick is not None:
                io.tick.set()  # a hello request to retry soon
        except anyio.WouldBlock:
            logger.debug("dropped a message to %r: peer pipe full", peer)
        except TensorRPCError as exc:
            logger.debug("could not send to %r: %s", peer, exc)
    return True


def _on_freed(io: ClientIO, event: LeasesFreed) -> None:
    memory = io.policy.memory
    for lease in event.leases:
        memory.release_one(lease)
    if event.refused:
        memory.refuse_release(event.refused)
        logger.debug("engine %r: %d RELEASEd leases refused", event.engine.engine_id, event.refused)


def _with_facts(io: ClientIO, event: FactsNeeded) -> None:
    """A HELLO: torch_shm and the bulk binding are decided from what the kernel (or a
    key) says about its connection; the protocol takes it again with them."""
    peer, body = event.peer, event.frames
    if io.bulk.router is not None:
        io.hello_voucher = (peer, connection_voucher(body[1]))
    facts = io.policy.peers.facts(peer_credentials(body[1]))
    try:
        io.protocol.receive(peer, body, io.now(), event.key, facts)
        io.flush()
    finally:
        io.policy.peers.settle(peer, facts)
        io.hello_voucher = None


def _bulk_message(io: ClientIO, peer: object, frames: list[zmq.Frame], size: int) -> None:
    """A message on an engine's bound bulk connection (its large RESULTs, its BYE)."""
    protocol = io.protocol
    body = cast("list[Buffer]", frames)
    key = _user_id(frames[0]) if protocol.config.engine_keys is not None else None
    protocol.receive(cast("bytes", peer), body, io.now(), key, bulk=True)
    io.handled()


def _bulk_lost(io: ClientIO, peer: object, epoch: int, ours: bool) -> None:
    """An engine session's bound bulk connection broke: the session is over, once what
    control already received is handled (a RESULT or BYE the engine sent there before
    it closed both: the two connections' I/O threads report in no common order)."""
    io.drain_received()
    io.protocol.bulk_lost(cast("bytes", peer), epoch, io.now(), ours=ours)
    io.handled()


def _bulk_bound(io: ClientIO, peer: object, epoch: int, ours: bool) -> None:
    """An engine session's bulk connection is bound: its BYE comes on it too."""
    io.protocol.bulk_bound(cast("bytes", peer), epoch, ours=ours)
