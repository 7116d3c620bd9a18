"""Scripted engines for ClientProtocol unit tests: frames in, frames out, a fake clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorrpc import _codec
from tensorrpc._calls import Call
from tensorrpc._client_events import ClientConfig, Heartbeat
from tensorrpc._client_protocol import ClientProtocol
from tensorrpc._engines import Engine
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Bye,
    ErrorInfo,
    Hello,
    MessageKind,
    Reject,
    decode_control,
    encode_control,
    encode_error,
    pack_reply_header,
    split_frames,
)
from tensorrpc._service import MethodSpec, describe

from .server_helpers import Tiny

SPEC = describe(Tiny)  # the engine-side tests' service
ADD: MethodSpec = SPEC.methods["add"]
COUNT: MethodSpec = SPEC.methods["count"]
UPLOAD: MethodSpec = SPEC.methods["upload"]
CHAT: MethodSpec = SPEC.methods["chat"]


def make_protocol(**kw: Any) -> ClientProtocol:
    options: dict[str, Any] = {
        "service": SPEC.name,
        "fingerprint": SPEC.fingerprint,
        "client_id": "c1",
        "heartbeat": Heartbeat(1.0, 5.0),
        "stream_window": 4,
        "max_in_flight": 8,
    }
    options.update(kw)
    epochs = iter(range(100, 10**6))
    return ClientProtocol(ClientConfig(**options), epochs=lambda: next(epochs))


def hello(engine_id: str = "e1", **kw: Any) -> list[bytes]:
    fields: dict[str, Any] = {
        "engine_id": engine_id,
        "service": SPEC.name,
        "fingerprint": SPEC.fingerprint,
        "protocol_version": PROTOCOL_VERSION,
        "host_id": "h",
        "pid": 42,
        "epoch": 7,
        "dead_after_ms": 3000,
    }
    fields.update(kw)
    return encode_control(MessageKind.HELLO, Hello(**fields))


def result(call_id: int, value: Any, kind: MessageKind = MessageKind.RESULT) -> list[Any]:
    encoded = _codec.encode(value)
    return [pack_reply_header(kind, call_id), encoded.payload, *encoded.buffers]


def error(call_id: int, code: int = 1, message: str = "boom") -> list[bytes]:
    return encode_error(call_id, ErrorInfo(code, "ValueError", message, ""))


def end(call_id: int) -> list[bytes]:
    return encode_control(MessageKind.STREAM_END, None, call_id)


def control(kind: MessageKind, body: Any = None, call_id: int = 0) -> list[bytes]:
    return encode_control(kind, body, call_id)


def bye() -> list[bytes]:
    return control(MessageKind.BYE, Bye("shutdown"))


def reject(reason: str = "fingerprint") -> list[bytes]:
    return control(MessageKind.REJECT, Reject(reason, "no"))


@dataclass
class Sent:
    """One control message the protocol queued."""

    peer: bytes
    kind: MessageKind
    call_id: int
    body: Any


def sent(protocol: ClientProtocol) -> list[Sent]:
    """Drain and decode what the protocol queued."""
    out = []
    for peer, frames in protocol.frames_to_send():
        if memoryview(frames[0])[3] == MessageKind.CALL:  # (its payload may be empty here)
            out.append(Sent(peer, MessageKind.CALL, 0, None))
            continue
        header, payload, _ = split_frames(frames)
        body = None
        if header.kind in (
            MessageKind.WELCOME,
            MessageKind.REJECT,
            MessageKind.BYE,
            MessageKind.CREDIT,
            MessageKind.RELEASE,
        ):
            body = decode_control(header, payload)
        out.append(Sent(peer, header.kind, header.call_id, body))
    return out


def kinds(protocol: ClientProtocol) -> list[MessageKind]:
    return [s.kind for s in sent(protocol)]


def join(
    protocol: ClientProtocol,
    engine_id: str = "e1",
    peer: bytes | None = None,
    now: float = 0.0,
    **kw: Any,
) -> Engine:
    """Admit an engine and drain the WELCOME."""
    peer = peer if peer is not None else f"{engine_id}/x".encode()
    protocol.receive(peer, hello(engine_id, **kw), now)
    assert type(protocol.next_events()[-1]).__name__ == "EngineJoined"
    out = sent(protocol)
    assert [s.kind for s in out] == [MessageKind.WELCOME], out
    return protocol.engines.engines[engine_id]


def start(
    protocol: ClientProtocol, engine: Engine, *, stream: bool = False, now: float = 0.0
) -> Call:
    spec = COUNT if stream else ADD
    call = protocol.start_call(engine, spec, object(), stream=stream, now=now, payload=b"\x90")
    [(peer, frames)] = protocol.frames_to_send()  # the CALL (the scripted engine reads none)
    assert (peer, split_frames(frames)[0].kind) == (engine.peer, MessageKind.CALL)
    return call


def feed(
    protocol: ClientProtocol, peer: bytes, frames: list[Any], now: float, *a: Any, **kw: Any
) -> Any:
    """``receive`` one message; what `next_events` then gives: None, its one event (a
    `Call` a reply concerned, among them), or the list of several."""
    protocol.receive(peer, frames, now, *a, **kw)
    events = protocol.next_events()
    return events[0] if len(events) == 1 else (events or None)


def tick(protocol: ClientProtocol, now: float) -> list[Any]:
    """``tick``; the events it made (sessions it ended)."""
    protocol.tick(now)
    return protocol.next_events()
