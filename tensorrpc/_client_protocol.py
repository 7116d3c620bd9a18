"""The client's side of the protocol as a state machine, sans-I/O.

`ClientProtocol` takes frames, the shell's answers to its events and the current time
in; what happened comes out of `next_events` (the `tensorrpc._calls.Call` a reply
resolved, or an event) and what to send out of `frames_to_send`, the output convention
both machines share (`tensorrpc._machine.Machine`): no input returns either. It never
touches a socket, a clock or an event loop, and never calls back into the shell;
`tensorrpc.Client` is the I/O shell around it. The transition table (`TRANSITIONS`) is
also the one in docs/protocol.md §13; a test keeps the two equal.

Rules the machine keeps (with those of `tensorrpc._calls` and
`tensorrpc._engines`):

1. A session with an engine starts with an acceptable HELLO, answered by WELCOME, and
   ends exactly once: BYE, REJECT, silence past our ``dead_after``, a send that finds the
   peer gone, a new session at its peer (new epoch), or our own silence past the
   engine's bound. When a session ends, every call on it fails with EngineDeadError at
   once, in the same step.
2. A repeated HELLO of the current session (same epoch) changes nothing and is answered
   by the same WELCOME. A HELLO for an engine id whose session is alive on another peer
   is refused as ``duplicate_id`` while that peer is reachable: an impostor cannot
   displace a live engine or receive its calls.
3. Any well-formed message from a peer with a session counts as life. We ping each
   engine at our heartbeat interval, or three times per its announced bound if shorter,
   and answer every PING with a PONG echoing its nonce.
4. An engine address we dial (client-dials topology) gets hello requests (PING 0) until
   an engine there says HELLO: every heartbeat interval while the connection is up, and
   with a capped backoff while the send fails because the connection is not up yet.
5. Nothing is sent for a call after it ended, except its one CANCEL.
6. ``torch_shm`` leases (the lease table): a call's argument lease ends with its first
   reply (the engine attached) or its end; a call we gave up on keeps it (the engine may
   still read the arguments) until the engine's RELEASE naming it, a late reply to the
   call, or the engine's end. Result leases we are done with ride in the header of the
   next CALL to their engine (``RELEASES``, at most `MAX_CALL_RELEASES`, for an engine
   that reads them), else go in RELEASE messages of at most `MAX_RELEASE_LEASES` ids.
   A RELEASE naming anything else is refused and counted; an engine's end drops all.
   A request stream's item leases end with the call's end, kept the same way when we
   gave up on it (`tensorrpc._streams` rule 6).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from tensorrpc import _client_sessions as _sessions, _streams
from tensorrpc._bulk import TOKEN_BYTES
from tensorrpc._calls import Call, CallState, CallTable
from tensorrpc._client_events import (
    ClientConfig,
    Dropped,
    Event,
    FactsNeeded,
    Ignored,
    Peer,
    PeerState,
)
from tensorrpc._client_leases import LeaseTable
from tensorrpc._client_sessions import HEARTBEAT_NONCE, HELLO_REQUEST
from tensorrpc._engines import (
    BYE_BULK,
    BYE_CONTROL,
    CapacityWaiters,
    Engine,
    EngineTable,
    Rejoins,
)
from tensorrpc._exceptions import ClosedError, EngineNotFoundError, RemoteProtocolError
from tensorrpc._machine import MAX_RELEASE_LEASES, Machine, Transition, release_frames
from tensorrpc._protocol import (
    Bye,
    Credit,
    ErrorInfo,
    Header,
    MessageKind,
    Release,
    decode_control,
    encode_control,
    pack_call_header,
    split_frames,
)
from tensorrpc._statistics import ClientCounters
from tensorrpc.transports._shm_handle import TRANSPORT_NAME

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import Buffer

    from tensorrpc._exceptions import TensorRPCError
    from tensorrpc._service import MethodSpec
    from tensorrpc.transports._peer import PeerFacts

__all__ = [
    "HEARTBEAT_NONCE",
    "HELLO_REQUEST",
    "MAX_RELEASE_LEASES",
    "TRANSITIONS",
    "ClientProtocol",
    "reply_error",
]

_RESULT: Final = MessageKind.RESULT
_ERROR: Final = MessageKind.ERROR
_STREAM_ITEM: Final = MessageKind.STREAM_ITEM
_STREAM_END: Final = MessageKind.STREAM_END
_PING: Final = MessageKind.PING
_HELLO: Final = MessageKind.HELLO
_BYE: Final = MessageKind.BYE
_FAILED: Final = CallState.FAILED
_CANCELLED: Final = CallState.CANCELLED
_ERROR_HEADER: Final = Header(MessageKind.ERROR, 1)

#: Shortest pause of the housekeeping timer.
_MIN_TICK_S: Final = 0.0005


def _random_epoch() -> int:
    return secrets.randbits(64) or 1


def _random_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


class ClientProtocol(Machine[bytes, Event]):
    """The client's protocol state: engines, calls, liveness, frames to send.

    Args:
        config: Handshake values and bounds.
        epochs: Draws our session epochs (default: random non-zero u64).
        tokens: Draws a session's bulk token (default: 128 random bits).
    """

    def __init__(
        self,
        config: ClientConfig,
        *,
        epochs: Callable[[], int] = _random_epoch,
        tokens: Callable[[], bytes] = _random_token,
    ) -> None:
        if config.stream_window < 1:
            raise ValueError("stream_window must be at least 1")
        super().__init__()
        self.config = config
        self._epochs = epochs
        self._tokens = tokens
        # torch_shm and the bulk binding are decided from what the kernel says of a HELLO.
        self._facts_needed = TRANSPORT_NAME in config.shm_transports
        self.engines = EngineTable(balancing=config.balancing, max_in_flight=config.max_in_flight)
        self.calls = CallTable()
        self.capacity = CapacityWaiters()
        #: Every routing id dialled or in session, with its state (absent: none).
        self._peers: dict[bytes, Peer] = {}
        self._dial_count = 0
        #: Engines that forgot this client's session (the client stalled) and are greeted
        #: again at once: the calls not yet sent to them wait for that instead of failing.
        self.rejoining = Rejoins(config.heartbeat.dead_after)
        self.closed = False
        #: The lease table (rule 6).
        self.leases = LeaseTable(self._release_now)
        #: Calls, engine events and heartbeats per engine id (the only client counters).
        self.counters = ClientCounters()

    # -- output ---------------------------------------------------------------------------

    def _queue(
        self,
        engine: Engine | None,
        peer: bytes,
        kind: MessageKind,
        body: Any,
        call_id: int,
        now: float,
    ) -> None:
        frames = encode_control(kind, body, call_id)
        self._sends.append((peer, frames))
        if engine is not None:
            engine.sent = now
            engine.bytes_sent += len(frames[0]) + len(frames[1])

    def _release_now(self, engine: Engine, leases: Sequence[int], now: float) -> None:
        for frames in release_frames(leases):
            self._sends.append((engine.peer, frames))
            engine.sent = now
            engine.bytes_sent += len(frames[0]) + len(frames[1])

    # -- dialling (`tensorrpc._client_sessions`) -----------------------------------------

    dial = _sessions.dial
    undial = _sessions.undial
    _hello_request = _sessions.hello_request

    @property
    def dial_count(self) -> int:
        """Addresses dialled so far (also those no longer dialled)."""
        return self._dial_count

    def announce_bulk(self, address: str) -> None:
        """Our WELCOMEs of new sessions announce this bulk endpoint, each with a token
        of its own (docs/design.md, "a bulk connection per peer")."""
        self.config = replace(self.config, bulk_address=address)
        self._facts_needed = self._facts_needed or bool(address)

    def address_of(self, peer: bytes) -> str | None:
        """The address dialled under this routing id, if any."""
        rec = self._peers.get(peer)
        return None if rec is None or rec.dial is None else rec.dial.address

    def engine_at(self, peer: bytes) -> Engine | None:
        """The engine in session at this routing id, if any."""
        rec = self._peers.get(peer)
        return None if rec is None else rec.engine

    #: The shell's answer to `CheckReachable` (`tensorrpc._client_sessions.reachable`).
    reachable = _sessions.reachable

    # -- calls ----------------------------------------------------------------------------

    def select(
        self,
        engine_id: str | None,
        now: float | None = None,
        *,
        woken: bool = False,
        wait_for_ready: bool = False,
    ) -> Engine | None:
        """The engine for a call to ``engine_id`` (None: balanced), as `EngineTable.select`
        says; None: the caller waits, for capacity (``woken``: it was woken from that
        queue and does not requeue), for an engine expected back, or (``wait_for_ready``)
        for any engine to join, instead of `EngineNotFoundError`. An engine we left
        silent past its bound (our loop stalled) forgot the session: it is ended here
        (`EngineLost` in `next_events`) and expected back (`rejoining`)."""
        if not woken and self.capacity.queued(engine_id):
            return None  # earlier callers wait for this capacity: queue behind them
        engines = self.engines
        while True:
            try:
                engine = engines.select(engine_id)
            except EngineNotFoundError:
                if wait_for_ready or self.rejoining.expected(engine_id, now):
                    return None
                raise
            if engine is None or now is None or now - engine.sent <= engine.dead_after:
                return engine  # (else we sent it nothing for longer than its bound: forgotten)
            self._events.append(self._forgotten(engine, now))

    def absence(self, engine_id: str | None, now: float) -> str | None:
        """Why no engine can take a call for ``engine_id`` now (None: one is live).

        What `EngineTable.absence` says, or that the engine forgot this client's session
        (our loop stalled) and has not rejoined yet.
        """
        why = self.engines.absence(engine_id)
        if why is not None and self.rejoining.expected(engine_id, now):
            return (
                "the engine forgot this client's session (our loop stalled) and has not "
                "rejoined yet"
            )
        return why

    def stranded(self, engine_id: str, now: float) -> list[Any]:
        """The capacity waiters to wake because ``engine_id`` left (they then re-select).

        Its targeted waiters, and every waiter when no engine is left, unless it (or
        another engine) is expected to rejoin.
        """
        rejoining = self.rejoining
        if rejoining.expected(engine_id, now):
            return []
        none_left = not self.engines.engines and not rejoining.expected(None, now)
        return self.capacity.lost(engine_id, none_left=none_left)

    def expire_rejoins(self, now: float) -> list[Any]:
        """Give up waiting for engines that did not rejoin in time: the waiters to wake.

        The shell calls this from its timer task, so a wait starts only once the loop
        runs timers again (and can send hello requests and read HELLOs).
        """
        woken: list[Any] = []
        for engine_id in self.rejoining.expire(now):
            if engine_id not in self.engines.engines:
                woken += self.stranded(engine_id, now)
        return woken

    def start_call(
        self,
        engine: Engine,
        spec: MethodSpec,
        waiter: Any,
        *,
        stream: bool,
        now: float,
        payload: Buffer = b"",
        buffers: Sequence[Buffer] = (),
        flags: int = 0,
        timeout_ms: int = 0,
        trace: bytes = b"",
        lease: int | None = None,
        placed: tuple[int, int] = (0, 0),
        returns: Sequence[int] = (),
        metadata: bytes = b"",
    ) -> Call:
        """Enter a call to ``engine`` (`select`) in the table and queue its CALL: the last
        message in `frames_to_send` (a RELEASE may go before it); the shell tells
        `call_unsent` if it cannot send it. ``waiter`` is the shell's (carried, never
        read); ``lease`` and ``placed``: the arguments' torch_shm lease and what went by
        handle; ``returns``: more result leases of ``engine`` we are done with."""
        if self.closed:
            raise ClosedError("the client is closed")
        engine.sent = now
        call = self.calls.open(
            engine, spec, waiter, stream=stream, window=self.config.stream_window
        )
        call.lease = lease
        call.placed = placed
        call.counted = (self.counters.started(engine.engine_id, spec.name), now)
        releases: tuple[int, ...] = ()
        if engine.releases or returns:  # result leases we are done with: header, or RELEASE
            releases = call.releases = self.leases.for_call(engine, returns, now)
        header = pack_call_header(
            call.call_id, spec.name, flags, timeout_ms, trace=trace, releases=releases,
            metadata=metadata,
        )  # fmt: skip
        # Inline, not `_send_data`: the hot path saves the call.
        size = len(header) + memoryview(payload).nbytes
        for buffer in buffers:
            size += memoryview(buffer).nbytes
        engine.bytes_sent += size
        self._sends.append((engine.peer, [header, payload, *buffers]))
        return call

    def _send_data(
        self, engine: Engine, header: bytes, payload: Buffer, buffers: Sequence[Buffer]
    ) -> None:
        """Queue a request STREAM_ITEM (the shell sends it itself), counted."""
        size = len(header) + memoryview(payload).nbytes
        for buffer in buffers:
            size += memoryview(buffer).nbytes
        engine.bytes_sent += size
        self._sends.append((engine.peer, [header, payload, *buffers]))

    def call_ended(self, call: Call, outcome: str, now: float) -> bool:
        """The caller is done with ``call`` (result, error, or the stream's end or close),
        with this outcome label (`tensorrpc._observe.outcome_of`): count it, once.

        Returns:
            False when its end was counted already.
        """
        counted, call.counted = call.counted, None
        if counted is None:
            return False
        self.counters.ended(counted[0], outcome, now - counted[1])
        return True

    def call_unsent(self, call: Call, now: float) -> None:
        """The CALL of ``call`` could not be sent: the result leases its header carried
        go in a RELEASE instead."""
        releases, call.releases = call.releases, ()
        if releases:
            self._release_now(call.engine, releases, now)

    def cancel(self, call: Call, now: float, *, error: bool = False) -> bool:
        """The caller gave up on ``call``: end it and tell the engine (CANCEL).

        The engine may still be reading the arguments on our regions: their lease stays
        held (rule 6) until its RELEASE, a late reply, or its end.

        Args:
            error: Count it as one of the engine's errors (a timeout, a failed send).

        Returns:
            True when the call ended here (False: it had already ended).
        """
        if not self.calls.end(call, _CANCELLED):
            return False
        engine = call.engine
        if error:
            engine.errors += 1
        if engine.alive and not self.closed:
            self._queue(engine, engine.peer, MessageKind.CANCEL, None, call.call_id, now)
            self.leases.hold(call)
        return True

    def undecodable(self, call: Call) -> None:
        """The reply of unary ``call`` could not be decoded: one more engine error."""
        if call.items is None:
            call.engine.errors += 1

    def retrying(self, call: Call) -> None:
        """The caller retries ``call`` after its ERROR (OVERLOADED, or torch_shm arguments
        the engine could not attach to): that reply counts as no error of the engine."""
        call.engine.errors -= 1

    def shm_failed(self, engine: Engine, *, sending: bool) -> bool:
        """The engine could not attach to our handles (``sending``) or we to its: use
        frames that way from now on. Returns whether torch_shm was in use that way."""
        shm = engine.shm
        if shm is None:
            return False
        if sending:
            used, shm.to_engine = shm.to_engine, False
        else:
            used, shm.from_engine = shm.from_engine, False
        return used

    def take_item(self, call: Call, now: float) -> tuple[Buffer, Sequence[Buffer]]:
        """The consumer takes the next stream item; credit goes back to the engine."""
        items = call.items
        assert items  # the shell waits until there is one
        item = items.popleft()
        if call.counted is not None:
            call.counted[0].items += 1
        credit = call.credit
        assert credit is not None
        if not call.ended:
            grant = credit.consumed()
            if grant:
                engine = call.engine
                self._queue(
                    engine, engine.peer, MessageKind.CREDIT, Credit(grant), call.call_id, now
                )
        return item

    # -- receiving ------------------------------------------------------------------------

    def receive(
        self,
        peer: bytes,
        frames: Sequence[Buffer],
        now: float,
        key: str | None = None,
        facts: PeerFacts | None = None,
        *,
        bulk: bool = False,
    ) -> None:
        """Handle one message from ``peer`` (its frames after the routing id).

        Args:
            peer: The routing id it came from.
            frames: Its frames after the routing id.
            now: The clock.
            key: The z85 CURVE public key it came with (with ``engine_keys``: the shell
                reads it from the message; None: none).
            facts: For a HELLO: what the kernel says about the connection it came on
                (the shell gathers them when told so by `FactsNeeded`: the hot path
                never pays for them).
            bulk: It came on the session's bound bulk connection, not on control (only
                a RESULT or a BYE may: docs/design.md, "a bulk connection per peer").

        What happened goes to `next_events` (the `Call` a reply concerns, first among
        the events of a reply), what to send to `frames_to_send`.
        """
        events = self._events
        try:
            header, payload, buffers = split_frames(frames)
        except RemoteProtocolError as exc:
            events.append(_sessions.malformed(self, peer, frames, exc, now))
            return
        kind = header.kind
        rec = self._peers.get(peer)
        state = PeerState.NONE if rec is None else rec.state
        if kind is _HELLO and facts is None and self._facts_needed:
            events.append(FactsNeeded(peer, frames, key))  # the shell gathers them for HELLOs
            return
        if state is PeerState.LIVE:
            engine = rec.engine  # type: ignore[union-attr]
            assert engine is not None
            if now - engine.sent > engine.dead_after:  # it forgot the session
                events.append(self._forgotten(engine, now))
                rec = self._peers.get(peer)
            else:
                engine.heard = now
                size = 0
                for frame in frames:
                    size += len(frame)  # type: ignore[arg-type]
                engine.bytes_received += size
                if bulk and kind is not _RESULT:  # only a RESULT or a BYE may come there
                    event = _sessions.on_bulk(self, engine, kind)
                elif (
                    kind is _RESULT or kind is _STREAM_ITEM or kind is _ERROR or kind is _STREAM_END
                ):
                    event = self._reply(engine, kind, header, payload, buffers, now)
                else:
                    event = self._dispatch(peer, rec, header, payload, now, key, facts)
                if event is not None:
                    events.append(event)
                return
        if not bulk:  # (on the bulk connection: the session it was bound to is over)
            event = self._dispatch(peer, rec, header, payload, now, key, facts)
            if event is not None:
                events.append(event)

    def _dispatch(
        self,
        peer: bytes,
        rec: Peer | None,
        header: Header,
        payload: Buffer,
        now: float,
        key: str | None,
        facts: PeerFacts | None,
    ) -> Event | None:
        """`TRANSITIONS` by (peer state, kind), past the hot path."""
        kind = header.kind
        state = PeerState.NONE if rec is None else rec.state
        handler = _DISPATCH.get((state, kind))
        if handler is None:
            if kind in _SILENT_DROPS:  # a reply of a session that ended; a stray PING
                return None
            return Ignored(peer, f"unexpected {kind.name} from a peer in state {state.value}")
        engine = None if rec is None else rec.engine
        return handler(self, peer, engine, header, payload, now, key, facts)

    def _reply(
        self,
        engine: Engine,
        kind: MessageKind,
        header: Header,
        payload: Buffer,
        buffers: Sequence[Buffer],
        now: float,
    ) -> Call | Event | None:
        call = self.calls.reply(engine, kind, header.call_id, payload, buffers)
        if header.flags and call is not None and header.metadata:
            call.reply_metadata = header.metadata  # response metadata (RESULT, STREAM_END)
        if call is None:
            if kind is _ERROR and header.call_id == 0:
                return Ignored(
                    engine.peer, f"engine {engine.engine_id!r} reported: {reply_error(payload)}"
                )
            # A late reply (to a call we gave up on, perhaps): the engine is done with its
            # arguments; a RESULT's or item's own leases go back (the shell reads them).
            freed = self.leases.late_reply(engine, header.call_id)
            if kind is _RESULT or kind is _STREAM_ITEM:
                if freed is not None:
                    self._events.append(freed)
                return Dropped(engine, payload, buffers, call_id=header.call_id)
            return freed
        if call.state is _FAILED:  # the reply broke the rules: stop the engine's side
            self._queue(engine, engine.peer, MessageKind.CANCEL, None, call.call_id, now)
            if kind is _RESULT or kind is _STREAM_ITEM:
                return Dropped(engine, payload, buffers, call)
        return call

    # -- the handlers `TRANSITIONS` dispatches to: (peer, engine or None, header, payload,
    #    now, CURVE key) ---------------------------------------------------------------

    def _on_release(
        self, peer: bytes, engine: Engine | None, header: Header, payload: Buffer, *rest: Any
    ) -> Event | None:
        """The engine's RELEASE of leases kept for calls we gave up on."""
        assert engine is not None
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            return Ignored(peer, f"malformed RELEASE: {exc}")
        assert isinstance(body, Release)
        return self.leases.released(engine, body.leases)

    # -- endings (`tensorrpc._client_sessions`) -----------------------------------------

    _lose = _sessions.lose
    _forgotten = _sessions.forgotten
    declare_dead = _sessions.declare_dead
    send_failed = _sessions.send_failed
    bulk_bound = _sessions.bulk_bound
    bulk_lost = _sessions.bulk_lost

    def tick(self, now: float) -> None:
        """Timers: end silent or forgotten sessions (`EngineLost` in `next_events`),
        send heartbeats and hello requests."""
        lost = self._events
        for engine in self.engines.forgot_us(now):
            lost.append(self._forgotten(engine, now))
        dead_after = self.config.heartbeat.dead_after
        for engine in self.engines.expired(now, dead_after):
            why = f"sent nothing for {now - engine.heard:.1f} s (dead_after)"
            said = engine.byes & (BYE_CONTROL | BYE_BULK)
            lost.append(self._lose(engine, f"said BYE and then {why}" if said else why))
        for engine in list(self.engines.engines.values()):
            if now >= engine.next_ping and not engine.byes:
                nonce = max(HEARTBEAT_NONCE + 1, int(now * 1e9))
                self._queue(engine, engine.peer, _PING, None, nonce, now)
                engine.next_ping = now + engine.ping_every
        for alias, rec in self._peers.items():
            dial = rec.dial
            if rec.state is PeerState.DIALING and dial is not None and now >= dial.due:
                self._hello_request(alias, dial, now)

    def next_tick(self, now: float) -> float:
        """Seconds until `tick` has something to do (at most the heartbeat interval)."""
        heartbeat = self.config.heartbeat
        due = now + heartbeat.interval
        for engine in self.engines.engines.values():
            due = min(due, engine.next_ping, engine.heard + heartbeat.dead_after)
            due = min(due, engine.sent + engine.dead_after)
        for rec in self._peers.values():
            if rec.state is PeerState.DIALING and rec.dial is not None:
                due = min(due, rec.dial.due)
        due = min(due, self.rejoining.due(now))
        return max(_MIN_TICK_S, due - now)

    def close(self, now: float) -> None:
        """Say BYE to every engine and fail every call with ClosedError (idempotent):
        the calls that ended here are in `next_events`."""
        if self.closed:
            return
        for engine in list(self.engines.engines.values()):
            self._queue(engine, engine.peer, _BYE, Bye("closed"), 0, now)
        self.leases.close()
        self._peers.clear()
        self.closed = True
        self._events += self.calls.fail_all(ClosedError, "the client was closed")


def reply_error(payload: Buffer) -> TensorRPCError:
    """The exception an ERROR payload describes (RemoteProtocolError if malformed)."""
    try:
        info = decode_control(_ERROR_HEADER, payload)
    except RemoteProtocolError as exc:
        return exc
    assert isinstance(info, ErrorInfo)
    return info.to_exception()


_S = PeerState
_T = Transition
_K = MessageKind
_REPLIES: Final = (_K.RESULT, _K.ERROR, _K.STREAM_ITEM, _K.STREAM_END)
#: Kinds dropped without an `Ignored` event in states without a handler for them.
_SILENT_DROPS: Final = frozenset({*_REPLIES, _K.PING, _K.PONG})
_Handler = Callable[
    [ClientProtocol, bytes, "Engine | None", Header, Any, float, "str | None", Any],
    "Event | None",
]
_P = ClientProtocol

#: The client's transition table towards one routing id: what ``receive``, ``tick`` and
#: the shell's inputs do, by state and input. ``kinds`` are the message kinds a row
#: dispatches on (empty: a timer, a local input, or a row about every kind); the calls
#: follow the rules of `tensorrpc._calls`. docs/protocol.md §13 is rendered from this
#: table, and tests/unit/test_client_transitions.py drives the machine through its rows.
# fmt: off
TRANSITIONS: Final[tuple[Transition[PeerState], ...]] = (
    _T(_S.NONE, (_K.HELLO,), "HELLO, acceptable", "WELCOME (new client epoch)", _S.LIVE),
    _T(_S.NONE, (_K.HELLO,), "HELLO, version/service/fingerprint differ",
       "REJECT with the reason", _S.NONE),
    _T(_S.NONE, (_K.HELLO,), "HELLO, malformed", "REJECT protocol", _S.NONE),
    _T(_S.NONE, (), "HELLO of another protocol version", "REJECT version", _S.NONE),
    _T(_S.NONE, (_K.HELLO,), "HELLO, engine id live on another peer that is reachable",
       "REJECT duplicate_id; the live session is untouched", _S.NONE),
    _T(_S.NONE, (_K.HELLO,), "HELLO, engine id live on another peer that is unreachable",
       "end the old session (its calls fail: EngineDeadError); WELCOME", _S.LIVE),
    _T(_S.NONE, (_K.REJECT,), "REJECT", "remember the refusal", _S.NONE),
    _T(_S.NONE, (), "any other message",
       "drop (RESULT, ERROR, STREAM_ITEM, STREAM_END in silence; PING unanswered)", _S.NONE),
    _T(_S.DIALING, (), "timer: hello request due",
       "PING 0; next in heartbeat interval", _S.DIALING),
    _T(_S.DIALING, (), "send fails: peer not connected",
       "retry PING 0 after capped backoff", _S.DIALING),
    _T(_S.DIALING, (_K.HELLO,), "HELLO, acceptable", "as from none", _S.LIVE),
    _T(_S.DIALING, (_K.HELLO,), "HELLO, refused",
       "as from none; ask again in the heartbeat interval", _S.DIALING),
    _T(_S.DIALING, (_K.REJECT,), "REJECT", "remember the refusal", _S.DIALING),
    _T(_S.DIALING, (), "any other message", "drop", _S.DIALING),
    _T(_S.LIVE, (), "any well-formed message", "the engine is heard now", _S.LIVE),
    _T(_S.LIVE, (_K.HELLO,), "HELLO, same epoch", "WELCOME again (same client epoch)", _S.LIVE),
    _T(_S.LIVE, (_K.HELLO,), "HELLO, new epoch or another engine, acceptable",
       "end the session (its calls fail: EngineDeadError); WELCOME (new client epoch)", _S.LIVE),
    _T(_S.LIVE, (_K.PING,), "PING n", "PONG n", _S.LIVE),
    _T(_S.LIVE, (_K.PONG,), "PONG", "nothing", _S.LIVE),
    _T(_S.LIVE, _REPLIES, "RESULT/ERROR/STREAM_ITEM/STREAM_END",
       "deliver to the call of that id sent to this engine, else drop (ending the "
       "argument lease kept for a call of that id we gave up on)", _S.LIVE),
    _T(_S.LIVE, (_K.CREDIT,), "CREDIT for a request stream",
       "add credit; wake the call's sender (another call, or none: drop)", _S.LIVE),
    _T(_S.LIVE, (), "a request item is due",
       "STREAM_ITEM(id) while credit lasts and the call has not ended", _S.LIVE),
    _T(_S.LIVE, (), "the request stream is exhausted",
       "STREAM_END(id) (the half-close), unless the call ended", _S.LIVE),
    _T(_S.LIVE, (_K.RELEASE,), "RELEASE",
       "end the argument leases it names that were kept for calls we gave up on; refuse "
       "and count any other id", _S.LIVE),
    _T(_S.LIVE, (_K.BYE,), "BYE", "end the session (its calls fail: EngineDeadError)", _S.NONE),
    _T(_S.LIVE, (_K.BYE,), "BYE, the first of two (a bound bulk connection)",
       "no new calls; wait for the BYE on the other connection (bulk rule 4)", _S.LIVE),
    _T(_S.LIVE, (), "a message other than RESULT or BYE on the bulk connection", "drop",
       _S.LIVE),
    _T(_S.LIVE, (), "the bound bulk connection is lost, the engine connected to us",
       "end the session (its calls fail: EngineDeadError); BYE, PING 0 (a new session)",
       _S.NONE),
    _T(_S.LIVE, (_K.REJECT,), "REJECT",
       "end the session (its calls fail); remember the refusal", _S.NONE),
    _T(_S.LIVE, (), "timer: heartbeat due", "PING (nonce: the send time in ns)", _S.LIVE),
    _T(_S.LIVE, (), "timer: engine silent past our dead_after",
       "end the session (calls fail)", _S.NONE),
    _T(_S.LIVE, (),
       "timer, message or new call: we sent nothing for longer than the engine's dead_after_ms",
       "end the session: the engine forgot us (calls in flight fail: EngineDeadError; "
       "calls not yet sent wait up to our dead_after for it to rejoin)", _S.NONE),
    _T(_S.LIVE, (), "send fails: peer unreachable", "end the session (calls fail)", _S.NONE),
    _T(_S.LIVE, (), "the bound bulk connection is lost after its BYE (none on control yet)",
       "wait: the control BYE or our dead_after ends the session (bulk rule 4)", _S.LIVE),
    _T(_S.LIVE, (), "send fails on control, a bulk connection bound, no BYE on it yet",
       "wait: its BYE, its loss or our dead_after ends the session (bulk rule 4)", _S.LIVE),
    _T(_S.LIVE, (), "the session ends, at a dialled address",
       "PING 0 at once (ask for HELLO)", _S.DIALING),
    _T(_S.LIVE, (), "close()", "BYE; calls fail: ClosedError", _S.NONE),
)
# fmt: on

#: The handler of each (state, kind) ``receive`` acts on (live replies are delivered
#: inline); any other pair is dropped.
_DISPATCH: Final[dict[tuple[PeerState, MessageKind], _Handler]] = {
    (_S.NONE, _K.HELLO): _sessions.on_hello,
    (_S.NONE, _K.REJECT): _sessions.on_reject,
    (_S.DIALING, _K.HELLO): _sessions.on_hello,
    (_S.DIALING, _K.REJECT): _sessions.on_reject,
    (_S.LIVE, _K.HELLO): _sessions.on_hello,
    (_S.LIVE, _K.PING): _sessions.on_ping,
    (_S.LIVE, _K.PONG): _sessions.on_pong,
    (_S.LIVE, _K.RELEASE): _P._on_release,
    (_S.LIVE, _K.CREDIT): _streams.on_engine_credit,
    (_S.LIVE, _K.BYE): _sessions.on_bye,
    (_S.LIVE, _K.REJECT): _sessions.on_reject,
}
