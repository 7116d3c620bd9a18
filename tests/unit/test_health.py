"""The built-in health method, answered by the engine's protocol machine (no sockets)."""

from __future__ import annotations

import ormsgpack
import pytest

from tensorrpc._exceptions import ErrorCode
from tensorrpc._health import (
    HEALTH_METHOD,
    MAX_REQUEST_BYTES,
    HealthStatus,
    decode_answer,
    encode_answer,
    parse_request,
)
from tensorrpc._protocol import (
    ErrorInfo,
    Flags,
    MessageKind,
    decode_control,
    pack_call_header,
    split_frames,
)

from .server_helpers import SPEC, Engine


def ask(engine: Engine, call_id: int, args: object = (), *, flags: int = 0) -> object:
    """Send a health CALL; the decoded RESULT map, or the ErrorInfo it got."""
    payload = ormsgpack.packb(list(args) if isinstance(args, tuple) else args)
    header = pack_call_header(call_id, HEALTH_METHOD, flags, 0)
    engine.proto.receive(b"c1", [header, payload], engine.now)
    sent = list(engine.proto.frames_to_send())
    assert len(sent) == 1
    header_out, body, buffers = split_frames(sent[0][1])
    assert header_out.call_id == call_id
    assert not buffers
    if header_out.kind is MessageKind.ERROR:
        info = decode_control(header_out, body)
        assert isinstance(info, ErrorInfo)
        return info
    assert header_out.kind is MessageKind.RESULT
    return ormsgpack.unpackb(bytes(body))


def test_an_engine_answers_serving_for_itself_and_its_service() -> None:
    engine = Engine.make()
    engine.join()
    assert ask(engine, 1) == {"status": "SERVING", "service": ""}
    assert ask(engine, 2, (SPEC.name,)) == {"status": "SERVING", "service": SPEC.name}
    assert ask(engine, 3, {"service": ""}) == {"status": "SERVING", "service": ""}
    assert ask(engine, 4, {}) == {"status": "SERVING", "service": ""}
    assert ask(engine, 5, ("Other",)) == {"status": "SERVICE_UNKNOWN", "service": "Other"}


def test_health_takes_no_worker_and_is_answered_when_the_engine_is_full() -> None:
    engine = Engine.make(max_concurrency=1, max_queued=0)
    engine.join()
    assert engine.call(b"c1", 1) is not None  # the only slot
    engine.call(b"c1", 2)
    assert engine.error(2).code == ErrorCode.OVERLOADED
    assert ask(engine, 3) == {"status": "SERVING", "service": ""}
    assert len(engine.proto.queue) == 1  # the health call queued nothing
    assert engine.proto.sessions[b"c1"].calls.keys() == {1}


def test_draining_answers_not_serving_while_calls_are_refused() -> None:
    engine = Engine.make()
    engine.join()
    engine.proto.start_drain()
    engine.call(b"c1", 1)
    assert engine.error(1).code == ErrorCode.DRAINING
    assert ask(engine, 2) == {"status": "NOT_SERVING", "service": ""}
    assert ask(engine, 3, (SPEC.name,)) == {"status": "NOT_SERVING", "service": SPEC.name}
    assert engine.proto.health() is HealthStatus.NOT_SERVING


def test_the_application_sets_not_serving_and_back() -> None:
    engine = Engine.make()
    engine.join()
    engine.proto.set_health(HealthStatus.NOT_SERVING)
    assert ask(engine, 1) == {"status": "NOT_SERVING", "service": ""}
    assert ask(engine, 2, ("Other",))["status"] == "SERVICE_UNKNOWN"  # type: ignore[index]
    assert engine.call(b"c1", 3) is not None  # calls are still taken: routing is the prober's
    engine.proto.set_health(HealthStatus.SERVING)
    assert ask(engine, 4) == {"status": "SERVING", "service": ""}
    for status in (HealthStatus.UNKNOWN, HealthStatus.SERVICE_UNKNOWN):
        with pytest.raises(ValueError, match="SERVING or NOT_SERVING"):
            engine.proto.set_health(status)


@pytest.mark.parametrize(
    ("args", "fault"),
    [
        (("a", "b"), "one argument"),
        ({"service": "x", "other": 1}, "one argument"),
        ((7,), "must be a str"),
        (("x" * 1025,), "must be a str"),
        (5, "array or a map"),
    ],
)
def test_bad_arguments_are_invalid_argument(args: object, fault: str) -> None:
    engine = Engine.make()
    engine.join()
    info = ask(engine, 1, args)
    assert isinstance(info, ErrorInfo)
    assert info.code == ErrorCode.INVALID_ARGUMENT
    assert fault in info.message


def test_a_streaming_health_call_or_one_with_tensors_is_refused() -> None:
    engine = Engine.make()
    engine.join()
    info = ask(engine, 1, flags=int(Flags.STREAM))
    assert isinstance(info, ErrorInfo)
    assert info.code == ErrorCode.INVALID_ARGUMENT
    header = pack_call_header(2, HEALTH_METHOD, 0, 0)
    engine.send(b"c1", [header, b"\x90", b"tensor bytes"])
    assert engine.error(2).code == ErrorCode.INVALID_ARGUMENT


def test_health_needs_a_session() -> None:
    engine = Engine.make()
    engine.send(b"x", [pack_call_header(1, HEALTH_METHOD, 0, 0), b"\x90"])
    assert engine.error(1).code == ErrorCode.PROTOCOL


def test_parse_request_bounds_and_garbage() -> None:
    assert parse_request(b"\x90") == ""
    assert parse_request(ormsgpack.packb(["svc"])) == "svc"
    with pytest.raises(ValueError, match="at most"):
        parse_request(b"\x91" + ormsgpack.packb("x" * MAX_REQUEST_BYTES))
    with pytest.raises(ValueError, match="msgpack"):
        parse_request(b"\xc1")


def test_answers_round_trip_and_unknown_statuses_are_refused() -> None:
    for status in (HealthStatus.SERVING, HealthStatus.NOT_SERVING, HealthStatus.SERVICE_UNKNOWN):
        assert decode_answer(ormsgpack.unpackb(encode_answer("s", status))) is status
    with pytest.raises(ValueError, match="does not send"):
        encode_answer("", HealthStatus.UNKNOWN)
    for bad in ({"status": "UNKNOWN"}, {"status": 1}, ["SERVING"], None):
        with pytest.raises(ValueError, match="known status"):
            decode_answer(bad)
