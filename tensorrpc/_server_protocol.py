"""The engine's side of the protocol as a state machine, sans-I/O: frames and ``now`` in.

`ServerProtocol` holds every decision an engine makes about its clients: sessions and
their epochs, the admission of CALLs, reply legality, stream credit, liveness, strangers,
drain and BYE. It builds every frame it sends, counts every byte and drop, and owns the
``torch_shm`` argument leases of its calls; its output is `tensorrpc._machine.Machine`'s
(`frames_to_send`, `next_events`). `receive` dispatches on (session state, kind) through
`_DISPATCH`, whose handlers are the functions below the class (`TRANSITIONS` is the table).
The call side (admission by method and capacity, the queue, the busy workers) is
`tensorrpc._server_calls.CallQueue`; a listening engine's peers without a session are
`Strangers`. A client is named by an opaque hashable *key*: its routing id on a listening
engine, the address it is dialled at on a dial-in one. Nothing here imports zmq, anyio,
asyncio, trio, threading or ``time``.

Rules this module keeps (numbered as the tests cite them):

1. A session is named by a random non-zero u64 epoch, announced in HELLO; a session that
   ends (BYE, silence, REJECT, a new client epoch) never comes back: the next one gets
   a new epoch.
2. Any well-formed message from a client with a session counts as life, PING included.
   A client silent for ``dead_after`` loses its session; its calls are cancelled and
   get no reply. Silence is judged on what the shell took: before a `tick` at or past
   `silent_at` it takes what its sockets already hold.
3. A PING gets a PONG echoing its nonce (0 included) when the peer has a session; a PING
   with nonce 0 (the hello request) also gets the HELLO, and a PING from a peer without
   a session gets the HELLO only. At most one HELLO per peer per heartbeat interval.
4. Strangers (peers of a listening engine without a session) cost constant memory: at
   most ``max_strangers`` entries, the oldest evicted first, each forgotten after
   ``dead_after`` without a completed handshake.
5. Every CALL whose call id can be read gets exactly one answer: accepted (and later one
   final reply) or one ERROR naming the refusal (`ADMISSION`).
6. A CALL reusing the id of a call in flight cancels the original (which then sends
   nothing) and is answered with one ERROR(id, PROTOCOL).
7. A call gets at most one final reply, none once it is cancelled, and nothing after it.
8. A stream sends at most ``stream_window + sum(CREDIT n)`` items; window 0 means no
   item before the first CREDIT.
9. ``in_flight`` equals the number of calls in the session tables; a call leaves its
   table exactly once (`CallQueue.done`).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Final

from tensorrpc import _streams
from tensorrpc._bulk import TOKEN_BYTES, EarlyCancels
from tensorrpc._exceptions import ErrorCode, RemoteProtocolError
from tensorrpc._health import HEALTH_METHOD, HealthStatus, encode_answer, parse_request
from tensorrpc._liveness import Backoff, ping_interval, to_ms
from tensorrpc._machine import Machine, Transition, release_frames
from tensorrpc._metadata import encode_block
from tensorrpc._protocol import (
    HEADER_SIZE,
    MAGIC,
    Bye,
    Credit,
    ErrorInfo,
    Flags,
    Header,
    Hello,
    MessageKind,
    Reject,
    RejectReason,
    Release,
    Welcome,
    decode_control,
    encode_control,
    encode_error,
    pack_metadata_reply_header,
    pack_reply_header,
    split_frames,
)
from tensorrpc._server_calls import (
    ADMISSION,
    MISSING,
    CallQueue,
    Cancellable,
    ServerCall,
    Settable,
)

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence

    from typing_extensions import Buffer

    from tensorrpc._service import MethodSpec

__all__ = [
    "ADMISSION",
    "MISSING",
    "TRANSITIONS",
    "AllRejected",
    "BuiltinCall",
    "CallExpired",
    "Cancellable",
    "ProtocolSettings",
    "ServerCall",
    "ServerProtocol",
    "Session",
    "Strangers",
    "SessionEnded",
    "SessionStarted",
    "SessionState",
    "Settable",
    "ShmPeer",
    "Wake",
    "readable_call_id",
]

_CALL: Final = MessageKind.CALL
_CANCEL: Final = MessageKind.CANCEL
_CREDIT: Final = MessageKind.CREDIT
_PING: Final = MessageKind.PING
_PONG: Final = MessageKind.PONG
_REJECT: Final = MessageKind.REJECT
_BYE: Final = MessageKind.BYE
_RESULT: Final = MessageKind.RESULT
_STREAM_ITEM: Final = MessageKind.STREAM_ITEM
_STREAM_END: Final = MessageKind.STREAM_END
_HEADER: Final = struct.Struct("<2sBBHHQI")
#: The kinds a client sends about one call: a malformed one is answered ERROR(id).
_NAMES_A_CALL: Final = frozenset(
    {int(_CALL), int(_CANCEL), int(_CREDIT), int(_STREAM_ITEM), int(_STREAM_END)}
)
_U64: Final = 0xFFFF_FFFF_FFFF_FFFF
_U32: Final = 0xFFFF_FFFF
_INF: Final = float("inf")
#: First HELLO re-send delay of a dial-in engine; doubles up to the heartbeat interval.
HELLO_RETRY_MIN_S: Final = 0.05


class SessionState(Enum):
    """Where an engine stands with one client."""

    #: A listening engine has no entry for the peer (never stored).
    NONE = "none"
    #: HELLO sent or owed; no WELCOME yet.
    GREETING = "hello"
    #: WELCOME received: calls are admitted.
    LIVE = "live"
    #: The client said BYE (dial-in): no HELLO until it speaks again or ``dead_after``.
    PARTED = "parted"
    #: The client refused us (dial-in): we stopped trying.
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class ShmPeer:
    """What a session may do with ``torch_shm`` (decided at WELCOME)."""

    #: The client's process id (its handles name it).
    pid: int = 0
    #: The client attaches to our handles (result tensors may go by handle).
    peer_receives: bool = False
    #: We attach to the client's handles (the kernel attested its process).
    we_receive: bool = False


@dataclass(frozen=True, slots=True)
class ProtocolSettings:
    """What a `ServerProtocol` needs to know about its engine.

    Args:
        hello: The HELLO body to announce (``epoch`` and ``dead_after_ms`` are filled in
            per session).
        methods: Method name -> (spec, bound handler).
        listen: True for a listening engine (ROUTER), False when it dials in.
        max_concurrency: Calls run at once.
        max_queued: Calls accepted beyond those running.
        heartbeat_interval: Seconds between PINGs (and HELLO re-sends) per client.
        dead_after: Seconds of silence after which a client loses its session.
        max_strangers: Listening engine: most peers without a session remembered.
        max_parked_streams: Most streams of one client that may wait for credit at once.
        max_buffers: Most buffer frames after a payload.
    """

    hello: Hello
    methods: Mapping[str, tuple[MethodSpec, Callable[..., object]]]
    listen: bool
    max_concurrency: int = 64
    max_queued: int = 256
    heartbeat_interval: float = 1.0
    dead_after: float = 5.0
    max_strangers: int = 1024
    max_parked_streams: int = 256
    max_buffers: int = 1024
    #: Method names the shell answers itself (the built-in statistics method).
    builtins: frozenset[str] = frozenset()


class Session:
    """One client as the engine sees it (per key)."""

    __slots__ = (
        "bulk_token",
        "bytes_in",
        "bytes_out",
        "calls",
        "calls_total",
        "client_epoch",
        "client_id",
        "compression",
        "created",
        "duplicate_backoff",
        "early",
        "epoch",
        "errors",
        "hello_backoff",
        "hello_frames",
        "key",
        "last_heard",
        "max_message_bytes",
        "next_hello",
        "next_ping",
        "parked",
        "peer_dead_after_ms",
        "reject",
        "shm",
        "state",
        "stream_window",
    )

    def __init__(self, key: Hashable, now: float, heartbeat: float) -> None:
        self.key = key
        self.state = SessionState.GREETING
        self.epoch = 0
        self.client_epoch = 0
        self.client_id = ""
        self.stream_window = 16
        self.max_message_bytes = 0
        self.peer_dead_after_ms = 0
        #: The compression codecs the client decodes (WELCOME's ``compression``).
        self.compression: tuple[str, ...] = ()
        self.created = now
        self.last_heard = now
        self.next_hello = now
        self.next_ping = now + heartbeat
        self.hello_backoff = Backoff(min(HELLO_RETRY_MIN_S, heartbeat), heartbeat)
        #: Dial-in: the delay before the next HELLO after a ``duplicate_id`` refusal.
        self.duplicate_backoff: Backoff | None = None
        self.hello_frames: list[bytes] = []
        self.calls: dict[int, ServerCall] = {}
        self.parked = 0
        self.calls_total = 0
        self.errors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.reject: Reject | None = None
        self.shm: ShmPeer | None = None
        #: Our HELLO's bulk token (b"": we announce no bulk endpoint).
        self.bulk_token = b""
        #: CANCELs that may have overtaken their CALL (a session with a bulk path).
        self.early: EarlyCancels | None = None

    @property
    def name(self) -> str:
        """The client's id once known, else its key (a routing id in hex)."""
        key = self.key
        return self.client_id or (key.hex() if isinstance(key, bytes) else str(key))

    def greet(self, hello: Hello, now: float) -> None:
        """Enter GREETING for the new session ``hello`` announces: HELLO is due now."""
        self.state = SessionState.GREETING
        self.epoch = hello.epoch
        self.hello_frames = encode_control(MessageKind.HELLO, hello)
        self.client_epoch = 0
        self.client_id = ""
        self.created = now
        self.next_hello = now
        self.hello_backoff.reset()

    def start(self, welcome: Welcome, now: float, next_ping: float) -> None:
        """Enter LIVE: the client's WELCOME was accepted."""
        self.state = SessionState.LIVE
        self.client_id = welcome.client_id
        self.client_epoch = welcome.epoch
        self.stream_window = welcome.stream_window
        self.max_message_bytes = welcome.max_message_bytes
        self.peer_dead_after_ms = welcome.dead_after_ms
        self.compression = welcome.compression
        # Large CALLs may come on a bulk connection, behind their CANCEL (rule 4).
        self.early = EarlyCancels() if self.bulk_token or welcome.bulk else None
        self.last_heard = now
        self.next_ping = next_ping
        self.hello_backoff.reset()
        self.duplicate_backoff = None


@dataclass(frozen=True, slots=True)
class SessionStarted:
    """A client's WELCOME was accepted: the shell decides ``session.shm`` now, from what
    the kernel says about the connection ``frame`` (the WELCOME's payload) came on."""

    session: Session
    welcome: Welcome
    #: The WELCOME's payload frame (opaque here; the shell reads its connection's
    #: credentials).
    frame: Buffer | None = None


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """A session ended (its calls are already cancelled): free what was shared."""

    session: Session
    why: str
    #: Worth a warning (silence, a refusal), not just an info line (BYE).
    warn: bool = False
    #: What the session could do with ``torch_shm`` (its leases and mappings go now).
    shm: ShmPeer | None = None


@dataclass(frozen=True, slots=True)
class AllRejected:
    """Dial-in: every client refused this engine."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class BuiltinCall:
    """A CALL of a method the shell answers itself (``ProtocolSettings.builtins``)."""

    session: Session
    call_id: int
    method: str


@dataclass(frozen=True, slots=True)
class Released:
    """RELEASE: the client attached to the tensors of these result leases."""

    session: Session
    leases: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CallExpired:
    """A queued call's deadline passed before a worker took it: it was answered
    DEADLINE_EXCEEDED and left the queue (the shell ends its observation)."""

    call: ServerCall


class Wake:
    """A call whose worker must look at it again (the shell wakes it): it was
    cancelled, stopped, given credit, or given a request item."""

    __slots__ = ("call",)

    def __init__(self, call: ServerCall) -> None:
        self.call = call


#: What `ServerProtocol.next_events` gives; a `ServerCall` there is a call just
#: accepted (it waits in `ServerProtocol.queue` for a worker: the hot path allocates
#: no event for it).
Event = (
    SessionStarted
    | SessionEnded
    | AllRejected
    | Released
    | BuiltinCall
    | CallExpired
    | Wake
    | ServerCall
)


def readable_call_id(frame: Buffer) -> int | None:
    """The call a malformed message names, if its header says so (rule 5).

    A header frame of at least 20 bytes with the magic, a kind a client sends about a
    call (CALL, CANCEL, STREAM_ITEM, STREAM_END, CREDIT) and a non-zero ``call_id`` at
    bytes 8-15 names one, whatever else is wrong with the message (another version
    included: bytes 0-2 keep their place in every version); any other is dropped
    unanswered.
    """
    view = memoryview(frame)
    if view.ndim != 1 or view.itemsize != 1 or view.nbytes < HEADER_SIZE:
        return None
    magic, _version, kind, _flags, _reserved, call_id, _timeout = _HEADER.unpack_from(view)
    if magic != MAGIC or kind not in _NAMES_A_CALL or not call_id:
        return None
    return int(call_id)


def _new_epoch() -> int:
    return secrets.randbits(64) or 1


def _new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def _all_rejected(sessions: Collection[Session]) -> AllRejected | None:
    """Dial-in: the news that every client refused us, if they all did."""
    if not sessions or any(s.state is not SessionState.REJECTED for s in sessions):
        return None
    last = None
    for s in sessions:
        last = s.reject
    reasons = "; ".join(
        f"{s.key}: {s.reject.reason}: {s.reject.message}" for s in sessions if s.reject is not None
    )
    return AllRejected(last.reason if last else "other", reasons)


def _bytes_of(frames: Sequence[Buffer]) -> int:
    size = 0
    for frame in frames:
        size += memoryview(frame).nbytes
    return size


class Strangers:
    """Listening engine: the peers without a session, oldest first (rule 4).

    Args:
        sessions: The protocol's table of every peer (strangers are entries in it too).
        limit: Most strangers remembered; the oldest is evicted for a new one.
        dead_after: Seconds a stranger has to finish the handshake.
    """

    __slots__ = ("_dead_after", "_keys", "_limit", "_sessions", "evicted")

    def __init__(self, sessions: dict[Hashable, Session], limit: int, dead_after: float) -> None:
        self._sessions = sessions
        self._keys: dict[Hashable, None] = {}
        self._limit = limit
        self._dead_after = dead_after
        #: Strangers forgotten because the table was full.
        self.evicted = 0

    def add(self, session: Session) -> None:
        """Enter a new stranger (evicting the oldest ones while the table is full)."""
        keys = self._keys
        keys.pop(session.key, None)
        while len(keys) >= self._limit:
            oldest = next(iter(keys))
            del keys[oldest]
            self._sessions.pop(oldest, None)
            self.evicted += 1
        self._sessions[session.key] = session
        keys[session.key] = None

    def pop(self, key: Hashable) -> None:
        """``key`` is no stranger any more (it has a session, or it is forgotten)."""
        self._keys.pop(key, None)

    def purge(self, now: float) -> float:
        """Forget strangers that did not finish the handshake within ``dead_after``.

        Returns:
            When the oldest remaining stranger is due (``inf``: none is left).
        """
        keys = self._keys
        sessions = self._sessions
        limit = now - self._dead_after
        while keys:
            key = next(iter(keys))
            session = sessions.get(key)
            if session is not None and session.created > limit:
                return session.created + self._dead_after
            del keys[key]
            sessions.pop(key, None)
        return _INF


class ServerProtocol(Machine[Hashable, Event]):
    """Every decision of an engine about its clients; see the module docstring.

    Args:
        settings: The engine's identity and limits.
        new_epoch: Draws a session epoch (non-zero u64); tests pass a counter.
        new_token: Draws a session's bulk token (128 bits).

    After each input the shell takes `frames_to_send` (``(key, frames)``) and
    `next_events` (accepted calls, `Wake` for calls whose cancellation or credit their
    workers must see, session news); `pending` is True while either holds anything.
    """

    def __init__(
        self,
        settings: ProtocolSettings,
        *,
        new_epoch: Callable[[], int] = _new_epoch,
        new_token: Callable[[], bytes] = _new_token,
    ) -> None:
        super().__init__()
        self.settings = settings
        self._hello = replace(settings.hello, dead_after_ms=to_ms(settings.dead_after))
        self._listen = settings.listen
        self._heartbeat = settings.heartbeat_interval
        self._dead_after = settings.dead_after
        self._max_buffers = settings.max_buffers
        self._new_epoch = new_epoch
        self._new_token = new_token
        #: Every client with an entry, by key (strangers included).
        self.sessions: dict[Hashable, Session] = {}
        self._strangers = Strangers(self.sessions, settings.max_strangers, settings.dead_after)
        #: The call side: admission by method and capacity, the queue, the workers.
        self.calls = calls = CallQueue(settings)
        #: Accepted calls waiting for a worker.
        self.queue = calls.queue
        # The workers' side of the calls, bound to the call queue (no extra call per call).
        self.next_call = calls.next_call
        self.started = calls.started
        self.done = calls.done
        self.may_reply = calls.may_reply
        self.may_send_item = calls.may_send_item
        self.park = calls.park
        self.unpark = calls.unpark
        self.batch_wait = calls.batch_wait
        self.batch_back = calls.batch_back
        #: torch_shm: the argument leases of calls without a reply yet (`args_resolved`).
        self._arg_leases: dict[ServerCall, tuple[int, ...]] = {}
        #: New CALLs are refused with DRAINING (and health answers NOT_SERVING).
        self.draining = False
        #: What the application says of its health (`set_health`); draining overrides it.
        self.serving = HealthStatus.SERVING
        #: Shutdown cancelled the running calls.
        self.hard_stop = False
        #: The earliest time `tick` has something to do.
        self.wake_at = 0.0
        #: No session can be found silent before this time (a lower bound: messages
        #: since the last `tick` only move the truth later). The shell takes what its
        #: sockets already hold before a `tick` at or past it (rule 2).
        self.silent_at = _INF
        self.calls_total = 0
        self.errors_total = 0
        self.overloaded = 0
        self.dropped = 0
        self._ping_nonce = 0

    @property
    def strangers_evicted(self) -> int:
        """Listening engine: peers without a session forgotten because the table was full."""
        return self._strangers.evicted

    @property
    def busy(self) -> int:
        """Calls taken by a worker and not done (parked streams excluded)."""
        return self.calls.busy

    def announce_bulk(self, address: str) -> None:
        """Listening: HELLOs of new sessions announce this bulk endpoint, each with a
        token of its own (docs/design.md, "a bulk connection per peer")."""
        self._hello = replace(self._hello, bulk=address)

    # -- sessions ---------------------------------------------------------------------------

    def add_client(self, key: Hashable, now: float) -> Session:
        """Dial-in: start greeting the client at ``key`` (HELLO goes out at the next tick).

        Returns:
            The client's session entry.
        """
        session = Session(key, now, self._heartbeat)
        self._greet(session, now)
        self.sessions[key] = session
        self.wake_at = now
        return session

    def _greet(self, session: Session, now: float) -> None:
        """Enter GREETING with a new epoch (a new session): HELLO is due now."""
        epoch = self._new_epoch() & _U64 or 1
        hello = replace(self._hello, epoch=epoch)
        session.bulk_token = b""
        if hello.bulk:
            session.bulk_token = self._new_token()
            hello = replace(hello, bulk_token=session.bulk_token.hex())
        session.greet(hello, now)

    def _send_hello(self, session: Session, now: float) -> None:
        if now < session.next_hello:
            return  # at most one HELLO per heartbeat (rule 3)
        session.next_hello = now + self._heartbeat
        self._send(session.key, session.hello_frames)

    def _send(self, key: Hashable, frames: list[Any]) -> None:
        self._sends.append((key, frames))
        session = self.sessions.get(key)
        if session is not None:
            session.bytes_out += _bytes_of(frames)

    def send_failed(self, key: Hashable, frames: Sequence[Buffer], now: float) -> None:
        """The shell could not send ``frames`` to ``key`` (ZMQ full, no connection): they
        count as dropped; a dial-in HELLO is tried again soon, backing off."""
        session = self.sessions.get(key)
        if session is not None:
            session.bytes_out -= _bytes_of(frames)
            if frames is session.hello_frames:
                if session.state is SessionState.GREETING:
                    session.next_hello = now + session.hello_backoff.failed()
                    self.wake_at = min(self.wake_at, session.next_hello)
                return
        self.dropped += 1

    def unhandled(self, key: Hashable) -> None:
        """A message from ``key`` could not be handled (an error in the shell): dropped."""
        self.dropped += 1

    def _stranger(self, key: Hashable, now: float) -> Session:
        session = Session(key, now, self._heartbeat)
        self._greet(session, now)
        self._strangers.add(session)
        return session

    def _start(self, session: Session, welcome: Welcome, now: float, frame: Buffer) -> None:
        session.start(welcome, now, now + ping_interval(self._heartbeat, welcome.dead_after_ms))
        self._strangers.pop(session.key)
        self.wake_at = min(self.wake_at, session.next_ping)
        self.silent_at = min(self.silent_at, now + self._dead_after)
        self._events.append(SessionStarted(session, welcome, frame))

    def _end(
        self, session: Session, why: str, now: float, then: SessionState, *, warn: bool = False
    ) -> None:
        """End a session: cancel its calls (no replies) and enter ``then``; a listening
        engine's entry joins the strangers (forgotten unless a new handshake ends)."""
        calls, session.calls = session.calls, {}
        for call in calls.values():
            self._cancel(call)
        shm, session.shm = session.shm, None
        if session.state is SessionState.LIVE or warn:
            self._events.append(SessionEnded(session, why, warn, shm))
        if then is SessionState.GREETING:
            self._greet(session, now)
            if not self.draining:
                self._send_hello(session, now)
        else:
            session.state = then
            session.created = now
        if self._listen:
            self._strangers.add(session)

    def _refuse_session(self, session: Session, reason: str, message: str, now: float) -> None:
        """Answer a bad WELCOME with REJECT; we then forget the client (or stop trying)."""
        self._send(session.key, encode_control(_REJECT, Reject(reason, message)))
        session.reject = Reject(reason, message)
        self._end(session, f"refused: {message}", now, SessionState.REJECTED, warn=True)
        self._check_all_rejected()

    def _check_all_rejected(self) -> None:
        if not self._listen:
            event = _all_rejected(self.sessions.values())
            if event is not None:
                self._events.append(event)

    # -- input ------------------------------------------------------------------------------

    def receive(self, key: Hashable, frames: Sequence[Buffer], now: float, size: int = -1) -> None:
        """Take one message from the client at ``key``: `TRANSITIONS` by (state, kind).

        Args:
            key: The client's key.
            frames: The message, without the routing id.
            now: The current time on the shell's monotonic clock, in seconds.
            size: The message's size in bytes, when the shell knows it cheaply.

        An accepted CALL is queued (`queue`) and reported in `next_events` as the
        `ServerCall` itself; `wake_at` moves to its deadline if that is earlier.
        """
        session = self.sessions.get(key)
        try:
            header, payload, buffers = split_frames(frames, max_buffers=self._max_buffers)
        except RemoteProtocolError as exc:
            self._malformed(key, session, readable_call_id(frames[0]) if frames else None, exc)
            return
        kind = header.kind
        if session is None:
            if not self._listen:  # dial-in: only the addresses we dial have entries
                self.dropped += 1
                return
            state = SessionState.NONE
        else:
            session.bytes_in += size if size >= 0 else _bytes_of(frames)
            state = session.state
            if state is SessionState.LIVE:
                session.last_heard = now  # rule 2: any well-formed message is life
                if kind is _CALL:  # the hot path, inline
                    if header.releases:  # result leases returned with the CALL (RELEASE)
                        self._events.append(Released(session, header.releases))
                    _admit(self, session, header, payload, buffers, now)
                    return
                if kind is _STREAM_ITEM:  # a request item (it has buffers)
                    _streams.on_request_item(self, session, header, payload, buffers)
                    return
        handler = _DISPATCH.get((state, kind))
        if handler is None:
            self.dropped += 1
        else:
            handler(self, key, session, header, payload, now)

    def _malformed(
        self, key: Hashable, session: Session | None, call_id: int | None, exc: Exception
    ) -> None:
        """Drop a malformed message; one that names a call is answered ERROR(id, PROTOCOL),
        and a call of that id in flight ends with it (rule 5)."""
        self.dropped += 1
        if call_id is None:
            return
        call = None if session is None else session.calls.get(call_id)
        if call is not None:
            self._cancel(call)
        if session is not None:
            session.errors += 1
        self._error(key, call_id, ErrorCode.PROTOCOL, str(exc))

    def _error(self, key: Hashable, call_id: int, code: ErrorCode, message: str) -> None:
        self.errors_total += 1
        self._send(key, encode_error(call_id, ErrorInfo(int(code), "", message)))

    def _refuse(self, session: Session, call_id: int, code: ErrorCode, message: str) -> None:
        session.errors += 1
        if code is ErrorCode.OVERLOADED:
            self.overloaded += 1
        self._error(session.key, call_id, code, message)

    def health(self, service: str = "") -> HealthStatus:
        """The engine's health as the built-in health method answers it for ``service``
        (``""``: the engine as a whole; the engine serves one service, so both agree)."""
        if service and service != self._hello.service:
            return HealthStatus.SERVICE_UNKNOWN
        return HealthStatus.NOT_SERVING if self.draining else self.serving

    def set_health(self, status: HealthStatus) -> None:
        """The application says whether it serves (``SERVING`` or ``NOT_SERVING``)."""
        if status not in (HealthStatus.SERVING, HealthStatus.NOT_SERVING):
            raise ValueError(f"an engine is SERVING or NOT_SERVING, not {status.value}")
        self.serving = status

    def _wake(self, call: ServerCall) -> None:
        self._events.append(Wake(call))

    def _cancel(self, call: ServerCall) -> None:
        if not call.cancelled:
            call.cancelled = True
            self._events.append(Wake(call))

    # -- timers -----------------------------------------------------------------------------

    def tick(self, now: float) -> float:
        """Run the timers: silent clients, PINGs, HELLO re-sends, stale strangers, and
        queued calls whose deadline passed (answered DEADLINE_EXCEEDED now).

        Returns:
            The time at which `tick` next has something to do (also kept in
            `wake_at`; inputs may move it earlier).
        """
        wake = now + self._heartbeat
        dead_after = self._dead_after
        silent_at = _INF
        for session in list(self.sessions.values()):
            state = session.state
            if state is SessionState.LIVE:
                if now - session.last_heard > dead_after:
                    silent = now - session.last_heard
                    why = f"silent for {silent:.1f} s: its {len(session.calls)} calls cancelled"
                    self._end(session, why, now, SessionState.GREETING, warn=True)
                    if not self._listen:
                        wake = min(wake, session.next_hello)
                    continue
                if now >= session.next_ping:
                    self._ping(session, now)
                silent_at = min(silent_at, session.last_heard + dead_after)
                wake = min(wake, session.next_ping, silent_at)
            elif self._listen:
                continue  # strangers: purged below
            elif state is SessionState.GREETING and not self.draining:
                if now >= session.next_hello:
                    self._send_hello(session, now)
                wake = min(wake, session.next_hello)
            elif state is SessionState.PARTED and now - session.created > dead_after:
                # A client restarted at the same address cannot speak first: greet it.
                self._greet(session, now)
                self._send_hello(session, now)
        if self._listen:
            wake = min(wake, self._strangers.purge(now))
        wake = min(wake, _expire_queued(self, now))
        self.wake_at = wake
        self.silent_at = silent_at
        return wake

    def _ping(self, session: Session, now: float) -> None:
        self._ping_nonce = self._ping_nonce % _U32 + 1
        self._send(session.key, encode_control(_PING, None, self._ping_nonce))
        session.next_ping = now + ping_interval(self._heartbeat, session.peer_dead_after_ms)

    # -- replies, for the workers -------------------------------------------------------------
    #
    # A worker encodes a result and asks the machine to reply: every reply is queued in
    # `frames_to_send`, the reply last (the worker takes them and sends that one itself,
    # zero-copy, waiting a bounded time). The first reply ends the client's argument
    # leases: the shell detaches argument tensors still on the client's regions first.

    def result(self, call: ServerCall, payload: Buffer, buffers: Sequence[Buffer]) -> bool:
        """Queue the RESULT that ends ``call``; False when it must get no reply."""
        if call.cancelled or call.answered:  # `may_reply`, inline (the hot path)
            return False
        call.answered = True
        if call.request is not None:  # the client takes its item regions back
            call.request.end_leases()
        self._reply_frames(call, _RESULT, payload, buffers)
        return True

    def stream_item(self, call: ServerCall, payload: Buffer, buffers: Sequence[Buffer]) -> bool:
        """Queue the STREAM_ITEM of a stream's next item, counted against its credit;
        False when the stream may not send it (no credit, cancelled, ended)."""
        if call.credits <= 0 or call.cancelled or call.answered:
            return False
        call.credits -= 1
        if call.stats is not None:
            call.stats.items += 1
        self._reply_frames(call, _STREAM_ITEM, payload, buffers)
        return True

    def _reply_frames(
        self, call: ServerCall, kind: MessageKind, payload: Buffer, buffers: Sequence[Buffer]
    ) -> None:
        if call.keep is not None:
            self._replied(call)
        if call.reply_metadata and kind is _RESULT:
            head = pack_metadata_reply_header(kind, call.call_id, encode_block(call.reply_metadata))
        else:
            head = pack_reply_header(kind, call.call_id)
        frames: list[Buffer] = [head, payload, *buffers]
        size = len(head) + memoryview(payload).nbytes
        for buffer in buffers:
            size += memoryview(buffer).nbytes
        call.session.bytes_out += size
        self._sends.append((call.key, frames))

    def _replied(self, call: ServerCall) -> None:
        """The call's first reply goes: the client takes its argument regions back."""
        call.keep = None
        self._arg_leases.pop(call, None)

    def _final(self, call: ServerCall) -> bool:
        """Claim the call's final reply (rule 7), with which the client takes its argument
        and request item regions back; False when it has one or must get none."""
        if not self.may_reply(call):
            return False
        if call.keep is not None:
            self._replied(call)
        if call.request is not None:
            call.request.end_leases()
        return True

    def stream_end(self, call: ServerCall) -> bool:
        """Queue the STREAM_END that ends a stream; False when it must get no reply."""
        if not self._final(call):
            return False
        if call.reply_metadata:
            block = encode_block(call.reply_metadata)
            frames = [pack_metadata_reply_header(_STREAM_END, call.call_id, block), b""]
        else:
            frames = encode_control(_STREAM_END, None, call.call_id)
        self._send(call.key, frames)
        return True

    def error_reply(
        self,
        call: ServerCall,
        code: ErrorCode,
        message: str,
        type_name: str = "",
        tb: str = "",
        path: tuple[str | int, ...] = (),
    ) -> bool:
        """Queue the ERROR that ends ``call``; False when it must get no reply."""
        if not self._final(call):
            return False
        call.session.errors += 1
        self.errors_total += 1
        call.outcome = code.name
        info = ErrorInfo(int(code), type_name, message, tb, path)
        self._send(call.key, encode_error(call.call_id, info))
        return True

    def builtin_reply(self, event: BuiltinCall, payload: Buffer) -> None:
        """Queue the RESULT of a method the shell answers itself."""
        self._send(event.session.key, [pack_reply_header(_RESULT, event.call_id), payload])

    def builtin_refused(self, event: BuiltinCall, info: ErrorInfo) -> None:
        """Queue the ERROR refusing a method the shell answers itself."""
        self._send(event.session.key, encode_error(event.call_id, info))

    def stop(self, call: ServerCall) -> None:
        """Shutdown stopped ``call`` before it ran (its reply is DRAINING)."""
        call.shutdown = True

    # -- torch_shm argument leases ------------------------------------------------------------

    def shm_decided(self, session: Session, shm: ShmPeer) -> None:
        """What a session may do with ``torch_shm`` (the shell's answer to its handshake)."""
        session.shm = shm

    def args_resolved(self, call: ServerCall, leases: tuple[int, ...]) -> None:
        """The call's arguments resolved handles under these leases: their tensors may sit
        on the client's regions (``call.keep``: detach them before the first reply), and
        the client keeps the leases until that reply."""
        call.keep = (call.session, call.call_id)
        if leases:
            self._arg_leases[call] = leases

    def items_resolved(self, call: ServerCall, leases: Sequence[int]) -> None:
        """A request item of ``call`` resolved handles under these leases: its tensors may
        sit on the client's regions until the final reply (`_streams` rule 6)."""
        stream = call.request
        assert stream is not None
        stream.resolved((call.session, call.call_id, "items"), leases)

    def args_done(
        self, call: ServerCall, unread: Sequence[int] = (), unread_items: Sequence[int] = ()
    ) -> None:
        """A worker is done with a call that may hold argument leases (the shell detached
        what used the regions). One the client gave up on and that ends without a reply
        owes it a RELEASE of them (``unread``: those of arguments never decoded,
        ``unread_items``: of items never taken); one whose session ended owes nothing."""
        call.keep = None
        item_leases = call.request.end_leases() if call.request is not None else []
        leases = self._arg_leases.pop(call, ())
        session = call.session
        if session.shm is None or call.answered or not call.cancelled:
            return
        if session.calls.get(call.call_id) is not call:
            return
        if call.payload is not None:  # never decoded: the ids its handles name
            leases = tuple(unread)
            call.payload = None
            call.buffers = ()
        if item_leases or unread_items:
            leases = (*leases, *item_leases, *unread_items)
        for frames in release_frames(leases):
            self._send(session.key, frames)

    # -- drain ------------------------------------------------------------------------------

    def start_drain(self) -> None:
        """Refuse new CALLs with DRAINING and stop greeting clients."""
        self.draining = True

    def stop_all(self) -> None:
        """Shutdown: every queued and running call is stopped and answered DRAINING."""
        self.hard_stop = True
        for session in list(self.sessions.values()):
            for call in session.calls.values():
                if not call.shutdown:
                    call.shutdown = True
                    self._events.append(Wake(call))

    def goodbye(self) -> None:
        """Queue BYE to every client that has or may get a session (not refused, parted)."""
        bye = encode_control(_BYE, Bye("shutdown"))
        for session in self.sessions.values():
            if session.state not in (SessionState.REJECTED, SessionState.PARTED):
                self._send(session.key, bye)

    def in_flight(self) -> int:
        """Calls queued or running (parked streams and batched calls included, also those
        of a session that ended while they waited: their workers are not done with them)."""
        calls = self.calls
        return calls.busy + len(self.queue) + calls.parked + calls.batched


def _expire_queued(p: ServerProtocol, now: float) -> float:
    """Answer DEADLINE_EXCEEDED to the queued calls whose deadline passed (when it
    passes, not when a worker frees up); the time the next one may pass."""
    for call in p.calls.expire(now):
        p.error_reply(
            call,
            ErrorCode.DEADLINE_EXCEEDED,
            f"{call.spec.qualname} waited in the queue past its deadline",
        )
        p._events.append(CallExpired(call))
    return p.calls.expiry


def _admit(
    p: ServerProtocol,
    session: Session,
    header: Header,
    payload: Buffer,
    buffers: Sequence[Buffer],
    now: float,
) -> None:
    """The admission table (`ADMISSION`) for a CALL of a live session."""
    call_id: int = header.call_id
    calls = session.calls
    original = calls.get(call_id)
    if original is not None:  # rule 6
        p._cancel(original)
        message = f"call id {call_id} is already in flight: both calls are cancelled"
        p._refuse(session, call_id, ErrorCode.PROTOCOL, message)
        return
    early = session.early
    if early is not None and early and early.take(call_id):
        return  # its CANCEL came first (rule 4 of the bulk connection)
    if header.method == HEALTH_METHOD:
        _answer_health(p, session, header, payload, buffers)
        return
    if p.draining:
        message = f"engine {p._hello.engine_id!r} is shutting down"
        p._refuse(session, call_id, ErrorCode.DRAINING, message)
        return
    verdict = p.calls.admit(session, header, payload, buffers, now)
    if verdict is None:
        p._events.append(BuiltinCall(session, call_id, header.method))
        return
    if isinstance(verdict, tuple):
        p._refuse(session, call_id, *verdict)
        return
    calls[call_id] = verdict
    session.calls_total += 1
    p.calls_total += 1
    if verdict.deadline < p.wake_at:  # the timer that refuses it if it waits too long
        p.wake_at = verdict.deadline
    p._events.append(verdict)


def _answer_health(
    p: ServerProtocol, session: Session, header: Header, payload: Buffer, buffers: Sequence[Buffer]
) -> None:
    """Answer the built-in health method here, without a worker (also while draining)."""
    call_id: int = header.call_id
    if int(header.flags) & int(Flags.STREAM) or buffers:
        message = f"{HEALTH_METHOD} is a unary call without tensors"
        p._refuse(session, call_id, ErrorCode.INVALID_ARGUMENT, message)
        return
    try:
        service = parse_request(payload)
    except ValueError as exc:
        p._refuse(session, call_id, ErrorCode.INVALID_ARGUMENT, str(exc))
        return
    answer = encode_answer(service, p.health(service))
    p._send(session.key, [pack_reply_header(_RESULT, call_id), answer])


# -- the handlers `TRANSITIONS` dispatches to: (machine, key, session, header, payload, now)


def _on_stranger(
    p: ServerProtocol,
    key: Hashable,
    session: Session | None,
    header: Header,
    payload: Buffer,
    now: float,
) -> None:
    """A PING or WELCOME from a peer without an entry: HELLO with a new epoch."""
    if p.draining:
        p.dropped += 1
        return
    p._send_hello(p._stranger(key, now), now)


def _no_session_call(
    p: ServerProtocol,
    key: Hashable,
    session: Session | None,
    header: Header,
    payload: Buffer,
    now: float,
) -> None:
    """A CALL without a session: ERROR(id, PROTOCOL) (rule 5)."""
    p.dropped += 1
    if session is not None:
        session.errors += 1
    message = "no session: the handshake (PING, HELLO, WELCOME) is not complete"
    p._error(key, header.call_id, ErrorCode.PROTOCOL, message)


def _on_ping(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    """PING: PONG echoing its nonce; the hello request (nonce 0) also gets the HELLO."""
    p._send(key, encode_control(_PONG, None, header.call_id))
    if header.call_id == 0:
        p._send_hello(session, now)  # rule 3


def _on_greeting_ping(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    """PING before WELCOME: the HELLO again (rate-limited, rule 3)."""
    p._send_hello(session, now)


def _on_pong(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    """PONG: the life it shows is all it says."""


def _on_cancel(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    call = session.calls.get(header.call_id)
    if call is not None:
        p._cancel(call)
    elif session.early is not None:  # its CALL may still be on the bulk connection
        session.early.cancelled(header.call_id)


def _on_credit(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    try:
        body = decode_control(header, payload)
    except RemoteProtocolError as exc:  # CREDIT n=0 among them: malformed (rule 5)
        p._malformed(key, session, header.call_id, exc)
        return
    assert isinstance(body, Credit)
    call = session.calls.get(header.call_id)
    if call is None or call.cancelled:
        return  # the stream already ended
    call.credits += body.n
    if call.parked:
        p._events.append(Wake(call))


def _on_release(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    try:
        body = decode_control(header, payload)
    except RemoteProtocolError:
        p.dropped += 1
        return
    assert isinstance(body, Release)
    p._events.append(Released(session, body.leases))


def _on_bye(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    p._end(session, "said BYE", now, SessionState.PARTED)


def _on_parted(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    """The parted client speaks again: a new session, HELLO (new epoch); a CALL also
    gets its ERROR (rule 5)."""
    if header.kind is _CALL:
        _no_session_call(p, key, session, header, payload, now)
    if p.draining:
        return
    p._greet(session, now)
    p._send_hello(session, now)


def _on_welcome(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    try:
        welcome = decode_control(header, payload)
    except RemoteProtocolError as exc:
        p.dropped += 1
        p._refuse_session(session, RejectReason.PROTOCOL, f"malformed WELCOME: {exc}", now)
        return
    assert isinstance(welcome, Welcome)
    ours = p._hello.fingerprint
    if welcome.fingerprint and welcome.fingerprint != ours:
        p._refuse_session(
            session,
            RejectReason.FINGERPRINT,
            f"client has a different schema (fingerprint {welcome.fingerprint[:12]}, "
            f"engine's {ours[:12]})",
            now,
        )
        return
    if session.state is SessionState.LIVE:
        if welcome.epoch == session.client_epoch:
            return  # a repeated WELCOME of this session
        # The client started a new session (it lost the old one): the old calls go,
        # without replies; our epoch stays, since the client welcomed it.
        calls, session.calls = session.calls, {}
        for call in calls.values():
            p._cancel(call)
        shm, session.shm = session.shm, None
        p._events.append(SessionEnded(session, "started a new session", shm=shm))
    p._start(session, welcome, now, payload)


def _on_reject(
    p: ServerProtocol, key: Hashable, session: Session, header: Header, payload: Buffer, now: float
) -> None:
    try:
        body = decode_control(header, payload)
    except RemoteProtocolError as exc:
        body = Reject(RejectReason.OTHER, f"malformed REJECT: {exc}")
    assert isinstance(body, Reject)
    why = f"refused engine {p._hello.engine_id!r}: {body.reason}: {body.message}"
    if body.reason == RejectReason.DUPLICATE_ID and not p._listen:
        _duplicate(p, session, why, now)
        return
    session.reject = body
    p._end(session, why, now, SessionState.REJECTED, warn=True)
    p._check_all_rejected()


def _duplicate(p: ServerProtocol, session: Session, why: str, now: float) -> None:
    """Dial-in: another engine holds our id at this client (first come, without
    CURVE keys bound to ids). Not final: HELLO again after a growing delay (up to
    ``dead_after``), so we take the id once its holder is gone."""
    backoff = session.duplicate_backoff
    if backoff is None:
        heartbeat = p._heartbeat
        backoff = Backoff(heartbeat, max(heartbeat, p._dead_after))
    delay = backoff.failed()
    p._end(session, f"{why}; HELLO again in {delay:g} s", now, SessionState.REJECTED, warn=True)
    p._greet(session, now)
    session.duplicate_backoff = backoff
    session.next_hello = now + delay
    p.wake_at = min(p.wake_at, session.next_hello)


_S = SessionState
_T = Transition
_K = MessageKind
_Handler = Callable[[ServerProtocol, Hashable, Any, Header, Any, float], None]

#: The engine's transition table towards one client: what ``receive`` and ``tick`` do,
#: by state and input. ``kinds`` are the message kinds a row dispatches on (empty: a
#: timer, or a row about every kind); docs/protocol.md §9 is rendered from this table, and
#: tests/unit/test_server_transitions.py drives the machine through every row.
# fmt: off
TRANSITIONS: Final[tuple[Transition[SessionState], ...]] = (
    _T(_S.NONE, (_K.PING,), "PING",
       "HELLO (new epoch; at most max_strangers peers remembered)", _S.GREETING),
    _T(_S.NONE, (_K.WELCOME,), "WELCOME",
       "HELLO (new epoch): it answers no HELLO of a session", _S.GREETING),
    _T(_S.NONE, (_K.CALL,), "CALL", "ERROR(id, PROTOCOL)", _S.NONE),
    _T(_S.NONE, (), "any other message", "drop", _S.NONE),
    _T(_S.GREETING, (_K.PING,), "PING",
       "HELLO (same epoch, at most one per heartbeat)", _S.GREETING),
    _T(_S.GREETING, (_K.WELCOME,), "WELCOME", "start the session", _S.LIVE),
    _T(_S.GREETING, (_K.WELCOME,), "WELCOME, malformed", "REJECT protocol", _S.REJECTED),
    _T(_S.GREETING, (_K.WELCOME,), "WELCOME, another non-empty fingerprint",
       "REJECT fingerprint", _S.REJECTED),
    _T(_S.GREETING, (_K.CALL,), "CALL", "ERROR(id, PROTOCOL)", _S.GREETING),
    _T(_S.GREETING, (_K.REJECT,), "REJECT", "stop greeting the client", _S.REJECTED),
    _T(_S.GREETING, (_K.REJECT,), "REJECT duplicate_id (dial-in)",
       "HELLO again after a growing delay (heartbeat, doubled, at most dead_after)", _S.GREETING),
    _T(_S.GREETING, (_K.BYE,), "BYE", "nothing more until it speaks again", _S.PARTED),
    _T(_S.GREETING, (), "any other message", "drop", _S.GREETING),
    _T(_S.GREETING, (), "timer: hello due (dial-in)",
       "HELLO (same epoch; backoff while the send fails)", _S.GREETING),
    _T(_S.LIVE, (_K.PING,), "PING n",
       "PONG n; for n = 0 also HELLO (same epoch, at most one per heartbeat)", _S.LIVE),
    _T(_S.LIVE, (_K.PONG,), "PONG", "nothing", _S.LIVE),
    _T(_S.LIVE, (_K.CALL,), "CALL",
       "pass on the result leases it returns (RELEASES); admit (ADMISSION) or ERROR", _S.LIVE),
    _T(_S.LIVE, (_K.CALL,), "CALL with an id in flight",
       "cancel the original; ERROR(id, PROTOCOL)", _S.LIVE),
    _T(_S.LIVE, (_K.CANCEL,), "CANCEL",
       "cancel the call (no reply; once its handler is done, RELEASE its torch_shm "
       "argument leases); unknown id: nothing", _S.LIVE),
    _T(_S.LIVE, (_K.CREDIT,), "CREDIT", "add credit; wake the stream", _S.LIVE),
    _T(_S.LIVE, (_K.STREAM_ITEM,), "STREAM_ITEM of a request stream",
       "buffer the item (it takes one credit); wake the handler", _S.LIVE),
    _T(_S.LIVE, (_K.STREAM_ITEM,),
       "STREAM_ITEM past the credit, after STREAM_END, or for a call whose request is "
       "not a stream", "ERROR(id, PROTOCOL); the call ends", _S.LIVE),
    _T(_S.LIVE, (_K.STREAM_END,), "STREAM_END of a request stream",
       "half-close: the handler's stream ends after its buffered items", _S.LIVE),
    _T(_S.LIVE, (_K.STREAM_END,),
       "STREAM_END again, or for a call whose request is not a stream",
       "ERROR(id, PROTOCOL); the call ends", _S.LIVE),
    _T(_S.LIVE, (_K.STREAM_ITEM, _K.STREAM_END), "STREAM_ITEM/STREAM_END, no call of that id",
       "drop (the call ended while the client sent)", _S.LIVE),
    _T(_S.LIVE, (), "handler takes request items",
       "CREDIT(id, n) once it took half the window (not after STREAM_END)", _S.LIVE),
    _T(_S.LIVE, (_K.RELEASE,), "RELEASE", "pass the result leases on to the transport", _S.LIVE),
    _T(_S.LIVE, (_K.WELCOME,), "WELCOME, same client epoch", "nothing", _S.LIVE),
    _T(_S.LIVE, (_K.WELCOME,), "WELCOME, new client epoch",
       "cancel the calls; new session (the engine's epoch stays)", _S.LIVE),
    _T(_S.LIVE, (_K.BYE,), "BYE", "cancel the calls; end the session", _S.PARTED),
    _T(_S.LIVE, (_K.REJECT,), "REJECT", "cancel the calls; end the session", _S.REJECTED),
    _T(_S.LIVE, (), "timer: ping due", "PING", _S.LIVE),
    _T(_S.LIVE, (), "timer: dead_after",
       "cancel the calls; end the session; HELLO (new epoch)", _S.GREETING),
    _T(_S.PARTED, (), "any message",
       "HELLO (new epoch); a CALL also gets ERROR(id, PROTOCOL)", _S.GREETING),
    _T(_S.PARTED, (), "timer: dead_after (dial-in)", "HELLO (new epoch)", _S.GREETING),
    _T(_S.REJECTED, (), "any message", "drop", _S.REJECTED),
    _T(_S.GREETING, (), "timer: dead_after without WELCOME (listen)", "forget the peer", _S.NONE),
    _T(_S.PARTED, (), "timer: dead_after (listen)", "forget the peer", _S.NONE),
    _T(_S.REJECTED, (), "timer: dead_after (listen)", "forget the peer", _S.NONE),
)
# fmt: on

#: The handler of each (state, kind) ``receive`` acts on; any other pair is dropped.
_DISPATCH: Final[dict[tuple[SessionState, MessageKind], _Handler]] = {
    (_S.NONE, _K.PING): _on_stranger,
    (_S.NONE, _K.WELCOME): _on_stranger,
    (_S.NONE, _K.CALL): _no_session_call,
    (_S.GREETING, _K.PING): _on_greeting_ping,
    (_S.GREETING, _K.WELCOME): _on_welcome,
    (_S.GREETING, _K.CALL): _no_session_call,
    (_S.GREETING, _K.REJECT): _on_reject,
    (_S.GREETING, _K.BYE): _on_bye,
    (_S.LIVE, _K.PING): _on_ping,
    (_S.LIVE, _K.PONG): _on_pong,
    (_S.LIVE, _K.CANCEL): _on_cancel,
    (_S.LIVE, _K.CREDIT): _on_credit,
    (_S.LIVE, _K.STREAM_END): _streams.on_half_close,
    (_S.LIVE, _K.RELEASE): _on_release,
    (_S.LIVE, _K.WELCOME): _on_welcome,
    (_S.LIVE, _K.BYE): _on_bye,
    (_S.LIVE, _K.REJECT): _on_reject,
    **{(_S.PARTED, kind): _on_parted for kind in MessageKind},
}
