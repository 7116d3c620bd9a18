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
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Final

from tensorrpc import _streams
from tensorrpc._bulk import TOKEN_BYTES
from tensorrpc._calls import Call, CallState, CallTable
from tensorrpc._engines import (
    BYE_BULK,
    BYE_CONTROL,
    CONTROL_GONE,
    MAX_PAST,
    Balancing,
    CapacityWaiters,
    Engine,
    EngineInfo,
    EngineTable,
    Rejoins,
    ShmCapability,
    check_hello,
)
from tensorrpc._exceptions import ClosedError, EngineNotFoundError, RemoteProtocolError
from tensorrpc._liveness import Backoff, check_heartbeat, ping_interval, to_ms
from tensorrpc._machine import MAX_RELEASE_LEASES, Machine, Transition, release_frames
from tensorrpc._protocol import (
    MAX_CALL_RELEASES,
    PROTOCOL_VERSION,
    Bye,
    Credit,
    ErrorInfo,
    Header,
    Hello,
    MessageKind,
    Reject,
    Release,
    Welcome,
    decode_control,
    encode_control,
    header_version,
    pack_call_header,
    split_frames,
)
from tensorrpc._statistics import ClientCounters
from tensorrpc.transports._peer import shm_terms
from tensorrpc.transports._shm_handle import TRANSPORT_NAME

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from typing_extensions import Buffer

    from tensorrpc._exceptions import TensorRPCError
    from tensorrpc._service import MethodSpec
    from tensorrpc.transports._peer import PeerFacts, ShmTerms

__all__ = [
    "TRANSITIONS",
    "PeerState",
    "ClientConfig",
    "ClientProtocol",
    "CheckReachable",
    "Dropped",
    "EngineJoined",
    "EngineLost",
    "EngineRefused",
    "Event",
    "FactsNeeded",
    "Heartbeat",
    "Ignored",
    "LeasesFreed",
    "MAX_RELEASE_LEASES",
    "Pong",
]

_RESULT: Final = MessageKind.RESULT
_ERROR: Final = MessageKind.ERROR
_STREAM_ITEM: Final = MessageKind.STREAM_ITEM
_STREAM_END: Final = MessageKind.STREAM_END
_PING: Final = MessageKind.PING
_PONG: Final = MessageKind.PONG
_HELLO: Final = MessageKind.HELLO
_BYE: Final = MessageKind.BYE
_REJECT: Final = MessageKind.REJECT
_RELEASE: Final = MessageKind.RELEASE
_FAILED: Final = CallState.FAILED
_CANCELLED: Final = CallState.CANCELLED
_ERROR_HEADER: Final = Header(MessageKind.ERROR, 1)

#: PING nonce 0 asks a listening engine to (re)send HELLO. Heartbeat PINGs carry the send
#: time in nanoseconds of the caller's clock (always > 1), so that a PONG tells the round
#: trip; HEARTBEAT_NONCE is the nonce of a reachability PING.
HELLO_REQUEST: Final = 0
HEARTBEAT_NONCE: Final = 1
#: First retry delay of a hello request whose send failed (connection not up yet).
DIAL_RETRY_MIN_S: Final = 0.005
#: Shortest and longest pause of the housekeeping timer.
_MIN_TICK_S: Final = 0.0005


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One side's liveness settings.

    Attributes:
        interval: Seconds between PINGs when the peer announced no shorter need.
        dead_after: Seconds of silence after which a peer is declared dead; announced
            to the peer (in milliseconds) in the handshake.
    """

    interval: float = 1.0
    dead_after: float = 5.0

    def __post_init__(self) -> None:
        check_heartbeat(self.interval, self.dead_after)


_DEFAULT_HEARTBEAT: Final = Heartbeat()


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """What a client says and expects in handshakes, and its bounds.

    Attributes:
        service: The service name engines must serve (ignored when ``schemaless``).
        fingerprint: The schema fingerprint engines must have (ignored when schemaless).
        client_id: Sent in WELCOME.
        host_id: Sent in WELCOME.
        pid: Sent in WELCOME.
        heartbeat: Our heartbeat interval and dead-after bound.
        stream_window: Stream items an engine may send ahead of the consumer.
        max_message_bytes: Our largest accepted frame (0: no limit), sent in WELCOME.
        balancing: How calls without a target pick an engine.
        max_in_flight: Calls in flight per engine.
        schemaless: Admit any service and fingerprint (protocol version still checked).
        signatures: Our methods (name → signature), so that a fingerprint refusal names
            the methods that differ.
        compression: The compression codecs we decode, sent in WELCOME.
        engine_keys: Engine id → the z85 CURVE public key its HELLO must come with; a
            HELLO with an id not listed, or from another key, is refused (None: ids are
            first come).
        shm_transports: What our WELCOME lists to an engine we may use torch_shm with
            (the transports we can receive).
        shm_trust_unattested: torch_shm also with engines the kernel cannot attest,
            taking the pid they claim (``shm_trust_unattested``, docs/security.md).
    """

    service: str
    fingerprint: str
    client_id: str
    host_id: str = ""
    pid: int = 0
    heartbeat: Heartbeat = _DEFAULT_HEARTBEAT
    stream_window: int = 16
    max_message_bytes: int = 0
    balancing: Balancing = "least_outstanding"
    max_in_flight: int = 1024
    schemaless: bool = False
    signatures: Mapping[str, str] | None = None
    engine_keys: Mapping[str, str] | None = None
    shm_transports: tuple[str, ...] = ("frames",)
    shm_trust_unattested: bool = False
    compression: tuple[str, ...] = ()
    #: Our bulk endpoint, announced in WELCOME with a per-session token (docs/design.md,
    #: "a bulk connection per peer"); "" when there is none.
    bulk_address: str = ""


@dataclass(frozen=True, slots=True)
class EngineJoined:
    """An engine was welcomed; ``shm``: torch_shm with it, as its HELLO's kernel
    facts decided (the shell links it: handles resolve against ``shm.kernel``)."""

    engine: Engine
    shm: ShmTerms | None = None


@dataclass(frozen=True, slots=True)
class EngineLost:
    """An engine's session ended; ``calls`` are the calls that failed with it."""

    engine: Engine
    why: str
    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class EngineRefused:
    """A handshake was refused: by us (``by_client``) or by the engine (its REJECT)."""

    engine_id: str
    reason: str
    message: str
    by_client: bool


@dataclass(frozen=True, slots=True)
class Dropped:
    """A RESULT or STREAM_ITEM nobody will decode (its ``torch_shm`` leases need release).

    ``call`` is the call it ended on a protocol violation, if any.
    """

    engine: Engine
    payload: Buffer
    buffers: Sequence[Buffer]
    call: Call | None = None
    #: The call id of a reply to no call in flight (a call we gave up on, perhaps).
    call_id: int = 0


@dataclass(frozen=True, slots=True)
class LeasesFreed:
    """Argument leases of calls we gave up on that the engine is done with (its RELEASE,
    or a late reply): the shell frees their memory. ``refused`` counts the ids of a
    RELEASE that named no lease kept for this engine (nothing freed for them)."""

    engine: Engine
    leases: tuple[int, ...]
    refused: int = 0


@dataclass(frozen=True, slots=True)
class CheckReachable:
    """A HELLO names an engine id live on another peer: is that peer still reachable?

    A PING to ``peer`` is queued in `frames_to_send`; the shell sends what is queued
    without waiting and answers `ClientProtocol.reachable` with whether that PING went:
    a live engine keeps its id (the HELLO is refused as ``duplicate_id``), a gone one is
    replaced.
    """

    peer: bytes
    #: The peer whose HELLO waits for the answer, and what it said.
    hello_peer: bytes
    hello: Hello
    info: EngineInfo
    current: Engine
    #: What the shell gathered about the HELLO's connection (torch_shm's input).
    facts: PeerFacts | None


@dataclass(frozen=True, slots=True)
class Pong:
    """An engine answered one of our heartbeat PINGs (sent at ``nonce`` nanoseconds)."""

    engine: Engine
    nonce: int


@dataclass(frozen=True, slots=True)
class FactsNeeded:
    """A HELLO came while torch_shm is on here and ``receive`` was given no facts: the
    shell gathers what the kernel says about the connection it came on and gives the
    same message (``frames``, ``key``) to ``receive`` again with them (nothing was done
    with it yet)."""

    peer: bytes
    frames: Sequence[Buffer]
    key: str | None = None


@dataclass(frozen=True, slots=True)
class Ignored:
    """A message that was dropped; ``why`` is for the log."""

    peer: bytes
    why: str


#: What `ClientProtocol.next_events` gives; a `Call` there is one a reply (or the
#: client's end) concerned: its state says what happened (the hot path allocates no
#: event for it).
Event = (
    Call
    | _streams.CreditGranted
    | EngineJoined
    | EngineLost
    | EngineRefused
    | CheckReachable
    | Dropped
    | LeasesFreed
    | Pong
    | Ignored
    | FactsNeeded
)


class _Dial:
    """An address the client dials: its alias (routing id) and hello-request schedule."""

    __slots__ = ("address", "backoff", "due")

    def __init__(self, address: str, interval: float) -> None:
        self.address = address
        self.backoff = Backoff(DIAL_RETRY_MIN_S, max(DIAL_RETRY_MIN_S, interval))
        self.due = 0.0


class PeerState(Enum):
    """Where the client stands with one routing id (docs/protocol.md §13)."""

    #: No session, not dialled (never stored).
    NONE = "none"
    #: An address we dial, no session yet.
    DIALING = "dialing"
    #: A welcomed engine.
    LIVE = "live"


class _Peer:
    """One routing id the client dials or has a session with: its one state field."""

    __slots__ = ("dial", "engine", "state")

    def __init__(self, state: PeerState, dial: _Dial | None = None) -> None:
        self.state = state
        self.dial = dial
        self.engine: Engine | None = None


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
        self._peers: dict[bytes, _Peer] = {}
        self._dial_count = 0
        #: Engines that forgot this client's session (the client stalled) and are greeted
        #: again at once: the calls not yet sent to them wait for that instead of failing.
        self.rejoining = Rejoins(config.heartbeat.dead_after)
        self.closed = False
        # The lease table (rule 6): argument and request item leases kept for calls we
        # gave up on, by (engine peer, call id) and back; engines with result leases to
        # return.
        self._held: dict[tuple[bytes, int], list[int]] = {}
        self._held_by_lease: dict[int, tuple[bytes, int]] = {}
        self._returning: list[Engine] = []
        self._release_due = False
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

    # -- dialling -------------------------------------------------------------------------

    def dial(self, alias: bytes, address: str, now: float) -> None:
        """An address was connected under routing id ``alias``: ask it for HELLO."""
        dial = _Dial(address, self.config.heartbeat.interval)
        self._peers[alias] = _Peer(PeerState.DIALING, dial)
        self._dial_count += 1
        self._hello_request(alias, dial, now)

    @property
    def dial_count(self) -> int:
        """Addresses dialled so far (also those no longer dialled)."""
        return self._dial_count

    def undial(self, address: str) -> list[bytes]:
        """Stop asking ``address`` for HELLO; its live engine (if any) stays.

        Returns:
            The aliases that dialled it (empty: it was not dialled).
        """
        aliases = [
            alias
            for alias, rec in self._peers.items()
            if rec.dial is not None and rec.dial.address == address
        ]
        for alias in aliases:
            rec = self._peers[alias]
            rec.dial = None
            if rec.state is PeerState.DIALING:
                del self._peers[alias]
        return aliases

    def announce_bulk(self, address: str) -> None:
        """Our WELCOMEs of new sessions announce this bulk endpoint, each with a token
        of its own (docs/design.md, "a bulk connection per peer")."""
        self.config = replace(self.config, bulk_address=address)
        self._facts_needed = self._facts_needed or bool(address)

    def address_of(self, peer: bytes) -> str | None:
        """The address dialled under this routing id, if any."""
        rec = self._peers.get(peer)
        return None if rec is None or rec.dial is None else rec.dial.address

    def _hello_request(self, alias: bytes, dial: _Dial, now: float) -> None:
        self._queue(None, alias, _PING, None, HELLO_REQUEST, now)
        dial.due = now + self.config.heartbeat.interval

    # -- calls ----------------------------------------------------------------------------

    def select(
        self,
        engine_id: str | None,
        now: float | None = None,
        *,
        woken: bool = False,
        wait_for_ready: bool = False,
    ) -> Engine | None:
        """The engine for a new call (see `EngineTable.select`); None: wait for capacity.

        Args:
            engine_id: The engine the call targets, or ``None`` to balance.
            now: The clock. An engine we left silent past its bound (our loop stalled)
                forgot the session: it is ended here (`EngineLost` in `next_events`), not
                sent a call, and the caller waits for it to rejoin (`rejoining`).
            woken: The caller was woken from the capacity queue (it does not requeue).
            wait_for_ready: gRPC's wait-for-ready: with no live engine for the call, the
                caller waits (an engine that joins wakes it) instead of failing; its
                deadline bounds the wait, and `absence` then says why none came.

        Raises:
            EngineNotFoundError: As `EngineTable.select`, unless the engine (or any
                engine, to balance) is expected back or ``wait_for_ready``: the caller
                waits.
        """
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
        """Enter a call to ``engine`` in the table and queue its CALL.

        Args:
            engine: Where it goes (`select`); spec: the method; waiter: the shell's
                wake-up for the caller (carried, never read); stream: a streaming call.
            payload: The encoded arguments; buffers: their out-of-band tensor frames.
            flags: CALL flag bits; timeout_ms: the relative deadline (0: none); trace: a
                trace context to carry (empty: none).
            lease: The argument tensors' torch_shm lease (None: none went by handle);
                placed: tensors and bytes that went by handle.
            returns: More result leases of this engine we are done with (as
                `return_leases`), returned with this CALL.
            metadata: The request metadata block (`tensorrpc._metadata.encode_block`).

        Returns:
            The call. Its CALL is the last message in `frames_to_send` (a RELEASE may
            have to go before it); the shell tells `call_unsent` if it cannot send it.
        """
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
            pending, engine.releases = engine.releases, []
            unique = tuple(dict.fromkeys([*pending, *returns]))
            if len(unique) <= MAX_CALL_RELEASES:
                releases = call.releases = unique
            else:
                self._release_now(engine, unique, now)
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
            leases = [] if call.lease is None else [call.lease]
            call.lease = None
            if call.request is not None and call.request.leases:
                leases.extend(call.request.leases)
                call.request.leases = []
            if leases:
                key = (engine.peer, call.call_id)
                self._held[key] = leases
                for lease in leases:
                    self._held_by_lease[lease] = key
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

    def take_lease(self, call: Call) -> int | None:
        """The argument lease to free now that ``call`` ended or got its first stream
        item (the engine attached to its arguments, or never will); None: none."""
        lease, call.lease = call.lease, None
        return lease

    def take_item_leases(self, call: Call) -> list[int]:
        """The request item leases to free now that ``call`` ended (the engine replied
        for the last time, or never will): `tensorrpc._streams` rule 6."""
        request = call.request
        if request is None or not request.leases:
            return []
        leases, request.leases = request.leases, []
        return leases

    @property
    def held_leases(self) -> int:
        """Argument and request item leases kept for calls we gave up on (awaiting the
        engine's RELEASE)."""
        return len(self._held_by_lease)

    def _free_held(self, engine: Engine, call_id: int) -> LeasesFreed | None:
        """A late reply to call ``call_id``: the engine is done with its arguments."""
        leases = self._held.pop((engine.peer, call_id), None)
        if leases is None:
            return None
        for lease in leases:
            del self._held_by_lease[lease]
        return LeasesFreed(engine, tuple(leases))

    def _on_release(self, engine: Engine, header: Header, payload: Buffer) -> Event | None:
        """The engine's RELEASE of argument leases kept for calls we gave up on; any other
        id (never made, already ended, another engine's, a running call's) is refused."""
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            return Ignored(engine.peer, f"malformed RELEASE: {exc}")
        assert isinstance(body, Release)
        freed: list[int] = []
        refused = 0
        held, by_lease = self._held, self._held_by_lease
        for lease in body.leases:
            key = by_lease.get(lease)
            if key is None or key[0] != engine.peer:
                refused += 1
                continue
            del by_lease[lease]
            kept = held[key]
            kept.remove(lease)
            if not kept:
                del held[key]
            freed.append(lease)
        return LeasesFreed(engine, tuple(freed), refused)

    def return_leases(self, engine: Engine, leases: Sequence[int]) -> bool:
        """We are done with the engine's result tensors under ``leases``: return them in
        the next CALL to it, or in a RELEASE at `release_pending`.

        Returns:
            True when nothing was waiting before: the shell calls `release_pending` once
            its caller yields (a CALL made before then carries them instead).
        """
        if not leases or not engine.alive or self.closed:
            return False
        if not engine.releases:
            self._returning.append(engine)
        engine.releases.extend(leases)
        first = not self._release_due
        self._release_due = True
        return first

    def release_pending(self, now: float) -> None:
        """RELEASE the result leases `return_leases` took that no CALL carried."""
        engines, self._returning = self._returning, []
        self._release_due = False
        for engine in engines:
            if engine.releases:
                pending, engine.releases = engine.releases, []
                if engine.alive and not self.closed:
                    self._release_now(engine, pending, now)

    def _release_now(self, engine: Engine, leases: Sequence[int], now: float) -> None:
        for frames in release_frames(leases):
            self._sends.append((engine.peer, frames))
            engine.sent = now
            engine.bytes_sent += len(frames[0]) + len(frames[1])

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

    def release(self, engine: Engine, leases: Sequence[int], now: float) -> None:
        """RELEASE now, to ``engine``, these result leases and those waiting for a CALL."""
        if not engine.alive or self.closed:
            return
        if engine.releases:
            leases = [*engine.releases, *leases]
            engine.releases = []
        if leases:
            self._release_now(engine, leases, now)

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
            events.append(self._malformed(peer, frames, exc, now))
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
                    event = self._on_bulk(engine, kind)
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
        rec: _Peer | None,
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

    def _malformed(
        self, peer: bytes, frames: Sequence[Buffer], exc: Exception, now: float
    ) -> Event:
        """Drop a malformed message; a HELLO of another version gets REJECT ``version``."""
        version = header_version(frames[0]) if frames else None
        first = memoryview(frames[0]) if frames else None
        if (
            version is not None
            and version != PROTOCOL_VERSION
            and first is not None
            and first.nbytes > 3
            and first[3] == _HELLO
        ):
            message = f"engine speaks protocol version {version}, client speaks {PROTOCOL_VERSION}"
            self._queue(None, peer, _REJECT, Reject("version", message), 0, now)
            return EngineRefused(self.address_of(peer) or repr(peer), "version", message, True)
        return Ignored(peer, f"malformed message: {exc}")

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
            freed = self._free_held(engine, header.call_id) if self._held else None
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

    def _on_ping(
        self, peer: bytes, engine: Engine | None, header: Header, *rest: Any
    ) -> Event | None:
        """A live engine's PING: PONG echoing its nonce."""
        assert engine is not None
        self._queue(engine, peer, _PONG, None, header.call_id, rest[1])
        return None

    def _on_pong(
        self, peer: bytes, engine: Engine | None, header: Header, *rest: Any
    ) -> Event | None:
        """A PONG: a heartbeat's tells the round trip (its nonce is when it was sent)."""
        if engine is not None and header.call_id > HEARTBEAT_NONCE:
            self.counters.heartbeat(engine.engine_id, rest[1] - header.call_id / 1e9)
            return Pong(engine, header.call_id)
        return None

    def _on_bye(self, peer: bytes, engine: Engine | None, *rest: Any) -> Event | None:
        assert engine is not None
        return self._bye(engine, BYE_CONTROL)

    def _on_bulk(self, engine: Engine, kind: MessageKind) -> Event | None:
        """A live session's bulk connection carried ``kind`` (not a RESULT)."""
        if kind is _BYE:
            return self._bye(engine, BYE_BULK)
        return Ignored(engine.peer, f"unexpected {kind.name} on the bulk connection")

    def _bye(self, engine: Engine, via: int) -> Event | None:
        """Rule 4 of the bulk connection: a draining engine says BYE on both of a
        session's connections, each behind what it sent there last; the session ends
        once both came (or the bulk connection is lost, or was never bound). Until then
        the engine takes no new calls."""
        engine.byes |= via
        if engine.bulk_bound and not (engine.byes & BYE_BULK and engine.byes & ~BYE_BULK):
            return None
        return self._lose(engine, "said BYE")

    def _on_release_message(
        self, peer: bytes, engine: Engine | None, header: Header, payload: Buffer, *rest: Any
    ) -> Event | None:
        assert engine is not None
        return self._on_release(engine, header, payload)

    def _on_reject_message(
        self, peer: bytes, engine: Engine | None, header: Header, payload: Buffer, *rest: Any
    ) -> Event | None:
        return self._on_reject(peer, engine, header, payload)

    def _on_hello_message(
        self,
        peer: bytes,
        engine: Engine | None,
        header: Header,
        payload: Buffer,
        now: float,
        key: str | None,
        facts: PeerFacts | None,
    ) -> Event | None:
        return self._on_hello(peer, header, payload, now, key, facts)

    # -- handshake ------------------------------------------------------------------------

    def _on_hello(
        self,
        peer: bytes,
        header: Header,
        payload: Buffer,
        now: float,
        key: str | None,
        facts: PeerFacts | None,
    ) -> Event | None:
        try:
            hello = decode_control(header, payload)
        except RemoteProtocolError as exc:
            message = f"malformed HELLO: {exc}"
            self._queue(None, peer, _REJECT, Reject("protocol", message[:4096]), 0, now)
            return Ignored(peer, message)
        assert isinstance(hello, Hello)
        previous = self._engine_at(peer)
        if previous is not None:
            if _same_session(previous, hello):
                # A repeat: the engine may have missed our WELCOME; say the same again.
                self._welcome(previous, now, previous.welcome_transports)
                return None
            why = (
                "was replaced by a new session at its address (its calls are lost)"
                if previous.engine_id == hello.engine_id
                else f"was replaced by engine {hello.engine_id!r} at its address"
            )
            self._events.append(self._lose(previous, why))
        info = _engine_info(hello, self.address_of(peer))
        refusal = self._check(info) or self._check_key(info.engine_id, key)
        if refusal is None:
            current = self.engines.engines.get(info.engine_id)
            if current is not None:  # the shell answers whether it is reachable
                return self._check_reachable(peer, hello, info, current, facts, now)
        return self._decided(peer, info, hello, refusal, now, facts)

    def _engine_at(self, peer: bytes) -> Engine | None:
        rec = self._peers.get(peer)
        return None if rec is None else rec.engine

    def _check_reachable(
        self,
        peer: bytes,
        hello: Hello,
        info: EngineInfo,
        current: Engine,
        facts: PeerFacts | None,
        now: float,
    ) -> CheckReachable:
        self._queue(current, current.peer, _PING, None, HEARTBEAT_NONCE, now)
        return CheckReachable(current.peer, peer, hello, info, current, facts)

    def reachable(self, check: CheckReachable, reachable: bool, now: float) -> None:
        """The shell's answer to `CheckReachable`: the HELLO is refused as
        ``duplicate_id`` while the live engine is reachable, else that engine is lost and
        the new one admitted (the events follow in `next_events`)."""
        if self.closed or self._engine_at(check.hello_peer) is not None:
            return
        info = check.info
        current = self.engines.engines.get(info.engine_id)
        refusal = None
        if current is not None and current is not check.current:  # changed meanwhile
            again = self._check_reachable(
                check.hello_peer, check.hello, info, current, check.facts, now
            )
            self._events.append(again)
            return
        if current is not None:
            if reachable:
                refusal = (
                    "duplicate_id",
                    f"engine id {info.engine_id!r} is already served by a live engine "
                    f"(pid {current.info.pid}); a restart may reuse it once that one is "
                    "dead or gone",
                )
            else:
                self._events.append(self._lose(current, "is unreachable (its connection closed)"))
        event = self._decided(check.hello_peer, info, check.hello, refusal, now, check.facts)
        if event is not None:
            self._events.append(event)

    def _decided(
        self,
        peer: bytes,
        info: EngineInfo,
        hello: Hello,
        refusal: tuple[str, str] | None,
        now: float,
        facts: PeerFacts | None,
    ) -> Event | None:
        if refusal is not None:
            reason, message = refusal
            self.engines.refuse(info.engine_id, reason, message)
            self._queue(None, peer, _REJECT, Reject(reason, message), 0, now)
            return EngineRefused(info.engine_id, reason, message, by_client=True)
        return self._admit(peer, info, hello, now, facts)

    def _check_key(self, engine_id: str, key: str | None) -> tuple[str, str] | None:
        """With ``engine_keys``: an id is taken only with the CURVE key bound to it."""
        keys = self.config.engine_keys
        if keys is None:
            return None
        bound = keys.get(engine_id)
        if bound is None:
            return ("other", f"engine id {engine_id!r} is not bound to a key at this client")
        if key != bound:
            return ("other", f"engine id {engine_id!r} is bound to another CURVE key")
        return None

    def _check(self, info: EngineInfo) -> tuple[str, str] | None:
        config = self.config
        return check_hello(
            info,
            service=info.service if config.schemaless else config.service,
            fingerprint=info.fingerprint if config.schemaless else config.fingerprint,
            protocol_version=PROTOCOL_VERSION,
            signatures=None if config.schemaless else config.signatures,
        )

    def _admit(
        self, peer: bytes, info: EngineInfo, hello: Hello, now: float, facts: PeerFacts | None
    ) -> EngineJoined:
        heartbeat = self.config.heartbeat
        engine = Engine(
            info=info,
            peer=peer,
            epoch=hello.epoch,
            client_epoch=self._epochs(),
            heard=now,
            sent=now,
            ping_every=ping_interval(heartbeat.interval, info.dead_after_ms),
        )
        engine.next_ping = now + engine.ping_every
        config = self.config
        if config.bulk_address:
            engine.bulk_token = self._tokens()
        engine.bulk_offer = (hello.bulk, hello.bulk_token)
        # torch_shm from the kernel's facts about the connection; the HELLO's pid and
        # host id count only for an unattested peer we were told to trust.
        terms = shm_terms(
            facts,
            hello.transports,
            hello.pid,
            hello.host_id == config.host_id,
            trust_unattested=config.shm_trust_unattested,
        )
        if terms is not None:
            engine.welcome_transports = config.shm_transports
            engine.shm = ShmCapability(pid=terms.pid, to_engine=terms.send, from_engine=True)
        seen = info.engine_id in self.engines.past
        self.counters.event(info.engine_id, "rejoined" if seen else "joined")
        self.engines.add(engine)
        self.rejoining.rejoined(info.engine_id)
        rec = self._peers.get(peer)
        if rec is None:
            rec = self._peers[peer] = _Peer(PeerState.LIVE)
        rec.state = PeerState.LIVE
        rec.engine = engine
        if rec.dial is not None:
            rec.dial.backoff.reset()
        self._welcome(engine, now, engine.welcome_transports)
        return EngineJoined(engine, terms)

    def _welcome(self, engine: Engine, now: float, transports: tuple[str, ...]) -> None:
        config = self.config
        welcome = Welcome(
            client_id=config.client_id,
            host_id=config.host_id,
            transports=transports,
            heartbeat_ms=to_ms(config.heartbeat.interval),
            stream_window=config.stream_window,
            pid=config.pid,
            max_message_bytes=config.max_message_bytes,
            epoch=engine.client_epoch,
            dead_after_ms=to_ms(config.heartbeat.dead_after),
            fingerprint="" if config.schemaless else config.fingerprint,
            compression=config.compression,
            bulk=config.bulk_address if engine.bulk_token else "",
            bulk_token=engine.bulk_token.hex(),
        )
        self._queue(engine, engine.peer, MessageKind.WELCOME, welcome, 0, now)

    def _on_reject(
        self, peer: bytes, engine: Engine | None, header: Header, payload: Buffer
    ) -> Event:
        try:
            body = decode_control(header, payload)
        except RemoteProtocolError as exc:
            body = Reject("other", f"malformed REJECT: {exc}")
        assert isinstance(body, Reject)
        who = engine.engine_id if engine is not None else self.address_of(peer) or repr(peer)
        self.engines.refuse(who, body.reason, body.message)
        if engine is not None:
            self._events.append(self._lose(engine, f"refused this client ({body.reason})"))
        return EngineRefused(who, body.reason, body.message, by_client=False)

    # -- endings --------------------------------------------------------------------------

    def _lose(self, engine: Engine, why: str) -> EngineLost:
        engine.releases = []  # its session is over: it dropped our leases itself
        if self._held:  # ours it kept end with it (the shell frees the peer's leases)
            for key in [k for k in self._held if k[0] == engine.peer]:
                for lease in self._held.pop(key):
                    del self._held_by_lease[lease]
        calls = self.calls.fail_engine(engine, why)
        self.engines.remove(engine)  # after the calls: its counters include their errors
        counters = self.counters
        counters.event(engine.engine_id, "lost")
        if len(counters.engines) > 2 * MAX_PAST:  # keep those of the ids still reported
            table = self.engines
            counters.prune({*table.past, *table.engines})
        rec = self._peers.get(engine.peer)
        if rec is not None and rec.engine is engine:
            rec.engine = None
            if rec.dial is None:
                del self._peers[engine.peer]
            else:
                rec.state = PeerState.DIALING
                rec.dial.due = 0.0  # ask the address for a HELLO again at once
        return EngineLost(engine, why, tuple(calls))

    def _forgotten(self, engine: Engine, now: float) -> EngineLost:
        self.rejoining.forgotten(engine.engine_id)
        return self._lose(
            engine,
            f"lost this client's session: nothing was sent to it for {now - engine.sent:.1f} s, "
            f"longer than its bound ({engine.dead_after:g} s; did the client's event loop "
            "stall?)",
        )

    def declare_dead(self, engine_id: str, *, pid: int, reason: str) -> bool:
        """End the session of ``engine_id`` if its engine runs as process ``pid``
        (`EngineLost` in `next_events`); False: nothing happened.

        For supervisors that saw the process die before its heartbeats stopped.
        """
        engine = self.engines.engines.get(engine_id)
        if engine is None or engine.info.pid != pid:
            return False
        self._events.append(self._lose(engine, reason))
        return True

    def send_failed(self, peer: bytes, now: float) -> None:
        """A send to ``peer`` failed because no connection to it exists (yet): its
        session ends (`EngineLost` in `next_events`), unless it said BYE already or a
        bound bulk connection has not yet carried its BYE (rule 4: that BYE, the bulk
        connection's loss or ``dead_after`` ends it); a dialled address is asked again
        after a backoff."""
        rec = self._peers.get(peer)
        if rec is None:
            return
        engine = rec.engine
        if engine is not None:
            if engine.byes & BYE_CONTROL:  # (after its BYE, its control connection may go)
                return
            if engine.bulk_bound and not engine.byes & BYE_BULK:
                # Its control BYE may be queued unread behind the closed connection (rule
                # 4): the bulk connection's BYE or loss, or dead_after, ends the session.
                engine.byes |= CONTROL_GONE
                return
            said = engine.byes & BYE_BULK  # the bulk BYE came: this is the other end
            why = "said BYE" if said else "is unreachable (its connection closed)"
            self._events.append(self._lose(engine, why))
        elif rec.dial is not None:
            rec.dial.due = now + rec.dial.backoff.failed()

    def _session_of(self, peer: bytes, epoch: int, ours: bool) -> Engine | None:
        """The live session of ``peer`` whose epoch (ours, or the engine's) is ``epoch``."""
        rec = self._peers.get(peer)
        engine = rec.engine if rec is not None else None
        if engine is None or epoch != (engine.client_epoch if ours else engine.epoch):
            return None
        return engine

    def bulk_bound(self, peer: bytes, epoch: int, *, ours: bool = False) -> None:
        """The bulk connection of ``peer``'s session of ``epoch`` (our WELCOME's epoch
        when ``ours``: the engine dialed our bulk endpoint; else its HELLO's) is bound: a
        BYE of that session comes on it too (rule 4)."""
        engine = self._session_of(peer, epoch, ours)
        if engine is not None:
            engine.bulk_bound = True

    def bulk_lost(self, peer: bytes, epoch: int, now: float, *, ours: bool = False) -> None:
        """Rule 5 (docs/design.md, "a bulk connection per peer"): the bound bulk
        connection of ``peer``'s session of ``epoch`` (as in `bulk_bound`) broke while
        control may live. The session is over, as if control had broken: its calls fail
        with `EngineDeadError` at once (what they had on the bulk connection is lost
        with it), and a new session starts over control: we ask the engine for a HELLO
        (the address we dial), or (the engine dialed us) tell it BYE and ask for a new
        one (`EngineLost` in `next_events`). After the engine's BYE on control, the end of
        its bulk connection is the other BYE; after its BYE on the bulk connection, that
        connection's end is expected and the control BYE still ends the session (what
        control carried before it, a RESULT, is delivered). Nothing: that session is
        over already."""
        engine = self._session_of(peer, epoch, ours)
        if engine is None:
            return
        if engine.byes == BYE_BULK:
            return
        if engine.byes & BYE_CONTROL:
            self._events.append(self._lose(engine, "said BYE"))
            return
        if engine.byes & CONTROL_GONE:
            self._events.append(self._lose(engine, "is unreachable (its connections closed)"))
            return
        self._events.append(self._lose(engine, "lost its bulk connection"))
        if self._peers.get(peer) is None:  # the engine dialed us: it ends its side, HELLOs anew
            self._queue(None, peer, _BYE, Bye("lost the bulk connection"), 0, now)
            self._queue(None, peer, _PING, None, HELLO_REQUEST, now)

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
        self._held.clear()
        self._held_by_lease.clear()
        self._peers.clear()
        self.closed = True
        self._events += self.calls.fail_all(ClosedError, "the client was closed")


def _same_session(engine: Engine, hello: Hello) -> bool:
    return engine.engine_id == hello.engine_id and engine.epoch == hello.epoch


def _engine_info(hello: Hello, address: str | None) -> EngineInfo:
    return EngineInfo(
        engine_id=hello.engine_id,
        service=hello.service,
        fingerprint=hello.fingerprint,
        protocol_version=hello.protocol_version,
        host_id=hello.host_id,
        pid=hello.pid,
        transports=hello.transports,
        concurrency=hello.concurrency,
        heartbeat_ms=hello.heartbeat_ms,
        methods=hello.methods,
        address=address,
        streaming=hello.streaming,
        signatures=hello.signatures,
        max_message_bytes=hello.max_message_bytes,
        dead_after_ms=hello.dead_after_ms,
        compression=hello.compression,
        request_streaming=hello.request_streaming,
        stream_window=hello.stream_window,
    )


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
    (_S.NONE, _K.HELLO): _P._on_hello_message,
    (_S.NONE, _K.REJECT): _P._on_reject_message,
    (_S.DIALING, _K.HELLO): _P._on_hello_message,
    (_S.DIALING, _K.REJECT): _P._on_reject_message,
    (_S.LIVE, _K.HELLO): _P._on_hello_message,
    (_S.LIVE, _K.PING): _P._on_ping,
    (_S.LIVE, _K.PONG): _P._on_pong,
    (_S.LIVE, _K.RELEASE): _P._on_release_message,
    (_S.LIVE, _K.CREDIT): _streams.on_engine_credit,
    (_S.LIVE, _K.BYE): _P._on_bye,
    (_S.LIVE, _K.REJECT): _P._on_reject_message,
}
