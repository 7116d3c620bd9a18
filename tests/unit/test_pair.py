"""Client and engine protocol machines talking to each other in memory (`ProtocolPair`).

Behaviour tests of the whole protocol without sockets, sleeps or threads: what one
machine sends is what the other receives, the clock is a number. Each test names the
behaviour; over real sockets only what needs I/O is tested again (tests/integration).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tensorrpc._calls import CallState
from tensorrpc._client_events import EngineJoined, EngineLost, EngineRefused, Heartbeat, Pong
from tensorrpc._exceptions import (
    CallTimeoutError,
    DrainingError,
    EngineDeadError,
    ErrorCode,
    MethodNotFoundError,
    OverloadedError,
    RemoteError,
    RemoteProtocolError,
)
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Bye,
    Credit,
    Flags,
    MessageKind,
    Reject,
    Welcome,
    encode_control,
    pack_call_header,
)
from tensorrpc._server_protocol import AllRejected, Session, SessionEnded, SessionState

from .. import pair_work as work
from ..helpers import EngineEnd, ProtocolPair, Wire
from .server_helpers import SPEC

K = MessageKind
TOPOLOGIES = [pytest.param(False, id="client-dials"), pytest.param(True, id="engines-dial-in")]


def session_of(end: EngineEnd) -> Session:
    session = end.session
    assert isinstance(session, Session)
    return session


def state_of(end: EngineEnd) -> SessionState:
    return session_of(end).state


def connected(*engines: str, **kw: Any) -> ProtocolPair:
    return ProtocolPair(engines or ("e1",), **kw).connect()


def kinds(end: EngineEnd) -> list[MessageKind]:
    """Kinds of what the engine sent since the last look (forgotten)."""
    sent, end.sent = end.sent, []
    return [m.kind for m in sent]


def client_kinds(pair: ProtocolPair) -> list[MessageKind]:
    """Kinds the client sent since the last look (forgotten)."""
    sent, pair.client_sent = pair.client_sent, []
    return [m.kind for m in sent]


def engines_lost(pair: ProtocolPair) -> list[EngineLost]:
    return [e for e in pair.events if isinstance(e, EngineLost)]


# -- handshake and refusals ----------------------------------------------------------------


@pytest.mark.parametrize("dial_in", TOPOLOGIES)
def test_handshake_names_both_sessions_and_announces_both_bounds(dial_in: bool) -> None:
    pair = ProtocolPair(
        ("e1", "e2"),
        dial_in=dial_in,
        heartbeat_interval=0.5,
        dead_after=3.0,
        engine={"heartbeat_interval": 1.0, "dead_after": 7.0},
        stream_window=6,
    )
    pair.connect()
    assert [type(e) for e in pair.events] == [EngineJoined, EngineJoined]
    for engine_id in ("e1", "e2"):
        engine = pair.client.engines.engines[engine_id]
        session = pair[engine_id].session
        assert session.state is SessionState.LIVE
        # Each side knows the other's session epoch and bound.
        assert engine.epoch == session.epoch != 0
        assert session.client_epoch == engine.client_epoch != 0
        assert engine.info.dead_after_ms == 7000
        assert session.peer_dead_after_ms == 3000
        assert session.client_id == "pair-client"
        assert session.stream_window == 6
        assert engine.info.methods == tuple(SPEC.methods)
        assert engine.info.address == (None if dial_in else f"tcp://{engine_id}:7000")


@pytest.mark.parametrize("dial_in", TOPOLOGIES)
@pytest.mark.parametrize(
    ("lie", "reason"),
    [
        ({"fingerprint": "0" * 16}, "fingerprint"),
        ({"protocol_version": PROTOCOL_VERSION + 1}, "version"),
        ({"service": "Other"}, "service"),
    ],
)
def test_a_refused_hello_gets_a_reject_and_the_engine_stops(
    dial_in: bool, lie: dict[str, Any], reason: str
) -> None:
    pair = ProtocolPair(("e1",), dial_in=dial_in)
    pair.deliver_to_engine("e1")  # listening: the client's hello request
    hello = pair.to_client.pop()  # the engine's HELLO: it lies
    lying = encode_control(K.HELLO, dataclasses.replace(hello.body, **lie))
    pair.to_client.append(dataclasses.replace(hello, frames=lying))
    pair.flush()
    refused = [e for e in pair.events if isinstance(e, EngineRefused)]
    assert [(e.engine_id, e.reason, e.by_client) for e in refused] == [("e1", reason, True)]
    assert kinds(pair["e1"]) == [K.HELLO]
    assert pair.client.engines.engines == {}
    assert pair.client.engines.rejected["e1"].startswith(reason)
    assert pair["e1"].session.state is SessionState.REJECTED  # both topologies
    if dial_in:  # its only client refused it: the engine stops (serve raises)
        assert [type(e) for e in pair["e1"].events] == [SessionEnded, AllRejected]
        pair.advance(10.0, 0.1)
        assert kinds(pair["e1"]) == []  # it does not try again


def test_a_malformed_welcome_gets_a_reject_that_ends_the_clients_session() -> None:
    pair = ProtocolPair(("e1",), dial_in=True)
    pair.advance(0.0, deliver=False)
    pair.deliver_to_client()  # HELLO -> the client queues WELCOME
    end = pair["e1"]
    assert [w.kind for w in pair.client_sent] == [K.WELCOME]
    header, payload = end.inbox[0]
    end.inbox[0] = [header, payload[:-3]]  # truncated on the way
    pair.flush()
    assert kinds(end)[-1] is K.REJECT
    refused = [e for e in pair.events if isinstance(e, EngineRefused)]
    assert [(e.reason, e.by_client) for e in refused] == [("protocol", False)]
    assert "malformed WELCOME" in refused[0].message
    assert pair.client.engines.engines == {}
    assert engines_lost(pair)


# -- unary calls ---------------------------------------------------------------------------


def test_unary_result_error_and_remote_exception_reach_their_callers() -> None:
    pair = connected("e1")
    ok, failed, unknown = (
        work.call(pair, "add", 1, 2),
        work.call(pair, "add", 3, 4),
        work.call(pair, "add", 5),
    )
    pair.flush()
    end = pair["e1"]
    first, second, third = work.take_all(end)
    assert (first.call_id, second.call_id, third.call_id) == (ok.call_id, failed.call_id, 3)
    work.reply(end, first, 3)
    work.error(end, second, ErrorCode.REMOTE, "nope", "builtins.ValueError")
    work.error(end, third, ErrorCode.METHOD_NOT_FOUND, "no such method")
    pair.flush()
    assert work.outcome(ok) == 3
    with pytest.raises(RemoteError, match="nope") as info:
        work.outcome(failed)
    assert info.value.remote_type == "builtins.ValueError"
    with pytest.raises(MethodNotFoundError):
        work.outcome(unknown)
    assert pair.client.calls.get(ok.call_id) is None
    assert end.proto.in_flight() == 0
    assert pair.client.engines.engines["e1"].calls == set()


def test_an_unknown_method_is_refused_by_the_engines_admission() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    end = pair["e1"]
    _header, *rest = end.inbox[0]
    end.inbox[0] = [pack_call_header(call.call_id, "nope"), *rest]
    pair.flush()
    with pytest.raises(MethodNotFoundError, match="no method 'nope'"):
        work.outcome(call)
    assert end.proto.in_flight() == 0


def test_replies_are_routed_by_engine_and_call_id_and_a_late_one_is_dropped() -> None:
    pair = connected("e1", "e2")
    on_e1 = work.call(pair, "add", 1, 1, engine="e1")
    on_e2 = work.call(pair, "add", 2, 2, engine="e2")
    pair.flush()
    assert on_e1.call_id != on_e2.call_id
    (c1,) = work.take_all(pair["e1"])
    (c2,) = work.take_all(pair["e2"])
    work.reply(pair["e2"], c2, 4)
    work.reply(pair["e1"], c1, 2)
    pair.flush()
    assert (work.outcome(on_e1), work.outcome(on_e2)) == (2, 4)
    # A reply nobody waits for (e2 answering e1's call id again) changes nothing.
    pair.inject(pair["e2"], encode_control(K.STREAM_END, None, 1))
    pair.flush()
    assert on_e1.state is CallState.REPLIED
    assert work.outcome(on_e1) == 2


# -- streams and credit --------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 5])
def test_a_stream_keeps_items_sent_within_window_plus_credit(window: int) -> None:
    pair = connected("e1", stream_window=window)
    stream = work.call(pair, "count", 100)
    pair.flush()
    end = pair["e1"]
    (call,) = work.take_all(end)
    sent = taken = 0
    credits = 0
    for _ in range(40):
        while work.item(end, call, sent):
            sent += 1
        credits_now = [w for w in pair.client_sent if w.kind is K.CREDIT]
        credits = sum(w.body.n for w in credits_now)
        assert sent <= window + credits  # the spec's inequality, at every step
        pair.flush()
        got = work.items(pair, stream)
        assert got == list(range(taken, taken + len(got)))
        taken += len(got)
        pair.flush()
    assert sent == taken >= 40
    credit = stream.credit
    assert credit is not None
    assert credit.remaining >= 0
    assert credit.granted == sum(w.body.n for w in pair.client_sent if w.kind is K.CREDIT)
    work.end_stream(end, call)
    pair.flush()
    assert stream.state is CallState.REPLIED
    assert stream.reply_kind is K.STREAM_END
    assert end.proto.in_flight() == 0


def test_a_stream_without_credit_parks_and_credit_wakes_it() -> None:
    pair = connected("e1", stream_window=2)
    stream = work.call(pair, "count", 10)
    pair.flush()
    end = pair["e1"]
    (call,) = work.take_all(end)
    assert work.item(end, call, 0)
    assert work.item(end, call, 1)
    assert not work.item(end, call, 2)
    assert end.proto.park(call) is None  # waits without holding a worker
    assert end.proto.busy == 0
    assert end.proto.in_flight() == 1
    pair.flush()
    work.items(pair, stream, 1)  # half a window consumed: CREDIT(1) goes back
    pair.flush()
    assert call.credits == 1
    assert call.parked
    end.proto.unpark(call)
    assert end.proto.busy == 1
    assert work.item(end, call, 2)


def test_window_zero_sends_no_item_before_the_first_credit() -> None:
    pair = connected("e1")
    stream = work.call(pair, "count", 3)
    end = pair["e1"]
    pair.flush()
    (call,) = work.take_all(end)
    call.credits = 0  # as a WELCOME with stream_window 0 (a foreign client) leaves it
    assert not work.item(end, call, 0)
    end.inbox.append(encode_control(K.CREDIT, Credit(1), stream.call_id))
    pair.flush()
    assert work.item(end, call, 0)
    assert not work.item(end, call, 1)


def test_an_item_beyond_the_credit_fails_the_stream_and_cancels_it() -> None:
    pair = connected("e1", stream_window=1)
    stream = work.call(pair, "count", 3)
    pair.flush()
    end = pair["e1"]
    (call,) = work.take_all(end)
    assert work.item(end, call, 0)
    call.credits = 5  # an engine that breaks the rule
    assert work.item(end, call, 1)
    pair.flush()
    assert stream.state is CallState.FAILED
    assert isinstance(stream.error, RemoteProtocolError)
    assert K.CANCEL in client_kinds(pair)
    assert call.cancelled
    assert not work.item(end, call, 2)
    assert not work.end_stream(end, call)


def test_closing_a_stream_early_stops_the_engine_and_drops_items_in_flight() -> None:
    pair = connected("e1", stream_window=4)
    stream = work.call(pair, "count", 100)
    pair.flush()
    end = pair["e1"]
    (call,) = work.take_all(end)
    assert work.item(end, call, 0)
    assert work.item(end, call, 1)
    pair.flush()
    assert work.items(pair, stream, 1)[0] == 0
    assert work.item(end, call, 2)  # in flight while the consumer closes the stream
    assert work.cancel(pair, stream)
    assert stream.state is CallState.CANCELLED
    pair.flush()
    assert call.cancelled
    assert not work.item(end, call, 3)
    assert not work.end_stream(end, call)  # no final reply either
    assert client_kinds(pair)[-1] is K.CANCEL
    assert not work.cancel(pair, stream)  # one CANCEL only
    assert client_kinds(pair) == []
    assert end.proto.in_flight() == 0


# -- cancel and deadlines ------------------------------------------------------------------


def test_cancel_reaches_the_engine_and_the_handlers_result_is_not_sent() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    (running,) = work.take_all(pair["e1"])
    work.cancel(pair, call)
    pair.flush()
    assert running.cancelled
    assert not work.reply(pair["e1"], running, 3)
    assert call.state is CallState.CANCELLED
    assert K.RESULT not in kinds(pair["e1"])
    assert pair["e1"].proto.in_flight() == 0


def test_a_cancel_that_crosses_the_result_changes_nothing() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    (running,) = work.take_all(pair["e1"])
    assert work.reply(pair["e1"], running, 3)  # on its way
    work.cancel(pair, call)
    pair.flush()  # the RESULT of an ended call is dropped; the CANCEL finds nothing
    assert call.state is CallState.CANCELLED
    assert pair["e1"].proto.errors_total == 0


def test_a_deadline_travels_with_the_call_and_is_kept_on_the_engines_clock() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2, timeout_ms=1500)
    pair.advance(0.25)  # delivered a little later
    (running,) = work.take_all(pair["e1"])
    assert running.deadline == pytest.approx(pair.now + 1.5)
    # The engine's shell cancels the handler at the deadline and says so.
    pair.advance(1.5)
    assert work.error(pair["e1"], running, ErrorCode.DEADLINE_EXCEEDED, "ran past its deadline")
    pair.flush()
    with pytest.raises(CallTimeoutError, match="past its deadline"):
        work.outcome(call)


def test_a_caller_that_times_out_first_cancels_and_the_late_reply_is_dropped() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2, timeout_ms=100)
    pair.flush()
    (running,) = work.take_all(pair["e1"])
    pair.advance(0.1, deliver=False)
    work.cancel(pair, call)  # the caller's own timeout
    assert work.error(pair["e1"], running, ErrorCode.DEADLINE_EXCEEDED)  # crosses the CANCEL
    pair.flush()
    assert call.state is CallState.CANCELLED
    assert pair.client.engines.engines["e1"].calls == set()


# -- liveness ------------------------------------------------------------------------------


@pytest.mark.parametrize("dial_in", TOPOLOGIES)
@pytest.mark.parametrize(
    ("client", "engine"),
    [
        (Heartbeat(1.0, 5.0), Heartbeat(1.0, 5.0)),
        (Heartbeat(2.0, 10.0), Heartbeat(0.1, 0.5)),  # the engine's bound is short
        (Heartbeat(0.1, 0.5), Heartbeat(2.0, 10.0)),  # the client's bound is short
    ],
)
def test_each_side_pings_often_enough_for_the_others_bound(
    dial_in: bool, client: Heartbeat, engine: Heartbeat
) -> None:
    pair = ProtocolPair(
        ("e1",),
        dial_in=dial_in,
        heartbeat_interval=client.interval,
        dead_after=client.dead_after,
        engine={"heartbeat_interval": engine.interval, "dead_after": engine.dead_after},
    )
    pair.connect()
    call = work.call(pair, "add", 1, 2)
    pair.advance(30.0, 0.05)
    assert engines_lost(pair) == []
    assert pair["e1"].session.state is SessionState.LIVE
    assert not call.ended  # a long call survives on heartbeats alone
    assert [e for e in pair["e1"].events if isinstance(e, SessionEnded)] == []


@pytest.mark.parametrize("nonce", [0, 1, 2**32 - 1])
def test_a_ping_with_any_nonce_gets_a_pong_echoing_it_and_keeps_the_session(nonce: int) -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    end = pair["e1"]
    pair.advance(1.0)  # (at most one HELLO per heartbeat interval)
    kinds(end)
    end.inbox.append(encode_control(K.PING, None, nonce))
    pair.flush()
    pongs = [w for w in end.sent if w.kind is K.PONG]
    assert [w.call_id for w in pongs] == [nonce]
    if nonce == 0:  # the hello request: the same HELLO again, answered by the same WELCOME
        assert K.HELLO in kinds(end)
    assert engines_lost(pair) == []
    assert not call.ended
    assert end.session.state is SessionState.LIVE
    # and the engine answers the client's heartbeat PINGs the same way
    pair.advance(1.0)
    assert any(isinstance(e, Pong) for e in pair.events)


def test_a_frozen_engine_is_declared_dead_then_rejoins_with_a_new_session() -> None:
    pair = connected("e1", heartbeat_interval=0.2, dead_after=1.0)
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    end = pair["e1"]
    work.take_all(end)
    end.frozen = True  # SIGSTOP: the connection stays, nothing is read or sent
    pair.advance(1.2, 0.1)
    (lost,) = engines_lost(pair)
    assert call.state is CallState.FAILED
    assert isinstance(call.error, EngineDeadError)
    assert lost.calls == (call,)
    assert "e1" not in pair.client.engines.engines
    end.frozen = False  # SIGCONT: it reads the backlog and finds its client silent
    pair.advance(6.0, 0.1)
    engine = pair.client.engines.engines["e1"]
    assert engine.epoch == end.session.epoch
    assert end.session.state is SessionState.LIVE
    assert [type(e) for e in pair.events].count(EngineJoined) == 2


def test_a_stalled_client_loses_its_sessions_and_learns_it_when_it_wakes() -> None:
    pair = connected("e1", engine={"heartbeat_interval": 0.2, "dead_after": 1.0})
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    end = pair["e1"]
    (running,) = work.take_all(end)
    # The client's loop stalls for 3 s: the engine hears nothing and ends the session.
    for _ in range(30):
        pair.now += 0.1
        end.proto.tick(pair.now)
        pair.collect()
    assert running.cancelled
    assert end.session is None
    assert not work.reply(end, running, 3)  # no reply for a call of a lost session
    # The client wakes: its first look at the engine says it was forgotten.
    pair.advance(0.0)
    assert call.state is CallState.FAILED
    assert isinstance(call.error, EngineDeadError)
    assert "lost this client's session" in str(call.error)
    pair.advance(3.0, 0.1)  # and it joins again
    assert pair.client.engines.engines["e1"].epoch == session_of(end).epoch


@pytest.mark.parametrize("dial_in", TOPOLOGIES)
def test_a_restart_under_the_same_id_fails_the_old_calls_at_once(dial_in: bool) -> None:
    pair = connected("e1", dial_in=dial_in, heartbeat_interval=0.5, dead_after=30.0)
    calls = [work.call(pair, "add", 1, 2), work.call(pair, "count", 3)]
    pair.flush()
    old_epoch = pair.client.engines.engines["e1"].epoch
    pair["e1"].up = False  # kill -9, then a new process with the same id
    pair.add_engine("e1")
    pair.advance(1.0, 0.1)  # far below the client's 30 s bound
    for call in calls:
        assert call.state is CallState.FAILED
        assert isinstance(call.error, EngineDeadError)
    (lost,) = engines_lost(pair)
    assert set(lost.calls) == set(calls)
    engine = pair.client.engines.engines["e1"]
    assert engine.epoch != old_epoch
    assert engine.epoch == pair["e1"].session.epoch
    fresh = work.call(pair, "add", 2, 2)
    pair.flush()
    (running,) = work.take_all(pair["e1"])
    work.reply(pair["e1"], running, 4)
    pair.flush()
    assert work.outcome(fresh) == 4


def test_a_repeated_hello_of_the_same_session_keeps_the_calls() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    end = pair["e1"]
    pair.inject(end, end.session.hello_frames)  # a re-sent HELLO
    pair.flush()
    assert engines_lost(pair) == []
    assert not call.ended
    assert [w.kind for w in pair.client_sent].count(K.WELCOME) == 2


def test_an_impostor_cannot_displace_a_live_engine() -> None:
    pair = connected("e1", dial_in=True)
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    pair.add_engine("impostor", engine_id="e1")  # claims the live id from another connection
    pair.flush()
    refused = [e for e in pair.events if isinstance(e, EngineRefused)]
    assert [e.reason for e in refused] == ["duplicate_id"]
    assert not call.ended
    (running,) = work.take_all(pair["e1"])
    work.reply(pair["e1"], running, 3)
    pair.flush()
    assert work.outcome(call) == 3


# -- BYE and drain -------------------------------------------------------------------------


def test_an_engines_bye_fails_its_calls_at_once() -> None:
    pair = connected("e1", "e2")
    on_e1, on_e2 = (
        work.call(pair, "add", 1, 2, engine="e1"),
        work.call(pair, "add", 1, 2, engine="e2"),
    )
    pair.flush()
    pair["e1"].proto.goodbye()
    pair.flush()
    assert on_e1.state is CallState.FAILED
    assert isinstance(on_e1.error, EngineDeadError)
    assert "said BYE" in str(on_e1.error)
    assert not on_e2.ended


def test_after_the_clients_bye_a_dial_in_engine_waits_until_it_speaks() -> None:
    pair = connected("e1", dial_in=True)
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    (running,) = work.take_all(pair["e1"])
    pair.client.close(pair.now)
    assert pair.client.next_events() == [call]  # the call it ended
    pair.flush()
    end = pair["e1"]
    assert end.session.state is SessionState.PARTED
    assert running.cancelled
    kinds(end)
    pair.advance(3.0, 0.1)  # below dead_after: no HELLO to a client that said BYE
    assert K.HELLO not in kinds(end)
    end.inbox.append(encode_control(K.PING, None, 5))  # it speaks again
    pair.flush()
    assert kinds(end)[-1] is K.HELLO
    assert state_of(end) is SessionState.GREETING


def test_drain_answers_new_calls_draining_lets_running_ones_finish_and_says_bye() -> None:
    pair = connected("e1")
    running_call = work.call(pair, "add", 1, 2)
    pair.flush()
    end = pair["e1"]
    (running,) = work.take_all(end)
    end.proto.start_drain()
    refused = work.call(pair, "add", 3, 4)
    pair.flush()
    with pytest.raises(DrainingError, match="shutting down"):
        work.outcome(refused)
    work.reply(end, running, 3)  # a running call finishes within the grace period
    pair.flush()
    assert work.outcome(running_call) == 3
    late = work.call(pair, "add", 5, 6)
    end.proto.draining = False  # (admitted just before the drain, say)
    pair.flush()
    end.proto.start_drain()
    (stuck,) = work.take_all(end)
    end.proto.stop_all()  # the grace period is over
    assert stuck.shutdown
    assert work.error(end, stuck, ErrorCode.DRAINING, "shut down before it finished")
    end.proto.goodbye()
    pair.flush()
    with pytest.raises(DrainingError):
        work.outcome(late)
    assert "e1" not in pair.client.engines.engines
    assert "said BYE" in engines_lost(pair)[0].why


# -- overload ------------------------------------------------------------------------------


def test_a_full_engine_answers_overloaded_and_a_retry_succeeds_once_it_has_room() -> None:
    pair = connected("e1", engine={"max_concurrency": 1, "max_queued": 1})
    first, second, third = (
        work.call(pair, "add", 1, 1),
        work.call(pair, "add", 2, 2),
        work.call(pair, "add", 3, 3),
    )
    pair.flush()
    with pytest.raises(OverloadedError, match="is full"):
        work.outcome(third)
    end = pair["e1"]
    assert end.proto.overloaded == 1
    running = end.proto.next_call()
    assert running is not None
    work.reply(end, running, 2)
    retry = work.call(pair, "add", 3, 3)  # the client's retry after its backoff
    pair.flush()
    queued, retried = work.take_all(end)
    assert (queued.call_id, retried.call_id) == (second.call_id, retry.call_id)
    work.reply(end, queued, 4)
    work.reply(end, retried, 6)
    pair.flush()
    assert [work.outcome(c) for c in (first, second, retry)] == [2, 4, 6]


def test_no_wait_is_refused_while_every_worker_is_busy() -> None:
    pair = connected("e1", engine={"max_concurrency": 1, "max_queued": 8})
    work.call(pair, "add", 1, 1)
    pair.flush()
    work.take_all(pair["e1"])
    waiting, hasty = work.call(pair, "add", 2, 2), work.call(pair, "add", 3, 3, no_wait=True)
    pair.flush()
    assert not waiting.ended
    with pytest.raises(OverloadedError, match="busy"):
        work.outcome(hasty)


def test_the_client_holds_calls_beyond_its_in_flight_limit() -> None:
    pair = connected("e1", max_in_flight=2)
    work.call(pair, "add", 1, 1)
    work.call(pair, "add", 2, 2)
    assert pair.client.select("e1") is None  # the shell waits for capacity
    pair.flush()
    call = pair["e1"].proto.next_call()
    assert call is not None
    work.reply(pair["e1"], call, 2)
    pair.flush()
    assert pair.client.select("e1") is not None


# -- protocol errors -----------------------------------------------------------------------


def test_a_reused_call_id_gets_one_protocol_error_and_no_result() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    end = pair["e1"]
    end.inbox.append(list(end.inbox[0]))  # the same CALL twice
    pair.flush()
    (original,) = work.take_all(end)
    assert original.cancelled
    assert not work.reply(end, original, 3)
    pair.flush()
    errors = [w for w in end.sent if w.kind is K.ERROR]
    assert [w.call_id for w in errors] == [call.call_id]
    with pytest.raises(RemoteProtocolError, match="already in flight"):
        work.outcome(call)
    assert K.RESULT not in [w.kind for w in end.sent]


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda h: h[:4] + b"\x00\x80" + h[6:], id="unknown-flag"),
        pytest.param(lambda h: h[:6] + b"\x01\x00" + h[8:], id="reserved-bits"),
        pytest.param(lambda h: h[:2] + bytes([h[2] + 1]) + h[3:], id="wrong-version"),
    ],
)
def test_every_readable_call_id_gets_an_answer(corrupt: Any) -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    end = pair["e1"]
    header, *rest = end.inbox[0]
    end.inbox[0] = [corrupt(bytes(header)), *rest]
    pair.flush()
    assert call.state is CallState.REPLIED  # answered, not left to its timeout
    with pytest.raises(RemoteProtocolError):
        work.outcome(call)
    assert end.proto.in_flight() == 0


def test_a_call_before_the_handshake_is_answered_with_a_protocol_error() -> None:
    pair = ProtocolPair(("e1",))
    end = pair["e1"]
    end.inbox.clear()  # the hello request is lost
    end.inbox.append([pack_call_header(9, "add"), b"\x92\x01\x02"])
    pair.deliver_to_engine("e1")
    (error,) = end.sent
    assert (error.kind, error.call_id) == (K.ERROR, 9)
    assert error.body.code == ErrorCode.PROTOCOL


def test_a_reject_from_the_engine_ends_the_session_and_is_remembered() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    end = pair["e1"]
    pair.inject(end, encode_control(K.REJECT, Reject("other", "go away")))
    pair.flush()
    assert isinstance(call.error, EngineDeadError)
    assert pair.client.engines.rejected["e1"].startswith("other")


def test_a_new_client_session_cancels_the_engines_calls_of_the_old_one() -> None:
    pair = connected("e1")
    work.call(pair, "add", 1, 2)
    pair.flush()
    end = pair["e1"]
    (running,) = work.take_all(end)
    end.inbox.append(encode_control(K.WELCOME, Welcome("pair-client", "h", epoch=999)))
    pair.flush()
    assert running.cancelled
    assert end.session.client_epoch == 999
    assert not work.reply(end, running, 3)


def test_stream_flag_mismatch_is_refused() -> None:
    pair = connected("e1")
    call = work.call(pair, "add", 1, 2)
    end = pair["e1"]
    _header, *rest = end.inbox[0]
    end.inbox[0] = [pack_call_header(call.call_id, "add", int(Flags.STREAM)), *rest]
    pair.flush()
    with pytest.raises(Exception, match="must be called as a unary call"):
        work.outcome(call)


@pytest.mark.parametrize("dial_in", TOPOLOGIES)
def test_a_parked_stream_of_an_ended_session_counts_in_flight_until_its_worker_is_done(
    dial_in: bool,
) -> None:
    pair = connected("e1", dial_in=dial_in, stream_window=1)
    work.call(pair, "count", 5)
    pair.flush()
    end = pair["e1"]
    (call,) = work.take_all(end)
    assert work.item(end, call, 0)
    assert not work.item(end, call, 1)
    assert end.proto.park(call) is None
    assert end.proto.in_flight() == 1
    end.inbox.append(encode_control(K.BYE, Bye("closed")))  # the session ends
    pair.flush()
    assert call.cancelled
    assert end.proto.in_flight() == 1  # its worker still waits on it
    end.proto.unpark(call)  # woken: cancelled
    assert not work.end_stream(end, call)
    assert end.proto.in_flight() == 0


def test_an_engine_refuses_a_welcome_with_another_fingerprint() -> None:
    pair = ProtocolPair(("e1",), dial_in=True)
    pair.deliver_to_client()  # HELLO -> the client queues WELCOME
    end = pair["e1"]
    welcome = Wire(end, end.inbox[0]).body
    assert isinstance(welcome, Welcome)
    assert welcome.fingerprint == SPEC.fingerprint  # the client says which schema it has
    end.inbox[0] = encode_control(K.WELCOME, dataclasses.replace(welcome, fingerprint="f" * 64))
    pair.flush()
    refused = [e for e in pair.events if isinstance(e, EngineRefused)]
    assert [(e.reason, e.by_client) for e in refused] == [("fingerprint", False)]
    assert refused[0].message == (
        f"client has a different schema (fingerprint {'f' * 12}, engine's {SPEC.fingerprint[:12]})"
    )
    assert state_of(end) is SessionState.REJECTED
    assert [type(e) for e in end.events][-1] is AllRejected
