"""An in-memory engine protocol with a fake clock, and a scripted client for it."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tensorrpc._protocol import (
    Credit,
    ErrorInfo,
    Flags,
    Header,
    Hello,
    MessageKind,
    Welcome,
    decode_control,
    encode_control,
    pack_call_header,
    pack_reply_header,
    split_frames,
)
from tensorrpc._server_protocol import ProtocolSettings, ServerCall, ServerProtocol, Wake
from tensorrpc._service import describe, rpc, service

PAYLOAD = b"\x90"  # any non-empty payload: the protocol never decodes it


@service
class Tiny:
    """One unary and one streaming method."""

    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    @rpc
    async def upload(self, xs: AsyncIterator[int]) -> int:
        return sum([x async for x in xs])

    @rpc
    async def chat(self, xs: AsyncIterator[int]) -> AsyncIterator[int]:
        async for x in xs:
            yield x


SPEC = describe(Tiny)


def make_hello() -> Hello:
    return Hello(
        engine_id="e1",
        service=SPEC.name,
        fingerprint=SPEC.fingerprint,
        protocol_version=1,
        host_id="h",
        pid=1,
        methods=tuple(SPEC.methods),
        streaming=tuple(n for n, m in SPEC.methods.items() if m.streaming),
        signatures=tuple(m.signature for m in SPEC.methods.values()),
        request_streaming=tuple(n for n, m in SPEC.methods.items() if m.request_streaming),
    )


@dataclass
class Sent:
    """One message the engine queued, decoded."""

    key: object
    header: Header
    body: Any
    hello: bool

    @property
    def kind(self) -> MessageKind:
        return self.header.kind


@dataclass
class Engine:
    """A ServerProtocol, its fake clock and what it sent, for one test."""

    proto: ServerProtocol
    now: float = 100.0
    sent: list[Sent] = field(default_factory=list)
    #: What `ServerProtocol.next_events` gave, in order: calls to wake (`Wake`) as the
    #: call itself, accepted calls apart (`accepted`).
    events: list[Any] = field(default_factory=list)
    accepted: list[ServerCall] = field(default_factory=list)

    @classmethod
    def make(cls, *, listen: bool = True, **settings: Any) -> Engine:
        instance = Tiny()
        methods = {name: (spec, getattr(instance, name)) for name, spec in SPEC.methods.items()}
        counter = itertools.count(1000)
        settings = {"hello": make_hello(), **settings}
        proto = ServerProtocol(
            ProtocolSettings(methods=methods, listen=listen, **settings),
            new_epoch=lambda: next(counter),
        )
        return cls(proto)

    # -- driving ------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.proto.tick(self.now)
        self.collect()

    def send(self, key: object, frames: list[bytes]) -> ServerCall | None:
        """``receive`` the message; the call it queued for a worker (None: none)."""
        before = len(self.accepted)
        self.proto.receive(key, frames, self.now)
        self.collect()
        return self.accepted[before] if len(self.accepted) > before else None

    def control(self, key: object, kind: MessageKind, body: Any = None, call_id: int = 0) -> None:
        self.send(key, encode_control(kind, body, call_id))

    def call(
        self, key: object, call_id: int, method: str = "add", flags: int = 0, timeout_ms: int = 0
    ) -> ServerCall | None:
        return self.send(key, [pack_call_header(call_id, method, flags, timeout_ms), PAYLOAD])

    def welcome(
        self, key: object, *, epoch: int = 7, stream_window: int = 16, **fields: Any
    ) -> None:
        self.control(
            key,
            MessageKind.WELCOME,
            Welcome("c", "h", stream_window=stream_window, epoch=epoch, **fields),
        )

    def join(self, key: object = b"c1", **fields: Any) -> None:
        """Listen mode: PING, HELLO, WELCOME."""
        self.control(key, MessageKind.PING, None, 1)
        self.welcome(key, **fields)
        self.take()

    def open_upload(self, key: object, call_id: int, method: str = "upload") -> ServerCall:
        """Open a request stream (``upload``, or ``chat``: bidirectional) and take it."""
        flags = int(Flags.REQUEST_STREAM) | (int(Flags.STREAM) if method == "chat" else 0)
        call = self.call(key, call_id, method, flags)
        assert call is not None
        self.take()
        return call

    def item(self, key: object, call_id: int, payload: bytes = b"\x01") -> None:
        """A request STREAM_ITEM from the client."""
        self.send(key, [pack_reply_header(MessageKind.STREAM_ITEM, call_id), payload])

    def half_close(self, key: object, call_id: int) -> None:
        """The client's STREAM_END of its request stream."""
        self.control(key, MessageKind.STREAM_END, None, call_id)

    def credit(self, key: object, call_id: int, n: int) -> None:
        self.control(key, MessageKind.CREDIT, Credit(n), call_id)

    # -- observing ----------------------------------------------------------------------

    def collect(self) -> None:
        proto = self.proto
        for key, frames in proto.frames_to_send():
            header, payload, _ = split_frames(frames)
            body = None
            if header.kind not in (MessageKind.RESULT, MessageKind.STREAM_ITEM):
                body = decode_control(header, payload)
            self.sent.append(Sent(key, header, body, header.kind is MessageKind.HELLO))
        for event in proto.next_events():
            if isinstance(event, ServerCall):
                self.accepted.append(event)
            else:
                self.events.append(event.call if isinstance(event, Wake) else event)

    def take(self) -> list[Sent]:
        sent, self.sent = self.sent, []
        return sent

    def kinds(self) -> list[MessageKind]:
        return [s.kind for s in self.take()]

    def only(self, kind: MessageKind) -> Sent:
        sent = self.take()
        assert [s.kind for s in sent] == [kind], sent
        return sent[0]

    def error(self, call_id: int) -> ErrorInfo:
        msg = self.only(MessageKind.ERROR)
        assert msg.header.call_id == call_id
        assert isinstance(msg.body, ErrorInfo)
        return msg.body
