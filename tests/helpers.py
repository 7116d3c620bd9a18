"""`ProtocolPair`: one ClientProtocol and its engines' ServerProtocols, wired in memory.

h11's ``ConnectionPair`` shape: both ends are the real sans-I/O machines, configured as
`tensorrpc.Server` and `tensorrpc.Client` configure them (the HELLO is the engine's own),
and every message on the wire is one a machine queued in ``frames_to_send``. The pair
only moves messages, answers the shells' questions (a peer is reachable while its
process is up; torch_shm is never negotiated) and keeps a fake clock (``now``). A test
feeds the machines as their users would (`tests.pair_work`). ``dial_in=False``: the
client dials listening engines as ``b"@pair/<name>"``; ``dial_in=True``: engines dial
`CLIENT_ADDRESS` from ``b"<name>/<incarnation>"``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from tensorrpc._batch_runner import BatchRunners
from tensorrpc._calls import Call
from tensorrpc._client_protocol import CheckReachable, ClientConfig, ClientProtocol, Heartbeat
from tensorrpc._codec import CodecConfig
from tensorrpc._protocol import decode_control, split_frames
from tensorrpc._server import ServerConfig, _protocol_settings
from tensorrpc._server_protocol import ServerCall, ServerProtocol, SessionStarted, ShmPeer, Wake
from tensorrpc.transports._policy import TransportPolicy

from .unit.server_helpers import SPEC, Tiny

__all__ = ["CLIENT_ADDRESS", "CLIENT_ID", "SPEC", "EngineEnd", "ProtocolPair", "Wire"]
CLIENT_ID, CLIENT_ADDRESS = b"client-routing-id", "tcp://client:5555"
HEARTBEAT = Heartbeat(1.0, 5.0)


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
    """One engine process (``up``: alive; ``frozen``: stopped, messages to it wait).
    ``settings``: `ServerConfig` fields; ``hello``: HELLO fields it lies about."""

    def __init__(self, pair: ProtocolPair, name: str, engine_id: str | None, **settings: Any):
        self.pair, self.name, self.engine_id = pair, name, engine_id or name
        self.settings, self.incarnation = settings, 0
        self.proto = self._start()

    def _start(self) -> ServerProtocol:
        self.incarnation, self.up, self.frozen = self.incarnation + 1, True, False
        self.inbox: deque[list[Any]] = deque()  # client -> engine
        self.sent: list[Wire] = []  # everything it sent (tests clear it at will)
        self.events: list[Any] = []  # its session news
        self.running: list[ServerCall] = []  # calls a worker took and has not finished
        pair, engine_id, opts = self.pair, self.engine_id, dict(self.settings)
        hb = pair.engine_heartbeat
        lies = opts.pop("hello", {})
        opts |= {"connect": CLIENT_ADDRESS} if pair.dial_in else {"bind": f"tcp://{self.name}:7000"}
        cfg = ServerConfig(heartbeat_interval=hb.interval, dead_after=hb.dead_after, **opts)
        batches, policy = BatchRunners(SPEC, Tiny(), engine_id, lambda: None), TransportPolicy()
        settings = _protocol_settings(
            cfg, SPEC, engine_id, Tiny(), policy, batches, CodecConfig(), 0
        )
        settings = replace(settings, hello=replace(settings.hello, **lies))
        epochs = itertools.count(self.incarnation * 1_000_000 + 1)  # a restart: new epochs
        proto = ServerProtocol(settings, new_epoch=lambda: next(epochs))
        if pair.dial_in:
            proto.add_client(CLIENT_ADDRESS, pair.now)  # its HELLO goes at the first tick
        return proto

    @property
    def peer(self) -> bytes:  # how the client's ROUTER names it
        return (
            f"{self.name}/{self.incarnation}" if self.pair.dial_in else f"@pair/{self.name}"
        ).encode()

    key = property(lambda s: CLIENT_ADDRESS if s.pair.dial_in else CLIENT_ID)  # its client
    session = property(lambda s: s.proto.sessions.get(s.key))  # None: no session

    def kill(self) -> None:
        """The process dies: its connection closes, messages to and from it are lost."""
        self.up, pair = False, self.pair
        self.inbox.clear()
        pair.to_client = deque(w for w in pair.to_client if w.end != self.name)

    def restart(self) -> None:
        """A new process under the same engine id (listening: at the same address)."""
        self.kill()
        self.proto = self._start()
        self.pair._tick(self)


class ProtocolPair:
    """A `ClientProtocol` and engines (`EngineEnd`); ``**client``: more `ClientConfig`
    fields; ``engine_settings``: each engine's settings."""

    def __init__(
        self, engine_ids: Iterable[str] = ("e1",), *, dial_in: bool = False, now: float = 100.0,
        heartbeat: Heartbeat = HEARTBEAT, engine_heartbeat: Heartbeat = HEARTBEAT,
        engine_settings: dict[str, Any] | None = None, **client: Any,
    ) -> None:  # fmt: skip
        self.now, self.dial_in, self.engine_heartbeat = now, dial_in, engine_heartbeat
        signatures = {name: m.signature for name, m in SPEC.methods.items()}
        config = ClientConfig(**{
            "service": SPEC.name, "fingerprint": SPEC.fingerprint, "client_id": "pair-client",
            "heartbeat": heartbeat, "stream_window": 4, "signatures": signatures, **client,
        })  # fmt: skip
        epochs = itertools.count(1)
        self.client = ClientProtocol(config, epochs=lambda: next(epochs))
        self.to_client: deque[Wire] = deque()  # engine -> client
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
        self._tick(end)
        return end

    def __getitem__(self, name: str) -> EngineEnd:
        return self.engines[name]

    def end_by_peer(self, peer: bytes) -> EngineEnd | None:
        return next((e for e in self.engines.values() if e.peer == peer), None)

    def _collect_client(self) -> None:
        """What a client shell does after each input, until its machine is done."""
        while self.client.pending:
            for event in self.client.next_events():
                if isinstance(event, CheckReachable):  # its PING goes while the peer is up
                    for peer, frames in self.client.frames_to_send():
                        self.client_send(peer, frames)
                    self.client.reachable(event, event.current.alive, self.now)
                elif not isinstance(event, Call):
                    self.events.append(event)
            for peer, frames in self.client.frames_to_send():
                self.client_send(peer, frames)

    def client_send(self, peer: bytes, frames: list[Any]) -> None:
        """The client's socket sends ``frames`` to ``peer``."""
        if (end := self.end_by_peer(peer)) is None or not end.up:
            self.client.send_failed(peer, self.now)  # ROUTER_MANDATORY: no connection
        else:
            self.client_sent.append(Wire(end.name, frames))
            end.inbox.append(frames)

    def inject(self, end: EngineEnd, frames: list[Any]) -> None:
        """Engine ``end`` sends ``frames``."""
        end.sent.append(wire := Wire(end.name, list(frames)))
        if end.up:
            self.to_client.append(wire)

    def _collect(self, end: EngineEnd) -> None:
        """What an engine shell does after each input (calls wait for `pair_work`)."""
        for _key, frames in end.proto.frames_to_send():
            self.inject(end, frames)
        for event in end.proto.next_events():
            if isinstance(event, SessionStarted):
                end.proto.shm_decided(event.session, ShmPeer())
            if not isinstance(event, ServerCall | Wake):
                end.events.append(event)

    def _tick(self, end: EngineEnd) -> None:
        end.proto.tick(self.now)
        self._collect(end)
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
