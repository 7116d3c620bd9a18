"""Rule 4 of the bulk connection in the client machine: a draining engine says BYE on
both connections of a session, and the session ends once both came, so a RESULT still on
the bulk connection behind the control BYE is delivered, not failed as an engine death
(docs/design.md, "a bulk connection per peer"). Sans-I/O: the shell says which
connection a message came on (``receive(..., bulk=True)``) and when the bulk connection
is bound or lost."""

from __future__ import annotations

import pytest

from tensorrpc._calls import CallState
from tensorrpc._client_events import EngineLost, Ignored
from tensorrpc._engines import Engine
from tensorrpc._exceptions import EngineDeadError
from tensorrpc._protocol import MessageKind

from .client_script import bye, control, error, feed, join, make_protocol, result, sent, start, tick

PEER = b"p"


def bound_session(protocol: object, *, ours: bool = False) -> Engine:
    engine = join(protocol, "e1", PEER, epoch=7, dead_after_ms=3_600_000)  # type: ignore[arg-type]
    epoch = engine.client_epoch if ours else engine.epoch
    protocol.bulk_bound(PEER, epoch, ours=ours)  # type: ignore[attr-defined]
    assert engine.bulk_bound
    return engine


@pytest.mark.parametrize("ours", [False, True])
def test_a_result_on_the_bulk_connection_behind_the_control_bye_arrives(ours: bool) -> None:
    protocol = make_protocol()
    engine = bound_session(protocol, ours=ours)
    call = start(protocol, engine)
    assert feed(protocol, PEER, bye(), 0.1) is None  # the first BYE: the session goes on
    assert "e1" in protocol.engines.engines
    got = feed(protocol, PEER, result(call.call_id, 3), 0.2, bulk=True)
    assert got is call
    assert call.state is CallState.REPLIED
    lost = feed(protocol, PEER, bye(), 0.3, bulk=True)
    assert isinstance(lost, EngineLost)
    assert lost.calls == ()
    assert "said BYE" in lost.why
    assert "e1" not in protocol.engines.engines


def test_the_bulk_bye_may_come_first() -> None:
    protocol = make_protocol()
    engine = bound_session(protocol)
    call = start(protocol, engine)
    assert feed(protocol, PEER, bye(), 0.1, bulk=True) is None
    assert feed(protocol, PEER, result(call.call_id, 3), 0.2) is call  # a small one
    lost = feed(protocol, PEER, bye(), 0.3)
    assert isinstance(lost, EngineLost)
    assert "e1" not in protocol.engines.engines


def test_without_a_bound_bulk_connection_one_bye_ends_the_session() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", PEER, epoch=7)
    protocol.bulk_bound(PEER, 6)  # an older session's connection binds nothing
    assert not engine.bulk_bound
    call = start(protocol, engine)
    lost = feed(protocol, PEER, bye(), 0.1)
    assert isinstance(lost, EngineLost)
    assert lost.calls == (call,)
    assert isinstance(call.error, EngineDeadError)


def test_a_leaving_engine_takes_no_new_calls() -> None:
    protocol = make_protocol()
    engine = bound_session(protocol)
    other = join(protocol, "e2", b"q")
    feed(protocol, PEER, bye(), 0.1)
    picked = {protocol.select(None, 0.2).engine_id for _ in range(4)}  # type: ignore[union-attr]
    assert picked == {"e2"}
    feed(protocol, b"q", bye(), 0.2)  # e2 leaves (no bulk connection): gone at once
    assert "e2" not in protocol.engines.engines
    assert protocol.select(None, 0.3) is None  # only a leaving engine: wait
    assert engine.byes
    assert not other.alive


def test_the_bulk_connection_lost_after_the_control_bye_is_the_other_bye() -> None:
    protocol = make_protocol()
    engine = bound_session(protocol)
    call = start(protocol, engine)
    feed(protocol, PEER, bye(), 0.1)
    protocol.bulk_lost(PEER, engine.epoch, 0.2)
    [lost] = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert "said BYE" in lost.why
    assert lost.calls == (call,)
    assert sent(protocol) == []  # nothing asks a leaving engine for a new session


def test_a_leaving_engine_whose_bulk_bye_never_comes_ends_at_dead_after() -> None:
    protocol = make_protocol()  # heartbeat 1 s, dead_after 5 s
    bound_session(protocol)
    feed(protocol, PEER, bye(), 0.1)
    [lost] = tick(protocol, 5.2)
    assert "said BYE and then sent nothing" in lost.why


def test_only_a_result_or_a_bye_may_come_on_the_bulk_connection() -> None:
    protocol = make_protocol()
    engine = bound_session(protocol)
    call = start(protocol, engine)
    for frames in (
        control(MessageKind.PING, None, 5),
        control(MessageKind.STREAM_END, None, call.call_id),
        error(call.call_id),
        result(call.call_id, 3, MessageKind.STREAM_ITEM),
    ):
        assert isinstance(feed(protocol, PEER, frames, 0.1, bulk=True), Ignored)
    assert call.state is CallState.IN_FLIGHT
    assert sent(protocol) == []  # not even a PONG
    assert feed(protocol, b"stranger", bye(), 0.1, bulk=True) is None


def test_a_lost_bulk_connection_to_us_ends_the_session_and_asks_for_a_new_one() -> None:
    # The engine dialed our bulk endpoint (dial-in): the client tells it BYE (it ends its
    # side of the session) and asks for a HELLO, so a new session starts at once.
    protocol = make_protocol()
    engine = bound_session(protocol, ours=True)
    call = start(protocol, engine)
    sent(protocol)
    protocol.bulk_lost(PEER, engine.epoch, 0.2, ours=True)  # not ours: nothing
    assert not protocol.pending
    protocol.bulk_lost(PEER, engine.client_epoch, 0.2, ours=True)
    [lost] = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert lost.calls == (call,)
    assert "lost its bulk connection" in str(call.error)
    out = sent(protocol)
    assert [(s.peer, s.kind, s.call_id) for s in out] == [
        (PEER, MessageKind.BYE, 0),
        (PEER, MessageKind.PING, 0),
    ]


def test_a_failed_send_before_the_control_bye_is_read_waits_for_the_bulk_connection() -> None:
    """Seen in CI: the draining engine said BYE on control and closed it; a heartbeat to
    it failed before the client had read that BYE. With a bulk connection bound, the
    failed send stops new calls and PINGs but the session waits for the bulk
    connection's BYE (the RESULT behind it arrives) or its loss."""
    protocol = make_protocol()
    engine = bound_session(protocol)
    call = start(protocol, engine)
    protocol.send_failed(PEER, 0.1)
    assert "e1" in protocol.engines.engines
    assert protocol.select(None, 0.1) is None  # no new calls to it
    assert feed(protocol, PEER, result(call.call_id, 3), 0.2, bulk=True) is call
    assert call.state is CallState.REPLIED
    lost = feed(protocol, PEER, bye(), 0.3, bulk=True)  # the control BYE was never read
    assert isinstance(lost, EngineLost)
    assert "said BYE" in lost.why


def test_a_failed_send_then_the_bulk_connection_lost_is_an_engine_death() -> None:
    protocol = make_protocol()
    engine = bound_session(protocol)
    call = start(protocol, engine)
    protocol.send_failed(PEER, 0.1)
    protocol.bulk_lost(PEER, engine.epoch, 0.2)
    lost = [e for e in protocol.next_events() if isinstance(e, EngineLost)]
    assert len(lost) == 1
    assert lost[0].calls == (call,)
    assert "said BYE" not in lost[0].why
    assert isinstance(call.error, EngineDeadError)


def test_a_failed_control_send_after_the_bulk_bye_ends_the_session_as_a_bye() -> None:
    """The bulk BYE came first and then control closed (its BYE unread): the session
    ends at once, as having said BYE, not at dead_after or as a lost connection."""
    protocol = make_protocol()
    engine = bound_session(protocol)
    assert feed(protocol, PEER, bye(), 0.1, bulk=True) is None
    protocol.send_failed(PEER, 0.2)
    [lost] = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert "said BYE" in lost.why
    assert "e1" not in protocol.engines.engines
    assert engine.byes


def test_the_bulk_connection_closing_after_its_bye_waits_for_the_control_bye() -> None:
    """Seen in CI: a draining engine's RESULT and BYE on control, then BYE on bulk, then
    both connections closed; the bulk connection's end was handled before control's
    messages and failed the call. After the bulk BYE that end is expected."""
    protocol = make_protocol()
    engine = bound_session(protocol)
    call = start(protocol, engine)
    assert feed(protocol, PEER, bye(), 0.1, bulk=True) is None
    protocol.bulk_lost(PEER, engine.epoch, 0.2)
    assert protocol.next_events() == []
    assert feed(protocol, PEER, result(call.call_id, 3), 0.3) is call
    assert call.state is CallState.REPLIED
    lost = feed(protocol, PEER, bye(), 0.4)
    assert isinstance(lost, EngineLost)
    assert "said BYE" in lost.why
