"""The largest frame a CALL may carry, as the client machine admits an engine and the
shell checks a call's arguments against it (the small call's path skips the full check)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tensorrpc import _codec
from tensorrpc._client_calls import _check_sizes
from tensorrpc._client_events import EngineJoined
from tensorrpc._exceptions import EncodeError

from .client_script import ADD, feed, hello, make_protocol


@pytest.mark.parametrize(
    ("ours", "theirs", "limit"),
    [(0, 0, 0), (4096, 0, 4096), (0, 1000, 1000), (4096, 1000, 1000), (1000, 4096, 1000)],
)
def test_admission_takes_the_smaller_positive_limit(ours: int, theirs: int, limit: int) -> None:
    protocol = make_protocol(max_message_bytes=ours)
    event = feed(protocol, b"e1/x", hello("e1", max_message_bytes=theirs), 0.0)
    assert isinstance(event, EngineJoined)
    assert event.engine.frame_limit == limit


def _engine(ours: int, theirs: int) -> Any:
    protocol = make_protocol(max_message_bytes=ours)
    event = feed(protocol, b"e1/x", hello("e1", max_message_bytes=theirs), 0.0)
    assert isinstance(event, EngineJoined)
    return event.engine


def test_a_payload_over_the_engine_s_limit_is_refused_without_tensor_frames() -> None:
    engine = _engine(0, 1000)
    io: Any = SimpleNamespace(maxmsgsize=-1)
    big = _codec.encode([b"x" * 2000])
    assert not big.buffers
    assert len(big.payload) > 1000
    with pytest.raises(EncodeError, match=r"engine 'e1' takes at most its maxmsgsize=1000\)"):
        _check_sizes(io, ADD, big, engine)
    _check_sizes(io, ADD, _codec.encode([b"x" * 100]), engine)  # within it


def test_our_own_limit_refuses_a_payload_too() -> None:
    engine = _engine(1000, 0)
    io: Any = SimpleNamespace(maxmsgsize=1000)
    with pytest.raises(EncodeError, match=r"socket_options.maxmsgsize=1000\)"):
        _check_sizes(io, ADD, _codec.encode([b"x" * 2000]), engine)


def test_no_limit_on_either_end_takes_any_payload() -> None:
    engine = _engine(0, 0)
    io: Any = SimpleNamespace(maxmsgsize=-1)
    _check_sizes(io, ADD, _codec.encode([b"x" * 5000]), engine)


def test_an_engine_of_unknown_limit_gets_the_full_check() -> None:
    engine = _engine(0, 1000)
    engine.frame_limit = -1
    io: Any = SimpleNamespace(maxmsgsize=-1)
    with pytest.raises(EncodeError, match="maxmsgsize=1000"):
        _check_sizes(io, ADD, _codec.encode([b"x" * 2000]), engine)
