"""`ProtocolPair`: one ClientProtocol and its engines' ServerProtocols, wired in memory.

h11's ``ConnectionPair`` shape: both ends are the real sans-I/O machines, configured as
`tensorrpc.Server` and `tensorrpc.Client` configure them (the HELLO is the engine's own),
and every frame on the wire is one a machine queued in ``frames_to_send``. The pair only
moves messages (adding the routing ids the sockets would), answers the shells' questions
(a peer is reachable while its process is up; torch_shm is never negotiated) and keeps a
fake clock (``now``). ``dial_in=False``: the client dials listening engines as
``b"@pair/<name>"``, they name it `CLIENT_ID`; ``dial_in=True``: engines dial from
``b"<name>/<incarnation>"`` and name it `CLIENT_ADDRESS`.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from typing import Any

from tensorrpc import _codec
from tensorrpc._batch_runner import BatchRunners
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
from tensorrpc._protocol import Flags, MessageKind, decode_control, split_frames
from tensorrpc._server import ServerConfig, _protocol_settings
from tensorrpc._server_protocol import ServerCall, ServerProtocol, SessionStarted, ShmPeer, Wake
from tensorrpc._service import ServiceSpec, describe, rpc, service
from tensorrpc.transports._policy import TransportPolicy

CLIENT_ID, CLIENT_ADDRESS = b"client-routing-id", "tcp://client:5555"
DEFAULT_HEARTBEAT = Heartbeat(1.0, 5.0)


@service
class Pair:
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
        return decode_control(*split_frames(self.frames)[:2])


class EngineEnd:
    """One engine process (``up``: alive; ``frozen``: stopped, messages to it wait); its
    worker methods answer as the dispatcher does. ``settings``: `ServerConfig` fields,
    ``hello``: HELLO fields this engine lies about."""

    def __init__(self, pair: ProtocolPair, name: str, engine_id: str | None, **settings: Any):
        self.pair, self.name, self.engine_id = pair, name, engine_id or name
        self.settings, self.incarnation = settings, 0
        self.proto = self._start()

    def _start(self) -> ServerProtocol:
        self.incarnation, self.up, self.frozen = self.incarnation + 1, True, False
        self.inbox: collections.deque[list[Any]] = collections.deque()  # client -> engine
        self.sent: list[Wire] = []  # everything it sent (tests clear it at will)
        self.events: list[Any] = []  # its session news
        self.running: list[ServerCall] = []  # calls a worker took and has not finished
        hb, opts, pair = self.pair.engine_heartbeat, dict(self.settings), self.pair
        lies = opts.pop("hello", {})
        where: dict[str, Any] = {"bind": f"tcp://{self.name}:7000"}
        if pair.dial_in:
            where = {"connect": CLIENT_ADDRESS}
        cfg = ServerConfig(
            **where, heartbeat_interval=hb.interval, dead_after=hb.dead_after, **opts
        )
        runners = BatchRunners(SPEC, Pair(), self.engine_id, lambda: None)
        policy, codec = TransportPolicy(), _codec.CodecConfig()
        settings = _protocol_settings(cfg, SPEC, self.engine_id, Pair(), policy, runners, codec, 0)
        epochs = itertools.count(self.incarnation * 1_000_000 + 1)  # a restart: new epochs
        settings = replace(settings, hello=replace(settings.hello, **lies))
        proto = ServerProtocol(settings, new_epoch=lambda: next(epochs))
        if pair.dial_in:
            proto.add_client(CLIENT_ADDRESS, pair.now)
        return proto

    @property
    def peer(self) -> bytes:  # how the client's ROUTER names it
        dialled = f"{self.name}/{self.incarnation}" if self.pair.dial_in else f"@pair/{self.name}"
        return dialled.encode()

    key = property(lambda s: CLIENT_ADDRESS if s.pair.dial_in else CLIENT_ID)  # its client
    session = property(lambda s: s.proto.sessions.get(s.key))  # None: no session

    def kill(self) -> None:
        """The process dies: its connection closes, messages to and from it are lost."""
        self.up, pair = False, self.pair
        self.inbox.clear()
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

    def _out(self, queued: bool, call: ServerCall, done: bool = False) -> bool:
        self.pair._collect(self)
        if done:
            self.done(call)
        return queued

    def _value(self, call: ServerCall, value: object) -> tuple[Any, Any]:
        encoded = _codec.encode(call.spec.check_result(value))
        return encoded.payload, encoded.buffers

    def reply(self, call: ServerCall, value: object, *, done: bool = True) -> bool:
        return self._out(self.proto.result(call, *self._value(call, value)), call, done)

    def item(self, call: ServerCall, value: object) -> bool:
        return self._out(self.proto.stream_item(call, *self._value(call, value)), call)

    def end_stream(self, call: ServerCall, *, done: bool = True) -> bool:
        return self._out(self.proto.stream_end(call), call, done)

    def error(self, call: ServerCall, code: ErrorCode, msg: str = "", *, done: bool = True) -> bool:
        message = msg
        return self._out(self.proto.error_reply(call, code, message or code.name), call, done)

    def raised(self, call: ServerCall, exc: BaseException, *, done: bool = True) -> bool:
        queued = self.proto.error_reply(call, ErrorCode.REMOTE, str(exc), type_name(exc))
        return self._out(queued, call, done)

    def kinds(self) -> list[MessageKind]:
        """Kinds of what it sent since the last look (forgotten)."""
        sent, self.sent = self.sent, []
        return [m.kind for m in sent]


class ProtocolPair:
    """A `ClientProtocol` and engines (`EngineEnd`); ``**client``: more `ClientConfig`
    fields; ``engine_settings``: each engine's `EngineEnd` settings."""

    def __init__(
        self, engine_ids: Iterable[str] = ("e1",), *, dial_in: bool = False,
        heartbeat: Heartbeat = DEFAULT_HEARTBEAT, engine_heartbeat: Heartbeat = DEFAULT_HEARTBEAT,
        now: float = 100.0, engine_settings: dict[str, Any] | None = None, **client: Any,
    ) -> None:  # fmt: skip
        self.now, self.dial_in, self.engine_heartbeat = now, dial_in, engine_heartbeat
        signatures = {name: m.signature for name, m in SPEC.methods.items()}
        config = ClientConfig(**{
            "service": SPEC.name, "fingerprint": SPEC.fingerprint, "client_id": "pair-client",
            "heartbeat": heartbeat, "stream_window": 4, "signatures": signatures, **client,
        })  # fmt: skip
        epochs = itertools.count(1)
        self.client = ClientProtocol(config, epochs=lambda: next(epochs))
        self.to_client: collections.deque[Wire] = collections.deque()  # engine -> client
        self.client_sent: list[Wire] = []  # everything the client sent
        self.events: list[Any] = []  # the client's events (not its calls)
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
        """Do what a client shell does after an input, until the machine is done."""
        client = self.client
        while client.pending:
            for event in client.next_events():
                if isinstance(event, CheckReachable):  # its PING goes while the peer is up
                    end = self.end_by_peer(event.peer)
                    client.reachable(event, end is not None and end.up, self.now)
                elif not isinstance(event, Call):
                    self.events.append(event)
            for peer, frames in client.frames_to_send():
                self._route(peer, frames)

    def _route(self, peer: bytes, frames: list[Any]) -> None:
        end = self.end_by_peer(peer)
        if end is None or not end.up:  # ROUTER_MANDATORY: no connection, the send fails
            self.client.send_failed(peer, self.now)
        else:
            self.client_sent.append(Wire(end.name, frames))
            end.inbox.append(frames)

    def inject(self, end: EngineEnd, frames: list[Any]) -> None:
        """Engine ``end`` sends ``frames``."""
        end.sent.append(wire := Wire(end.name, list(frames)))
        if end.up:
            self.to_client.append(wire)

    def _collect(self, end: EngineEnd) -> None:
        for _key, frames in end.proto.frames_to_send():
            self.inject(end, frames)
        for event in end.proto.next_events():  # calls to take or wake: nothing waits here
            if isinstance(event, SessionStarted):
                end.proto.shm_decided(event.session, ShmPeer())
            if not isinstance(event, ServerCall | Wake):
                end.events.append(event)

    def deliver_to_engine(self, name: str) -> bool:
        """Deliver the oldest message for engine ``name``; False if none could go."""
        end = self.engines[name]
        if not end.inbox or not end.up or end.frozen:
            return False
        end.proto.receive(end.key, end.inbox.popleft(), self.now)
        self._collect(end)
        return True

    def deliver_to_client(self) -> bool:
        """Deliver the oldest message for the client; False if none (or it closed)."""
        if not self.to_client or self.client.closed:
            self.to_client.clear()
            return False
        wire = self.to_client.popleft()
        self.client.receive(self.engines[wire.end].peer, wire.frames, self.now)
        self._collect_client()
        return True

    def flush(self) -> None:
        """Deliver everything both ways until nothing moves (frozen engines hold theirs)."""
        self._collect_client()
        while any([self.deliver_to_engine(n) for n in self.engines] + [self.deliver_to_client()]):
            pass

    def advance(self, seconds: float, *, deliver: bool = True) -> None:
        """Time passes: every timer runs (then, by default, everything is delivered)."""
        self.now += seconds
        if not self.client.closed:
            self.client.tick(self.now)
            self._collect_client()
        for end in self.engines.values():
            if end.up and not end.frozen:
                end.proto.tick(self.now)
                self._collect(end)
        if deliver:
            self.flush()

    def run(self, seconds: float, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
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
        """Start a call as `tensorrpc.Client` does; its CALL goes on the wire."""
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
