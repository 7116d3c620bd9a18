"""What a test does with a `tests.helpers.ProtocolPair` as the shells' users would: an
engine's worker takes calls and answers them (encoding the value, asking the machine,
as the dispatcher does), a caller cancels, takes stream items and reads its outcome.
Each step drains the machine it fed (the pair's ``_collect``), as a shell does."""

from __future__ import annotations

from typing import Any

from tensorrpc import _codec
from tensorrpc._calls import Call
from tensorrpc._client_protocol import EngineLost, reply_error
from tensorrpc._dispatch import type_name
from tensorrpc._exceptions import ErrorCode
from tensorrpc._protocol import Flags, MessageKind
from tensorrpc._server_protocol import ServerCall

from .helpers import SPEC, EngineEnd, ProtocolPair


def next_call(end: EngineEnd) -> ServerCall | None:
    """A worker takes the next queued call (None: none)."""
    if (call := end.proto.next_call()) is not None:
        end.running.append(call)
    return call


def take_all(end: EngineEnd) -> list[ServerCall]:
    return list(iter(lambda: next_call(end), None))


def done(end: EngineEnd, call: ServerCall) -> None:
    """The worker is done with ``call``."""
    end.running.remove(call)
    end.proto.done(call, end.pair.now)


_done = done


def _answered(end: EngineEnd, queued: bool, call: ServerCall, finished: bool) -> bool:
    end.pair._collect(end)
    if finished:
        _done(end, call)
    return queued


def _encoded(call: ServerCall, value: object) -> tuple[Any, Any]:
    encoded = _codec.encode(call.spec.check_result(value))
    return encoded.payload, encoded.buffers


def reply(end: EngineEnd, call: ServerCall, value: object, *, done: bool = True) -> bool:
    """RESULT ``value``; False: the call may get no reply."""
    return _answered(end, end.proto.result(call, *_encoded(call, value)), call, done)


def item(end: EngineEnd, call: ServerCall, value: object) -> bool:
    """STREAM_ITEM ``value``; False: no credit, or the stream ended."""
    return _answered(end, end.proto.stream_item(call, *_encoded(call, value)), call, False)


def end_stream(end: EngineEnd, call: ServerCall, *, done: bool = True) -> bool:
    return _answered(end, end.proto.stream_end(call), call, done)


def error(
    end: EngineEnd, call: ServerCall, code: ErrorCode, message: str = "", *, done: bool = True
) -> bool:
    queued = end.proto.error_reply(call, code, message or code.name)
    return _answered(end, queued, call, done)


def raised(end: EngineEnd, call: ServerCall, exc: BaseException, *, done: bool = True) -> bool:
    queued = end.proto.error_reply(call, ErrorCode.REMOTE, str(exc), type_name(exc))
    return _answered(end, queued, call, done)


def kinds(end: EngineEnd) -> list[MessageKind]:
    """Kinds of what the engine sent since the last look (forgotten)."""
    sent, end.sent = end.sent, []
    return [m.kind for m in sent]


def cancel(pair: ProtocolPair, call: Call) -> bool:
    ended = pair.client.cancel(call, pair.now)
    pair._collect_client()
    return ended


def outcome(call: Call) -> Any:
    """A RESULT's value, else raise what the caller sees."""
    assert call.ended, f"{call!r} has not ended"
    if call.error is not None:
        raise call.error
    if call.reply_kind is not MessageKind.RESULT:
        raise reply_error(call.reply_payload)
    return call.spec.decode_result(_codec.decode(call.reply_payload, call.reply_buffers))


def take_item(pair: ProtocolPair, call: Call) -> Any:
    payload, buffers = pair.client.take_item(call, pair.now)
    pair._collect_client()
    return call.spec.decode_result(_codec.decode(payload, buffers))


def items(pair: ProtocolPair, call: Call) -> list[Any]:
    return [take_item(pair, call) for _ in range(len(call.items or ()))]


def lost(pair: ProtocolPair) -> list[EngineLost]:
    return [e for e in pair.events if isinstance(e, EngineLost)]


def client_kinds(pair: ProtocolPair, name: str | None = None) -> list[MessageKind]:
    """Kinds the client sent (to ``name``) since the last look (forgotten)."""
    taken = [w for w in pair.client_sent if name in (None, w.end)]
    pair.client_sent = [w for w in pair.client_sent if name not in (None, w.end)]
    return [w.kind for w in taken]


def connect(pair: ProtocolPair) -> None:
    """Deliver until every engine that is up is welcomed."""
    for _ in range(4):
        pair.flush()
        if all(n in pair.client.engines.engines for n, e in pair.engines.items() if e.up):
            return
        pair.advance(pair.engine_heartbeat.interval)
    raise AssertionError(f"handshake did not complete: {pair.events}")


def call(
    pair: ProtocolPair, method: str = "add", *args: Any, engine: str | None = None,
    timeout_ms: int = 0, no_wait: bool = False, lease: int | None = None,
    metadata: bytes = b"", **kwargs: Any,
) -> Call:  # fmt: skip
    """Start a call as `tensorrpc.Client` does (its CALL goes on the wire)."""
    spec = SPEC.methods[method]
    target = pair.client.select(engine)
    assert target is not None, f"no engine can take a call now ({engine!r})"
    encoded = _codec.encode(spec.encode_args(args, kwargs))
    flags = (int(Flags.STREAM) if spec.streaming else 0) | (int(Flags.NO_WAIT) * no_wait)
    started = pair.client.start_call(
        target, spec, None, stream=spec.streaming, now=pair.now, payload=encoded.payload,
        buffers=encoded.buffers, flags=flags, timeout_ms=timeout_ms, lease=lease,
        metadata=metadata,
    )  # fmt: skip
    pair._collect_client()
    return started
