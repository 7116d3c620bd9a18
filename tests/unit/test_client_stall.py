"""A client whose loop stalls past an engine's bound (issue 9 item 9): no fake clock needed.

A careless caller that starts 100,000 calls at once holds the event loop for seconds
before the first of them runs: the engine forgets the session. The calls not yet sent
must not be sent to an engine that forgot us, nor fail because its session ended: they
wait for it to rejoin (bounded by our ``dead_after``).
"""

from __future__ import annotations

import pytest

from tensorrpc._client_events import EngineJoined, EngineLost
from tensorrpc._client_protocol import HELLO_REQUEST
from tensorrpc._exceptions import EngineDeadError, EngineNotFoundError
from tensorrpc._protocol import MessageKind

from .client_script import feed, hello, join, kinds, make_protocol, sent, start

K = MessageKind


def test_a_new_call_after_a_stall_is_not_sent_to_the_engine_that_forgot_us() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", dead_after_ms=2000)
    # the loop stalls 10 s before the first of many calls runs
    assert protocol.select(None, 10.0) is None  # not the engine: it forgot the session
    [lost] = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert lost.engine is engine
    assert lost.calls == ()
    assert not protocol.engines.engines
    # it has our dead_after (5 s) to come back, counted from the next timer run: the loop
    # that found the loss may be busy for a while yet (with the calls that stalled it)
    assert protocol.rejoining.until == {"e1": None}
    assert protocol.next_tick(10.0) == pytest.approx(0.0005)
    assert protocol.expire_rejoins(19.0) == []
    assert protocol.rejoining.until == {"e1": 24.0}
    assert kinds(protocol) == []  # no CALL, and nothing else, to the engine


def test_callers_wait_through_the_rejoin_instead_of_failing() -> None:
    protocol = make_protocol()
    join(protocol, "e1", b"p", dead_after_ms=2000)
    assert protocol.select(None, 10.0) is None
    protocol.next_events()
    protocol.capacity.add(None, "first")
    protocol.capacity.add("e1", "targeted")
    # the loss strands nobody: the engine is expected back
    assert protocol.stranded("e1", 10.0) == []
    # new callers (balanced or targeted) wait too, rather than EngineNotFoundError
    assert protocol.select(None, 10.1) is None
    assert protocol.select("e1", 10.1, woken=True) is None
    assert protocol.next_tick(10.1) <= 5.0
    event = feed(protocol, b"p", hello("e1", epoch=8, dead_after_ms=2000), 11.0)
    assert isinstance(event, EngineJoined)
    assert protocol.rejoining.until == {}
    assert protocol.capacity.joined("e1", 8) == ["targeted", "first"]
    assert protocol.select(None, 11.1, woken=True) is event.engine
    assert protocol.expire_rejoins(100.0) == []


def test_a_dialled_engine_that_forgot_us_is_asked_for_hello_at_once() -> None:
    protocol = make_protocol()
    protocol.dial(b"@a/0", "ipc://x", 0.0)
    sent(protocol)
    feed(protocol, b"@a/0", hello("e1", dead_after_ms=2000), 0.0)
    sent(protocol)
    assert protocol.select(None, 10.0) is None
    assert protocol.next_tick(10.0) == pytest.approx(0.0005)
    protocol.tick(10.0)
    assert [(s.kind, s.call_id) for s in sent(protocol)] == [(K.PING, HELLO_REQUEST)]


def test_waiters_fail_when_the_engine_does_not_rejoin_in_time() -> None:
    protocol = make_protocol()
    join(protocol, "e1", b"p", dead_after_ms=2000)
    assert protocol.select("e1", 10.0) is None
    protocol.next_events()
    protocol.capacity.add(None, "any")
    protocol.capacity.add("e1", "targeted")
    assert protocol.expire_rejoins(10.0) == []  # the wait starts: until 15.0
    assert protocol.expire_rejoins(14.9) == []
    assert sorted(protocol.expire_rejoins(15.0)) == ["any", "targeted"]
    assert protocol.rejoining.until == {}
    with pytest.raises(EngineNotFoundError):
        protocol.select(None, 15.0, woken=True)
    with pytest.raises(EngineNotFoundError):
        protocol.select("e1", 15.0, woken=True)


def test_calls_in_flight_at_the_stall_still_fail_at_once() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", dead_after_ms=2000)
    call = start(protocol, engine, now=0.0)
    assert protocol.select(None, 10.0) is None
    [lost] = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert lost.calls == (call,)
    assert isinstance(call.error, EngineDeadError)


def test_another_engine_takes_the_call_when_only_one_forgot_us() -> None:
    protocol = make_protocol()
    join(protocol, "slow", b"s", dead_after_ms=2000)
    fast = join(protocol, "fast", b"f", dead_after_ms=60_000)
    chosen = protocol.select(None, 10.0)
    assert chosen is fast  # the balancer tried "slow" (joined first): it is out
    assert "slow" not in protocol.engines.engines
    assert protocol.stranded("slow", 10.0) == []
