"""`ProtocolPair`: one ClientProtocol and its engines' ServerProtocols, wired in memory.

In the style of h11's ``tests/helpers.py`` ``ConnectionPair``: both ends are the real
sans-I/O machines, and every frame on the wire is one a machine queued in
``frames_to_send`` (the CALLs of ``start_call``, the replies of ``result``,
``stream_item``, ``stream_end``, ``error_reply``). The pair only moves messages, adds the
routing identities the sockets would, answers the machines' questions as a shell would
(a peer is reachable while its process is up; torch_shm is never negotiated) and keeps a
fake clock (``now``). A test decides when messages are delivered, when time passes and
what an engine's handlers answer; no sockets, sleeps or threads.

Topologies as in production: ``dial_in=False`` (default), the client dials listening
engines under the alias ``b"@pair/<name>"`` (kept across restarts) and they name it
`CLIENT_ID`; ``dial_in=True``, engines dial the client from ``b"<name>/<incarnation>"``
and name it `CLIENT_ADDRESS`.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from typing import Any

from tensorrpc import _codec
from tensorrpc._calls import Call
from tensorrpc._client_protocol import (
    CheckReachable,
    ClientConfig,
    ClientProtocol,
    EngineLost,
    Heartbeat,
    reply_error,
)
from tensorrpc._dispatch import type_name
from tensorrpc._exceptions import ErrorCode
from tensorrpc._liveness import to_ms
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Flags,
    Hello,
    MessageKind,
    decode_control,
    split_frames,
)
from tensorrpc._server_protocol import (
    ProtocolSettings,
    ServerCall,
    ServerProtocol,
    SessionStarted,
    ShmPeer,
    Wake,
)
from tensorrpc._service import ServiceSpec, describe, rpc, service

__all__ = ["CLIENT_ADDRESS", "CLIENT_ID", "SPEC", "EngineEnd", "Pair", "ProtocolPair", "Wire"]

CLIENT_ID = b"client-routing-id"  # the client's ROUTER routing id, to a listening engine
CLIENT_ADDRESS = "tcp://client:5555"  # the client's address, to an engine dialling in
DEFAULT_HEARTBEAT = Heartbeat(1.0, 5.0)


@service
class Pair:
    """The service both ends speak (handlers never run here)."""

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
    """One message on the wire: the engine end it came from or goes to, its frames."""

    end: str
    frames: list[Any]
    header = property(lambda self: split_frames(self.frames)[0])
    kind = property(lambda self: self.header.kind)
    call_id = property(lambda self: int(self.header.call_id))

    def body(self) -> Any:
        header, payload, _ = split_frames(self.frames)
        return decode_control(header, payload)


class EngineEnd:
    """One engine process: its ServerProtocol and its place on the wire (``up``: alive;
    ``frozen``: SIGSTOPped, messages to it wait). Its worker methods answer as the
    dispatcher does, with the frames the machine builds."""

    def __init__(self, pair: ProtocolPair, name: str, engine_id: str | None, **settings: Any):
        self.pair, self.name, self.engine_id = pair, name, engine_id or name
        self.settings, self.incarnation = settings, 0
        self.proto = self._start()

    def _start(self) -> ServerProtocol:
        self.incarnation += 1
        self.up, self.frozen = True, False
        self.inbox: collections.deque[list[Any]] = collections.deque()  # client -> engine
        self.sent: list[Wire] = []  # everything it sent (tests clear it at will)
        self.events: list[Any] = []  # its session news
        self.running: list[ServerCall] = []  # calls a worker took and has not finished
        hb, opts = self.pair.engine_heartbeat, dict(self.settings)
        hello = Hello(
            self.engine_id, SPEC.name, SPEC.fingerprint, PROTOCOL_VERSION, "pair-host",
            1000 + self.incarnation, concurrency=opts.get("max_concurrency", 64),
            heartbeat_ms=to_ms(hb.interval), methods=tuple(SPEC.methods),
            streaming=tuple(m.name for m in SPEC.methods.values() if m.streaming),
            signatures=tuple(m.signature for m in SPEC.methods.values()),
        )  # fmt: skip
        hello = replace(hello, **opts.pop("hello", {}))
        methods = {name: (m, getattr(Pair(), name)) for name, m in SPEC.methods.items()}
        epochs = itertools.count(self.incarnation * 1_000_000 + 1)  # a restart: new epochs
        settings = {"heartbeat_interval": hb.interval, "dead_after": hb.dead_after, **opts}
        proto = ServerProtocol(
            ProtocolSettings(hello, methods, listen=not self.pair.dial_in, **settings),
            new_epoch=lambda: next(epochs),
        )
        if self.pair.dial_in:
            proto.add_client(CLIENT_ADDRESS, self.pair.now)
        return proto

    @property
    def peer(self) -> bytes:  # how the client's ROUTER names it
        return (
            f"{self.name}/{self.incarnation}".encode()
            if self.pair.dial_in
            else b"@pair/" + self.name.encode()
        )

    key = property(lambda s: CLIENT_ADDRESS if s.pair.dial_in else CLIENT_ID)  # its client
    session = property(lambda s: s.proto.sessions.get(s.key))  # None: no session

    def kill(self) -> None:
        """The process dies: its connection closes, messages to and from it are lost."""
        self.up = False
        self.inbox.clear()
        pair = self.pair
        pair.to_client = collections.deque(w for w in pair.to_client if w.end != self.name)

    def restart(self) -> None:
        """A new process under the same engine id (listening: at the same address)."""
        self.kill()
        self.proto = self._start()
        self.pair._started(self)

    def next_call(self) -> ServerCall | None:
        if (call := self.proto.next_call()) is not None:
            self.running.append(call)
        return call

    def take_all(self) -> list[ServerCall]:
        return list(iter(self.next_call, None))

    def done(self, call: ServerCall) -> None:
        self.running.remove(call)
        self.proto.done(call, self.pair.now)

    def _out(self, frames: Any, call: ServerCall | None = None, done: bool = False) -> bool:
        if isinstance(frames, list):  # RESULT / STREAM_ITEM: the worker sends them
            self.pair.inject(self, frames)
        self.pair._collect(self)
        if done and call is not None:
            self.done(call)
        return frames is not None and frames is not False

    def _value(self, call: ServerCall, value: object) -> tuple[Any, Any]:
        encoded = _codec.encode(call.spec.check_result(value))
        return encoded.payload, encoded.buffers

    def reply(self, call: ServerCall, value: object, *, done: bool = True) -> bool:
        return self._out(self.proto.result(call, *self._value(call, value)), call, done)

    def item(self, call: ServerCall, value: object) -> bool:
        return self._out(self.proto.stream_item(call, *self._value(call, value)))

    def end_stream(self, call: ServerCall, *, done: bool = True) -> bool:
        return self._out(self.proto.stream_end(call), call, done)

    def error(
        self, call: ServerCall, code: ErrorCode, message: str = "", *, done: bool = True
    ) -> bool:
        return self._out(self.proto.error_reply(call, code, message or code.name), call, done)

    def raised(self, call: ServerCall, exc: BaseException, *, done: bool = True) -> bool:
        sent = self.proto.error_reply(call, ErrorCode.REMOTE, str(exc), type_name(exc))
        return self._out(sent, call, done)

    def kinds(self) -> list[MessageKind]:
        """Kinds of what it sent since the last look (forgotten)."""
        sent, self.sent = self.sent, []
        return [m.kind for m in sent]


class ProtocolPair:
    """A `ClientProtocol` and engines' `ServerProtocol`s (`EngineEnd`); ``**client``:
    more `ClientConfig` fields; ``engine_settings``: more `ProtocolSettings` fields."""

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
        self.now, self.dial_in, self._closed = now, dial_in, False
        self.engine_heartbeat = engine_heartbeat
        signatures = {name: m.signature for name, m in SPEC.methods.items()}
        config = ClientConfig(**{
            "service": SPEC.name, "fingerprint": SPEC.fingerprint, "client_id": "pair-client",
            "host_id": "pair-host", "pid": 7, "heartbeat": heartbeat, "stream_window": 4,
            "signatures": signatures, **client,
        })  # fmt: skip
        epochs = itertools.count(1)
        self.client = ClientProtocol(config, epochs=lambda: next(epochs))
        self.to_client: collections.deque[Wire] = collections.deque()  # engine -> client
        self.client_sent: list[Wire] = []  # everything the client sent
        self.events: list[Any] = []  # the client's events
        self.engines: dict[str, EngineEnd] = {}
        for engine_id in engine_ids:
            self.add_engine(engine_id, **(engine_settings or {}))

    def add_engine(self, name: str, engine_id: str | None = None, **settings: Any) -> EngineEnd:
        """Start an engine (announcing ``engine_id``); listening, the client dials it."""
        end = self.engines[name] = EngineEnd(self, name, engine_id, **settings)
        if not self.dial_in:
            self.client.dial(end.peer, f"tcp://{name}:7000", self.now)
        self._started(end)
        return end

    def _started(self, end: EngineEnd) -> None:  # its shell runs the timers once
        end.proto.tick(self.now)
        self._collect(end)
        self._collect_client()

    def end_by_peer(self, peer: bytes) -> EngineEnd | None:
        return next((e for e in self.engines.values() if e.peer == peer), None)

    def __getitem__(self, name: str) -> EngineEnd:
        return self.engines[name]

    def _collect_client(self) -> None:
        while self.client.pending:
            for event in self.client.next_events():
                self._event(event)
            for peer, frames in self.client.frames_to_send():
                self._route(peer, frames)
        self._closed = self._closed or self.client.closed  # its socket closes after BYE

    def _route(self, peer: bytes, message: list[Any]) -> None:
        end = self.end_by_peer(peer)
        if end is None or not end.up:  # ROUTER_MANDATORY: no connection, the send fails
            self.client.send_failed(peer, self.now)
            self._event(None)
        else:
            self.client_sent.append(Wire(end.name, message))
            end.inbox.append(message)

    def inject(self, end: EngineEnd, frames: list[Any]) -> None:
        """Engine ``end`` sends ``frames``."""
        end.sent.append(wire := Wire(end.name, list(frames)))
        if end.up:
            self.to_client.append(wire)

    def _collect(self, end: EngineEnd) -> None:
        for _key, frames in end.proto.frames_to_send():
            self.inject(end, frames)
        for event in end.proto.next_events():  # calls to wake: nothing waits here
            if isinstance(event, SessionStarted):
                end.proto.shm_decided(event.session, ShmPeer())
            if not isinstance(event, (ServerCall, Wake)):
                end.events.append(event)

    def _event(self, event: Any) -> None:
        if isinstance(event, CheckReachable):  # a PING to that peer goes if it is up
            end = self.end_by_peer(event.peer)
            self.client.reachable(event, end is not None and end.up, self.now)
        elif event is not None and not isinstance(event, Call):
            self.events.append(event)
        self._collect_client()

    def deliver_to_engine(self, name: str) -> bool:
        """Deliver the oldest message for engine ``name``; False if none could go."""
        end = self.engines[name]
        if not end.inbox or not end.up or end.frozen:
            return False
        end.proto.receive(end.key, end.inbox.popleft(), self.now)
        self._collect(end)
        return True

    def deliver_to_client(self) -> bool:
        """Deliver the oldest message for the client; False if none."""
        if not self.to_client or self._closed:
            self.to_client.clear()
            return False
        wire = self.to_client.popleft()
        self.client.receive(self.engines[wire.end].peer, wire.frames, self.now)
        self._collect_client()
        return True

    def flush(self) -> None:
        """Deliver everything both ways until nothing moves (frozen engines hold theirs)."""
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
        """Time passes: every timer runs (then, by default, everything is delivered)."""
        self.now += seconds
        if not self._closed:
            self.client.tick(self.now)
            self._collect_client()
        for end in self.engines.values():
            if end.up and not end.frozen:
                end.proto.tick(self.now)
                self._collect(end)
        if deliver:
            self.flush()

    def run(self, seconds: float, step: float = 0.1) -> None:
        end = self.now + seconds
        while self.now + step <= end + 1e-9:
            self.advance(step)

    def connect(self) -> None:
        """Deliver until every engine that is up is welcomed."""
        for _ in range(4):
            self.flush()
            if all(n in self.client.engines.engines for n, e in self.engines.items() if e.up):
                return
            self.advance(self.engine_heartbeat.interval)
        raise AssertionError(f"handshake did not complete: {self.events}")

    def call(
        self, method: str = "add", *args: Any, engine: str | None = None, timeout_ms: int = 0,
        no_wait: bool = False, lease: int | None = None, metadata: bytes = b"", **kwargs: Any,
    ) -> Call:  # fmt: skip
        """Start a call as `tensorrpc.Client` does and put its CALL on the wire."""
        spec = SPEC.methods[method]
        target = self.client.select(engine)
        assert target is not None, f"no engine can take a call now ({engine!r})"
        encoded = _codec.encode(spec.encode_args(args, kwargs))
        flags = (int(Flags.STREAM) if spec.streaming else 0) | (int(Flags.NO_WAIT) * no_wait)
        call = self.client.start_call(
            target, spec, None, stream=spec.streaming, now=self.now, payload=encoded.payload,
            buffers=encoded.buffers, flags=flags, timeout_ms=timeout_ms, lease=lease,
            metadata=metadata,
        )  # fmt: skip
        self._collect_client()
        return call

    def cancel(self, call: Call) -> bool:
        ended = self.client.cancel(call, self.now)
        self._collect_client()
        return ended

    def outcome(self, call: Call) -> Any:
        """A RESULT's value, else raise what the caller sees."""
        assert call.ended, f"{call!r} has not ended"
        if call.error is not None:
            raise call.error
        if call.reply_kind is not MessageKind.RESULT:
            raise reply_error(call.reply_payload)
        return call.spec.decode_result(_codec.decode(call.reply_payload, call.reply_buffers))

    def take_item(self, call: Call) -> Any:
        payload, buffers = self.client.take_item(call, self.now)
        self._collect_client()
        return call.spec.decode_result(_codec.decode(payload, buffers))

    def items(self, call: Call) -> list[Any]:
        return [self.take_item(call) for _ in range(len(call.items or ()))]

    def lost(self) -> list[EngineLost]:
        return [e for e in self.events if isinstance(e, EngineLost)]

    def client_kinds(self, name: str | None = None) -> list[MessageKind]:
        """Kinds the client sent (to ``name``) since the last look (forgotten)."""
        taken = [w for w in self.client_sent if name in (None, w.end)]
        self.client_sent = [w for w in self.client_sent if name not in (None, w.end)]
        return [w.kind for w in taken]
