"""What the users of a `tests.helpers.ProtocolPair`'s machines do, as the shells let them:
a caller starts, cancels and reads calls; an engine's worker takes calls and answers them
(encoding the value and asking the machine, as the dispatcher does). Each drains the
machines after its input, as a shell does."""

from __future__ import annotations

from typing import Any

from tensorrpc import _codec
from tensorrpc._calls import Call
from tensorrpc._client_protocol import reply_error
from tensorrpc._exceptions import ErrorCode
from tensorrpc._protocol import Flags, MessageKind
from tensorrpc._server_protocol import ServerCall

from .helpers import EngineEnd, ProtocolPair
from .unit.server_helpers import SPEC


def call(
    pair: ProtocolPair, method: str = "add", *args: Any, engine: str | None = None,
    no_wait: bool = False, **options: Any,
) -> Call:  # fmt: skip
    """Start a call as `tensorrpc.Client` does (``options``: `ClientProtocol.start_call`'s)."""
    spec, target = SPEC.methods[method], pair.client.select(engine)
    assert target is not None, f"no engine can take a call now ({engine!r})"
    encoded = _codec.encode(spec.encode_args(args, {}))
    flags = (Flags.STREAM if spec.streaming else 0) | (Flags.NO_WAIT if no_wait else 0)
    started = pair.client.start_call(
        target, spec, None, stream=spec.streaming, now=pair.now, payload=encoded.payload,
        buffers=encoded.buffers, flags=int(flags), **options,
    )  # fmt: skip
    pair.collect()
    return started


def cancel(pair: ProtocolPair, call: Call) -> bool:
    ended = pair.client.cancel(call, pair.now)
    pair.collect()
    return ended


def outcome(call: Call) -> Any:
    """A RESULT's value, else raise what the caller sees."""
    assert call.ended, f"{call!r} has not ended"
    if call.error is not None:
        raise call.error
    if call.reply_kind is not MessageKind.RESULT:
        raise reply_error(call.reply_payload)
    return call.spec.decode_result(_codec.decode(call.reply_payload, call.reply_buffers))


def items(pair: ProtocolPair, call: Call, n: int | None = None) -> list[Any]:
    """Take ``n`` stream items (default: all that came)."""
    out = []
    for _ in range(len(call.items or ()) if n is None else n):
        payload, buffers = pair.client.take_item(call, pair.now)
        pair.collect()
        out.append(call.spec.decode_result(_codec.decode(payload, buffers)))
    return out


def take_all(end: EngineEnd) -> list[ServerCall]:
    """Workers take every queued call."""
    return list(iter(end.proto.next_call, None))


def _did(end: EngineEnd, queued: bool, call: ServerCall, done: bool) -> bool:
    if done:  # the worker is done with the call
        end.proto.done(call, end.pair.now)
    end.pair.collect()
    return queued


def reply(end: EngineEnd, call: ServerCall, value: object, *, done: bool = True) -> bool:
    """The handler returned ``value``; False: the call may get no reply."""
    encoded = _codec.encode(call.spec.check_result(value))
    return _did(end, end.proto.result(call, encoded.payload, encoded.buffers), call, done)


def item(end: EngineEnd, call: ServerCall, value: object) -> bool:
    """The stream yields ``value``; False: no credit, or the stream ended."""
    encoded = _codec.encode(call.spec.check_result(value))
    return _did(end, end.proto.stream_item(call, encoded.payload, encoded.buffers), call, False)


def end_stream(end: EngineEnd, call: ServerCall, *, done: bool = True) -> bool:
    return _did(end, end.proto.stream_end(call), call, done)


def error(
    end: EngineEnd, call: ServerCall, code: ErrorCode, message: str = "", remote_type: str = "",
    *, done: bool = True,
) -> bool:  # fmt: skip
    """An ERROR (``remote_type``: the type name of the exception a handler raised)."""
    queued = end.proto.error_reply(call, code, message or code.name, remote_type)
    return _did(end, queued, call, done)
