"""`ProtocolPair`: one ClientProtocol and its engines' ServerProtocols, wired in memory.

In the style of h11's ``tests/helpers.py`` ``ConnectionPair``: both ends are the real
sans-I/O machines (`tensorrpc._client_protocol.ClientProtocol`,
`tensorrpc._server_protocol.ServerProtocol`); the pair only moves the frames each queues
to the other, adding the routing identities the ROUTER/DEALER sockets would (the client's
alias or the engine's routing id on one side, the client's routing id or the dialled
address on the other), and keeps a fake clock (``now``). No sockets, no sleeps, no
threads: a test decides when messages are delivered, when time passes, and what the
engine's handlers answer.

What the I/O shells do around the machines is done here with the same functions they
use: a CALL is entered with `ClientProtocol.start_call` and framed with
``pack_call_header`` and the codec as `tensorrpc.Client` does; an engine's worker takes
calls with `ServerProtocol.next_call` and answers through `ServerProtocol.may_reply`,
`ServerProtocol.error_reply`, `ServerProtocol.may_send_item` / ``item_sent`` and
`ServerProtocol.done` as the dispatcher does; a reply is decoded with the codec and
`reply_error` as the client does.

Two topologies, as in production:

- ``dial_in=False`` (default): the client dials listening engines. The client names an
  engine by the alias it connected under (``b"@pair/<engine id>"``, kept across restarts,
  as ZMQ reconnects to the same address); the engine names the client by its ROUTER's
  routing id (`CLIENT_ID`).
- ``dial_in=True``: engines dial the client. The client names an engine by the routing
  id of its DEALER (``b"<engine id>/<incarnation>"``, fresh per process); the engine names
  the client by the address it dials (`CLIENT_ADDRESS`).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import AsyncIterator, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from typing_extensions import Buffer

from tensorrpc import _codec
from tensorrpc._calls import Call
from tensorrpc._client_protocol import (
    ClientConfig,
    ClientProtocol,
    EngineLost,
    Event,
    Heartbeat,
    reply_error,
)
from tensorrpc._dispatch import type_name
from tensorrpc._exceptions import ErrorCode
from tensorrpc._liveness import to_ms
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Flags,
    Header,
    Hello,
    MessageKind,
    decode_control,
    encode_control,
    pack_call_header,
    pack_reply_header,
    split_frames,
)
from tensorrpc._server_protocol import (
    Event as ServerEvent,
    ProtocolSettings,
    ServerCall,
    ServerProtocol,
    SessionStarted,
    ShmPeer,
)
from tensorrpc._service import MethodSpec, ServiceSpec, describe, rpc, service

__all__ = [
    "CLIENT_ADDRESS",
    "CLIENT_ID",
    "SPEC",
    "EngineEnd",
    "Pair",
    "PairHooks",
    "ProtocolPair",
    "Wire",
]

#: The client's ROUTER routing id, as a listening engine sees it.
CLIENT_ID = b"client-routing-id"
#: The client's address, as a dialling-in engine names it.
CLIENT_ADDRESS = "tcp://client:5555"
#: Both sides' heartbeat unless a test says otherwise.
DEFAULT_HEARTBEAT = Heartbeat(1.0, 5.0)


@service
class Pair:
    """The service both ends of a `ProtocolPair` speak (handlers never run here)."""

    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


SPEC: ServiceSpec = describe(Pair)


@dataclass(frozen=True, slots=True)
class Wire:
    """One message on the wire: who sent it, to whom, and its frames (no routing id)."""

    #: The engine end's name (`EngineEnd.name`) that sent it or is to receive it.
    end: str
    frames: list[Any]

    @property
    def header(self) -> Header:
        return split_frames(self.frames)[0]

    @property
    def kind(self) -> MessageKind:
        return self.header.kind

    @property
    def call_id(self) -> int:
        return int(self.header.call_id)

    def body(self) -> Any:
        header, payload, _ = split_frames(self.frames)
        return decode_control(header, payload)


@dataclass
class PairHooks:
    """The client shell's answers: torch_shm never offered; a peer is reachable while
    its engine process is up (a ZMQ connection exists)."""

    pair: ProtocolPair

    def shm_offer(
        self, peer: bytes, hello: Hello, frame: Buffer
    ) -> tuple[tuple[str, ...], int, bool, bool] | None:
        return None

    def reachable(self, peer: bytes) -> bool:
        end = self.pair.end_by_peer(peer)
        return end is not None and end.up

    def peer_key(self, peer: bytes) -> str | None:
        return None  # no CURVE between the pair's ends


class EngineEnd:
    """One engine process of the pair: its ServerProtocol and its place on the wire.

    ``up`` is False while the process is dead (sends to it fail: the client's ROUTER has
    no connection); ``frozen`` holds messages to it undelivered while its connection
    stays up (a stopped process: SIGSTOP).
    """

    def __init__(
        self, pair: ProtocolPair, name: str, engine_id: str | None = None, **settings: Any
    ) -> None:
        self.pair = pair
        #: The pair's name for this process (its key in `ProtocolPair.engines`).
        self.name = name
        #: The id it announces (another end's id: an impostor, or a second incarnation).
        self.engine_id = engine_id or name
        self.settings = settings
        self.incarnation = 0
        self.up = False
        self.frozen = False
        #: Client -> engine messages not yet delivered (frames after the routing id).
        self.inbox: collections.deque[list[Any]] = collections.deque()
        #: Everything this engine sent, for assertions (cleared by tests at will).
        self.sent: list[Wire] = []
        #: ServerProtocol events, in order.
        self.events: list[ServerEvent] = []
        #: Calls a worker has taken and not finished (`done`), in order.
        self.running: list[ServerCall] = []
        self.proto: ServerProtocol = self._start()

    def _start(self) -> ServerProtocol:
        self.incarnation += 1
        self.up = True
        self.frozen = False
        self.inbox.clear()
        self.running = []
        pair = self.pair
        options: dict[str, Any] = {
            "heartbeat_interval": pair.engine_heartbeat.interval,
            "dead_after": pair.engine_heartbeat.dead_after,
        }
        options.update(self.settings)
        instance = Pair()
        methods = {name: (m, getattr(instance, name)) for name, m in SPEC.methods.items()}
        hello = Hello(
            engine_id=self.engine_id,
            service=SPEC.name,
            fingerprint=SPEC.fingerprint,
            protocol_version=PROTOCOL_VERSION,
            host_id="pair-host",
            pid=1000 + self.incarnation,
            concurrency=options.get("max_concurrency", 64),
            heartbeat_ms=to_ms(options["heartbeat_interval"]),
            methods=tuple(SPEC.methods),
            streaming=tuple(m.name for m in SPEC.methods.values() if m.streaming),
            signatures=tuple(m.signature for m in SPEC.methods.values()),
        )
        hello_overrides = options.pop("hello", {})
        if hello_overrides:
            fields = {f: getattr(hello, f) for f in hello.__dataclass_fields__}
            fields.update(hello_overrides)
            hello = Hello(**fields)
        # Distinct epochs per incarnation, so that a restart is a new session.
        epochs = itertools.count(self.incarnation * 1_000_000 + 1)
        proto = ServerProtocol(
            ProtocolSettings(hello=hello, methods=methods, listen=not pair.dial_in, **options),
            new_epoch=lambda: next(epochs),
        )
        if pair.dial_in:
            proto.add_client(CLIENT_ADDRESS, pair.now)
        return proto

    # -- naming -----------------------------------------------------------------------------

    @property
    def peer(self) -> bytes:
        """How the client's ROUTER names this engine (its first frame)."""
        if self.pair.dial_in:
            return f"{self.name}/{self.incarnation}".encode()
        return f"@pair/{self.name}".encode()

    @property
    def key(self) -> Hashable:
        """How this engine names the client."""
        return CLIENT_ADDRESS if self.pair.dial_in else CLIENT_ID

    @property
    def session(self) -> Any:
        """This engine's session with the client (None: it has none)."""
        return self.proto.sessions.get(self.key)

    # -- life -------------------------------------------------------------------------------

    def kill(self) -> None:
        """The process dies: its connection closes, messages to it are lost."""
        self.up = False
        self.inbox.clear()
        self.pair.to_client = collections.deque(
            m for m in self.pair.to_client if m.end != self.name
        )

    def restart(self) -> None:
        """A new process under the same engine id (and, listening, the same address)."""
        self.kill()
        self.proto = self._start()
        self.pair._started(self)

    # -- the worker side --------------------------------------------------------------------

    def next_call(self) -> ServerCall | None:
        """A worker takes the oldest queued call (as the dispatcher's pool does)."""
        call = self.proto.next_call()
        if call is not None:
            self.running.append(call)
        return call

    def take_all(self) -> list[ServerCall]:
        """Workers take every queued call."""
        calls = []
        while (call := self.next_call()) is not None:
            calls.append(call)
        return calls

    def done(self, call: ServerCall) -> None:
        """The worker is finished with ``call`` (`ServerProtocol.done`)."""
        self.running.remove(call)
        self.proto.done(call)

    def _send(self, frames: list[Any]) -> None:
        self.proto.outbox.append((self.key, frames, False))
        self.pair._collect(self)

    def _encode(self, call: ServerCall, value: object) -> _codec.Encoded:
        return _codec.encode(call.spec.check_result(value))

    def reply(self, call: ServerCall, value: object, *, done: bool = True) -> bool:
        """The handler returned ``value``: RESULT, unless the call must get no reply."""
        sent = False
        if not call.cancelled:
            encoded = self._encode(call, value)
            if self.proto.may_reply(call):
                self._send(
                    [
                        pack_reply_header(MessageKind.RESULT, call.call_id),
                        encoded.payload,
                        *list(encoded.buffers),
                    ]
                )
                sent = True
        if done:
            self.done(call)
        return sent

    def error(
        self,
        call: ServerCall,
        code: ErrorCode,
        message: str = "",
        *,
        done: bool = True,
        exc: BaseException | None = None,
    ) -> bool:
        """Answer ERROR (a raised ``exc`` is sent as REMOTE with its type's name)."""
        if exc is not None:
            frames = self.proto.error_reply(call, ErrorCode.REMOTE, str(exc), type_name(exc))
        else:
            frames = self.proto.error_reply(call, code, message or code.name)
        if frames is not None:
            self._send(frames)
        if done:
            self.done(call)
        return frames is not None

    def raised(self, call: ServerCall, exc: BaseException, *, done: bool = True) -> bool:
        """The handler raised ``exc``: ERROR(REMOTE) naming its type."""
        return self.error(call, ErrorCode.REMOTE, done=done, exc=exc)

    def item(self, call: ServerCall, value: object) -> bool:
        """The generator yielded ``value``: STREAM_ITEM if the credit allows (False: not)."""
        if not self.proto.may_send_item(call):
            return False
        encoded = self._encode(call, value)
        self.proto.item_sent(call)
        self._send(
            [
                pack_reply_header(MessageKind.STREAM_ITEM, call.call_id),
                encoded.payload,
                *list(encoded.buffers),
            ]
        )
        return True

    def end_stream(self, call: ServerCall, *, done: bool = True) -> bool:
        """The generator finished: STREAM_END, unless the call must get no reply."""
        sent = False
        if not call.cancelled and not call.answered and self.proto.may_reply(call):
            self._send(encode_control(MessageKind.STREAM_END, None, call.call_id))
            sent = True
        if done:
            self.done(call)
        return sent

    # -- observing --------------------------------------------------------------------------

    def kinds(self) -> list[MessageKind]:
        """Kinds of what this engine sent since the last look (and forget them)."""
        sent, self.sent = self.sent, []
        return [m.kind for m in sent]


class ProtocolPair:
    """A `ClientProtocol` and engines' `ServerProtocol`s, frames moved in memory.

    Args:
        engine_ids: The engines, started at once (each is an `EngineEnd`).
        dial_in: Engines dial the client (else the client dials listening engines).
        heartbeat: The client's heartbeat interval and dead-after bound.
        engine_heartbeat: The engines' (``heartbeat_interval``/``dead_after``).
        now: The fake clock's start.
        engine_settings: More `ProtocolSettings` fields for every engine.
        **client: More `ClientConfig` fields (``stream_window``, ``max_in_flight``...).
    """

    def __init__(
        self,
        engine_ids: Iterable[str] = ("e1",),
        *,
        dial_in: bool = False,
        heartbeat: Heartbeat = DEFAULT_HEARTBEAT,
        engine_heartbeat: Heartbeat = DEFAULT_HEARTBEAT,
        now: float = 100.0,
        engine_settings: dict[str, Any] | None = None,
        **client: Any,
    ) -> None:
        self.now = now
        self.dial_in = dial_in
        self._closed = False
        self.engine_heartbeat = engine_heartbeat
        options: dict[str, Any] = {
            "service": SPEC.name,
            "fingerprint": SPEC.fingerprint,
            "client_id": "pair-client",
            "host_id": "pair-host",
            "pid": 7,
            "heartbeat": heartbeat,
            "stream_window": 4,
            "signatures": {name: m.signature for name, m in SPEC.methods.items()},
        }
        options.update(client)
        self.hooks = PairHooks(self)
        client_epochs = itertools.count(1)
        self.client = ClientProtocol(
            ClientConfig(**options), self.hooks, epochs=lambda: next(client_epochs)
        )
        #: Engine -> client messages not yet delivered, oldest first.
        self.to_client: collections.deque[Wire] = collections.deque()
        #: Everything the client sent (frames after the routing id), by engine id.
        self.client_sent: list[Wire] = []
        #: Client events (`EngineJoined`, `EngineLost`, ...), in order.
        self.events: list[Event] = []
        #: Calls a reply concerned, in the order the client saw them.
        self.resolved: list[Call] = []
        self.engines: dict[str, EngineEnd] = {}
        for engine_id in engine_ids:
            self.add_engine(engine_id, **(engine_settings or {}))

    # -- topology ---------------------------------------------------------------------------

    def add_engine(self, name: str, engine_id: str | None = None, **settings: Any) -> EngineEnd:
        """Start one more engine (announcing ``engine_id``, default ``name``); listening,
        the client dials it now."""
        end = EngineEnd(self, name, engine_id, **settings)
        self.engines[name] = end
        if not self.dial_in:
            self.client.dial(end.peer, f"tcp://{name}:7000", self.now)
        self._started(end)
        return end

    def _started(self, end: EngineEnd) -> None:
        """A process started: its shell runs its timers once (a dial-in engine says HELLO)."""
        end.proto.tick(self.now)
        self._collect(end)
        self._collect_client()

    def end_by_peer(self, peer: bytes) -> EngineEnd | None:
        for end in self.engines.values():
            if end.peer == peer:
                return end
        return None

    def __getitem__(self, engine_id: str) -> EngineEnd:
        return self.engines[engine_id]

    # -- moving frames ----------------------------------------------------------------------

    def _collect_client(self) -> None:
        client = self.client
        while client.pending:
            self._event(client.pending.popleft())
        for frames in client.frames_to_send():
            self._route(frames)
        if client.closed:
            self._closed = True  # the shell closes its socket after the BYEs

    def _route(self, frames: list[Any]) -> None:
        """A frame list from the client's ROUTER: ``[peer, *message]``."""
        peer, message = frames[0], frames[1:]
        end = self.end_by_peer(peer)
        if end is None or not end.up:
            # ROUTER_MANDATORY: no connection to that routing id; the send fails.
            self._event(self.client.unreachable(peer, self.now))
            self._collect_client()
            return
        self.client_sent.append(Wire(end.name, message))
        end.inbox.append(message)

    def _collect(self, end: EngineEnd) -> None:
        proto = end.proto
        outbox, proto.outbox = proto.outbox, []
        for key, frames, _is_hello in outbox:
            assert key == end.key, (key, end.key)
            wire = Wire(end.name, list(frames))
            end.sent.append(wire)
            if end.up:
                self.to_client.append(wire)
        # The shell wakes cancelled / credited calls (nothing waits here) and handles
        # session news: torch_shm is never negotiated, so a session sends frames only.
        proto.wakeups.clear()
        events, proto.events = proto.events, []
        for event in events:
            if isinstance(event, SessionStarted):
                event.session.shm = ShmPeer()
            end.events.append(event)

    def _event(self, event: Event | Call | None) -> None:
        if event is None:
            return
        if isinstance(event, Call):
            self.resolved.append(event)
        else:
            self.events.append(event)
        client = self.client
        while client.pending:
            self._event(client.pending.popleft())

    def deliver_to_engine(self, name: str) -> bool:
        """Deliver the oldest message waiting for engine ``name``; False if none could go."""
        end = self.engines[name]
        if not end.inbox or not end.up or end.frozen:
            return False
        message = end.inbox.popleft()
        end.proto.receive(end.key, message, self.now)
        self._collect(end)
        return True

    def deliver_to_client(self) -> bool:
        """Deliver the oldest message waiting for the client; False if none."""
        if not self.to_client:
            return False
        if self._closed:
            self.to_client.clear()  # the client's socket is closed
            return False
        wire = self.to_client.popleft()
        end = self.engines[wire.end]
        self._event(self.client.receive(end.peer, wire.frames, self.now))
        self._collect_client()
        return True

    def flush(self) -> None:
        """Deliver everything, both ways, until nothing moves (frozen engines hold theirs)."""
        self._collect_client()
        moved = True
        while moved:
            moved = False
            for name in list(self.engines):
                while self.deliver_to_engine(name):
                    moved = True
            while self.deliver_to_client():
                moved = True

    def advance(self, seconds: float, *, deliver: bool = True) -> None:
        """Time passes: both sides' timers run (then, by default, everything is delivered)."""
        self.now += seconds
        if not self._closed:
            for lost in self.client.tick(self.now):
                self._event(lost)
            self._collect_client()
        for end in self.engines.values():
            if end.up and not end.frozen:
                end.proto.tick(self.now)
                self._collect(end)
        if deliver:
            self.flush()

    def run(self, seconds: float, step: float = 0.1) -> None:
        """Let ``seconds`` pass in steps, delivering everything after each."""
        end = self.now + seconds
        while self.now + step <= end + 1e-9:
            self.advance(step)

    def connect(self) -> None:
        """Deliver until every engine that is up is welcomed (the handshake)."""
        self.flush()
        for _ in range(3):
            if all(
                self.client.engines.engines.get(e) is not None
                for e, end in self.engines.items()
                if end.up
            ):
                return
            self.advance(self.engine_heartbeat.interval)
        raise AssertionError(f"handshake did not complete: {self.events}")

    # -- the caller side --------------------------------------------------------------------

    def call(
        self,
        method: str = "add",
        *args: Any,
        engine: str | None = None,
        timeout_ms: int = 0,
        no_wait: bool = False,
        **kwargs: Any,
    ) -> Call:
        """Start a call as `tensorrpc.Client` does and put its CALL on the wire."""
        spec: MethodSpec = SPEC.methods[method]
        target = self.client.select(engine)
        assert target is not None, f"no engine can take a call now ({engine!r})"
        wire = spec.encode_args(args, kwargs)
        encoded = _codec.encode(wire)
        call = self.client.start_call(target, spec, None, stream=spec.streaming, now=self.now)
        flags = int(Flags.STREAM) if spec.streaming else 0
        if no_wait:
            flags |= int(Flags.NO_WAIT)
        header = pack_call_header(call.call_id, spec.name, flags, timeout_ms)
        self._collect_client()  # what the protocol queued goes first
        self._route([target.peer, header, encoded.payload, *encoded.buffers])
        return call

    def cancel(self, call: Call) -> bool:
        """The caller gives up (cancelled, timed out, closed the stream)."""
        ended = self.client.cancel(call, self.now)
        self._collect_client()
        return ended

    def outcome(self, call: Call) -> Any:
        """The value of a call that ended with a RESULT, else raise what the caller sees."""
        assert call.ended, f"{call!r} has not ended"
        if call.error is not None:
            raise call.error
        if call.reply_kind is not MessageKind.RESULT:
            raise reply_error(call.reply_payload)
        value = _codec.decode(call.reply_payload, call.reply_buffers)
        return call.spec.decode_result(value)

    def take_item(self, call: Call) -> Any:
        """The consumer takes the next stream item (credit goes back as the client decides)."""
        payload, buffers = self.client.take_item(call, self.now)
        self._collect_client()
        return call.spec.decode_result(_codec.decode(payload, buffers))

    def items(self, call: Call) -> list[Any]:
        """Take every stream item that has arrived."""
        out = []
        while call.items:
            out.append(self.take_item(call))
        return out

    # -- observing --------------------------------------------------------------------------

    def lost(self) -> list[EngineLost]:
        """The `EngineLost` events so far."""
        return [e for e in self.events if isinstance(e, EngineLost)]

    def client_kinds(self, name: str | None = None) -> list[MessageKind]:
        """Kinds the client sent (to engine ``name``) since the last look (and forget them)."""
        taken = [w for w in self.client_sent if name is None or w.end == name]
        self.client_sent = [w for w in self.client_sent if all(w is not t for t in taken)]
        return [w.kind for w in taken]
