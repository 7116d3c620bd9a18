"""`ProtocolPair`: a client's protocol machine and its engines', wired in memory.

h11's ``ConnectionPair`` shape: the machines are those a `tensorrpc.Client` and a
`tensorrpc.Server` build (never entered: no socket; torch_shm off); every message on the
wire is one a machine queued; the pair moves messages, keeps the clock (``now``) and
drains the machines as their shells do. The client dials listening engines, or engines
dial `CLIENT` in (``dial_in``). What the machines' users do is in `tests.pair_work`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from tensorrpc import Client, Server
from tensorrpc._client_events import CheckReachable
from tensorrpc._protocol import decode_control, split_frames

from .unit.server_helpers import Tiny

CLIENT = "tcp://client:5555"  # the client's address, and the key engines know it by


@dataclass(frozen=True, slots=True)
class Wire:
    """One message sent: the engine end it came from or went to, its frames."""

    end: EngineEnd
    frames: list[Any]
    kind = property(lambda self: split_frames(self.frames)[0].kind)
    call_id = property(lambda self: int(split_frames(self.frames)[0].call_id))
    body = property(lambda self: decode_control(*split_frames(self.frames)[:2]))


class EngineEnd:
    """One engine process (``options``: `tensorrpc.Server`'s). Killed (``up = False``), what
    it sends or is sent is lost; stopped (``frozen``, SIGSTOP), nothing is read or timed."""

    def __init__(self, pair: ProtocolPair, name: str, options: dict[str, Any]) -> None:
        self.pair, self.name, self.up, self.frozen = pair, name, True, False
        # Its routing id at the client: a new one per process for an engine that dials in.
        self.peer = f"{name}/{id(self) if pair.dial_in else 0}".encode()
        where = {"connect": CLIENT} if pair.dial_in else {"bind": f"tcp://{name}:7000"}
        self.proto = Server(Tiny(), **{"engine_id": name, **where, **options})._proto
        self.inbox: deque[list[Any]] = deque()  # client -> engine
        self.sent: list[Wire] = []  # everything it sent (tests clear it at will)
        self.events: list[Any] = []  # everything its machine reported
        if pair.dial_in:
            self.proto.add_client(CLIENT, pair.now)  # its HELLO goes at the first tick

    session = property(lambda self: self.proto.sessions.get(CLIENT))  # None: no session


class ProtocolPair:
    """A client machine (``client``: `tensorrpc.Client` options) and engines (`EngineEnd`;
    ``engine``: every engine's `tensorrpc.Server` options)."""

    def __init__(
        self, names: tuple[str, ...] | list[str] = ("e1",), *, dial_in: bool = False,
        engine: dict[str, Any] | None = None, **client: Any,
    ) -> None:  # fmt: skip
        self.now, self.dial_in, self.engine = 100.0, dial_in, {"torch_shm": False, **(engine or {})}
        options = {"client_id": "pair-client", "stream_window": 4, "torch_shm": False, **client}
        self.client = Client(Tiny, bind=CLIENT, **options)._protocol
        self.to_client: deque[Wire] = deque()  # engine -> client
        self.client_sent: list[Wire] = []  # everything the client sent
        self.events: list[Any] = []  # everything the client's machine reported
        self.engines: dict[str, EngineEnd] = {}  # by name: its latest process
        self.peers: dict[bytes, EngineEnd] = {}  # by routing id: its latest process
        for name in names:
            self.add_engine(name)

    def __getitem__(self, name: str) -> EngineEnd:
        return self.engines[name]

    def add_engine(self, name: str, **options: Any) -> EngineEnd:
        """Start an engine (``engine_id`` defaults to ``name``); listening, the client dials it."""
        end = self.engines[name] = EngineEnd(self, name, self.engine | options)
        if not self.dial_in and end.peer not in self.peers:
            self.client.dial(end.peer, f"tcp://{name}:7000", self.now)
        self.peers[end.peer] = end
        self.advance(0.0, deliver=False)
        return end

    def connect(self) -> ProtocolPair:
        """Deliver everything: every engine that is up is welcomed."""
        self.flush()
        assert all(n in self.client.engines.engines for n, e in self.engines.items() if e.up)
        return self

    def collect(self) -> None:
        """What the shells do after each input: send what the machines queued, note events."""
        while self.client.pending:
            for peer, frames in self.client.frames_to_send():  # ROUTER, mandatory routing
                if (end := self.peers.get(peer)) is None or not end.up:
                    self.client.send_failed(peer, self.now)
                else:
                    self.client_sent.append(Wire(end, frames))
                    end.inbox.append(frames)
            for event in self.client.next_events():
                self.events.append(event)
                if isinstance(event, CheckReachable):  # its PING went above: did it arrive?
                    self.client.reachable(event, event.current.alive, self.now)
        for end in self.peers.values():
            for _key, frames in end.proto.frames_to_send():
                self.inject(end, frames)
            end.events += end.proto.next_events()

    def inject(self, end: EngineEnd, frames: list[Any]) -> None:
        """Engine ``end`` sends ``frames``."""
        end.sent.append(wire := Wire(end, list(frames)))
        self.to_client.append(wire)

    def deliver_to_engine(self, name: str) -> bool:
        """Deliver the oldest message for engine ``name``; False if none could go."""
        end = self.engines[name]
        if not end.inbox or not end.up or end.frozen:
            return False
        end.proto.receive(CLIENT, end.inbox.popleft(), self.now)
        self.collect()
        return True

    def deliver_to_client(self) -> bool:
        """Deliver the oldest message for the client (one from a dead engine is lost)."""
        if not self.to_client or self.client.closed:
            return False
        if (wire := self.to_client.popleft()).end.up:
            self.client.receive(wire.end.peer, wire.frames, self.now)
            self.collect()
        return True

    def flush(self) -> None:
        """Deliver everything both ways until nothing moves (frozen engines hold theirs)."""
        self.collect()
        while any([self.deliver_to_engine(n) for n in self.engines] + [self.deliver_to_client()]):
            pass

    def advance(self, seconds: float, step: float = 0.0, *, deliver: bool = True) -> None:
        """Time passes (by ``step`` at a time): timers run, then (by default) all is delivered."""
        for _ in range(round(seconds / step) if step else 1):
            self.now += step or seconds
            if not self.client.closed:
                self.client.tick(self.now)
            for end in self.engines.values():
                if end.up and not end.frozen:
                    end.proto.tick(self.now)
            self.collect()
            if deliver:
                self.flush()
