"""ClientProtocol without sockets: scripted engine frames in, control frames out, fake clock."""

from __future__ import annotations

import pytest

from tensorrpc._calls import Call, CallState
from tensorrpc._client_events import (
    DIAL_RETRY_MIN_S,
    CheckReachable,
    Dropped,
    EngineJoined,
    EngineLost,
    EngineRefused,
    Ignored,
    LeasesFreed,
)
from tensorrpc._client_leases import take_lease
from tensorrpc._client_protocol import HELLO_REQUEST, ClientProtocol
from tensorrpc._engines import MAX_PAST, MAX_REJECTED, MAX_REJECTED_KEY, MAX_REJECTED_TEXT, Engine
from tensorrpc._exceptions import ClosedError, EngineDeadError, RemoteProtocolError
from tensorrpc._machine import MAX_RELEASE_LEASES
from tensorrpc._protocol import (
    MAX_CALL_RELEASES,
    Credit,
    MessageKind,
    Reject,
    Release,
    Welcome,
    decode_control,
    split_frames,
)

from .client_script import (
    ADD,
    SPEC,
    bye,
    control,
    end,
    error,
    feed,
    hello,
    join,
    kinds,
    make_protocol,
    reject,
    result,
    sent,
    start,
    tick,
)

K = MessageKind


def state_of(call: Call) -> CallState:
    return call.state


# -- handshake -------------------------------------------------------------------------------


def test_acceptable_hello_is_welcomed_with_our_session_and_bounds() -> None:
    protocol = make_protocol()
    event = feed(protocol, b"e1/x", hello("e1", dead_after_ms=3000), 0.0)
    assert isinstance(event, EngineJoined)
    [welcome] = sent(protocol)
    assert welcome.peer == b"e1/x"
    body = welcome.body
    assert isinstance(body, Welcome)
    assert body.client_id == "c1"
    assert body.epoch == 100
    assert body.dead_after_ms == 5000
    assert body.heartbeat_ms == 1000
    assert body.fingerprint == SPEC.fingerprint
    assert body.stream_window == 4
    assert body.transports == ("frames",)
    assert event.engine.info.dead_after_ms == 3000


def test_schemaless_welcome_announces_no_fingerprint_and_admits_any_service() -> None:
    protocol = make_protocol(schemaless=True)
    event = feed(protocol, b"p", hello("e1", service="Other", fingerprint="abc"), 0.0)
    assert isinstance(event, EngineJoined)
    assert sent(protocol)[0].body.fingerprint == ""


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"fingerprint": "abc"}, "fingerprint"),
        ({"service": "X"}, "service"),
        ({"protocol_version": 9}, "version"),
    ],
)
def test_mismatched_hello_is_refused_with_the_reason(kw: dict[str, object], reason: str) -> None:
    protocol = make_protocol()
    event = feed(protocol, b"p", hello("e1", **kw), 0.0)
    assert isinstance(event, EngineRefused)
    assert event.by_client
    assert event.reason == reason
    [out] = sent(protocol)
    assert out.kind is K.REJECT
    assert out.body.reason == reason
    assert protocol.engines.rejected["e1"].startswith(reason)
    assert not protocol.engines.engines


def test_malformed_hello_gets_a_protocol_reject() -> None:
    protocol = make_protocol()
    frames = hello("e1")
    frames[1] = b"\x81\xa1x\x01"  # a map without the required fields
    event = feed(protocol, b"p", frames, 0.0)
    assert isinstance(event, Ignored)
    [out] = sent(protocol)
    assert out.kind is K.REJECT
    assert isinstance(out.body, Reject)
    assert out.body.reason == "protocol"


def test_repeated_hello_of_the_same_session_is_harmless() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", epoch=7)
    call = start(protocol, engine)
    assert feed(protocol, b"p", hello("e1", epoch=7), 1.0) is None
    [again] = sent(protocol)
    assert again.kind is K.WELCOME
    assert again.body.epoch == 100  # the same client epoch: nothing changed
    assert state_of(call) is CallState.IN_FLIGHT
    assert protocol.engines.engines["e1"] is engine


def test_new_epoch_from_a_known_engine_fails_its_calls_at_once() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", epoch=7)
    calls = [start(protocol, engine) for _ in range(3)]
    lost, event = feed(protocol, b"p", hello("e1", epoch=8), 1.0)
    assert isinstance(event, EngineJoined)
    assert isinstance(lost, EngineLost)
    assert set(lost.calls) == set(calls)
    for call in calls:
        assert state_of(call) is CallState.FAILED
        assert isinstance(call.error, EngineDeadError)
        assert "replaced by a new session" in str(call.error)
    [welcome] = sent(protocol)
    assert welcome.body.epoch == 101  # a new session of ours too
    assert protocol.engines.engines["e1"] is event.engine is not engine
    assert len(protocol.calls) == 0


def test_the_epoch_alone_tells_a_new_session_of_the_same_process() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", epoch=5, pid=10)
    call = start(protocol, engine)
    assert feed(protocol, b"p", hello("e1", epoch=5, pid=10), 1.0) is None
    assert kinds(protocol) == [K.WELCOME]
    # same process, same host: the new epoch says the engine lost the session
    _lost, joined = feed(protocol, b"p", hello("e1", epoch=6, pid=10), 1.0)
    assert isinstance(joined, EngineJoined)
    assert isinstance(call.error, EngineDeadError)


def test_impostor_with_a_live_id_is_refused_and_steals_nothing() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"e1/real")
    call = start(protocol, engine)
    check = feed(protocol, b"e1/fake", hello("e1", epoch=99), 1.0)
    assert isinstance(check, CheckReachable)  # the shell is asked: is the live one reachable?
    assert check.peer == b"e1/real"
    [ping] = sent(protocol)  # queued for the shell to try; nothing decided before the answer
    assert (ping.peer, ping.kind) == (b"e1/real", K.PING)
    protocol.reachable(check, True, 1.0)
    [event] = protocol.next_events()
    assert isinstance(event, EngineRefused)
    assert event.reason == "duplicate_id"
    [out] = sent(protocol)
    assert (out.peer, out.kind, out.body.reason) == (b"e1/fake", K.REJECT, "duplicate_id")
    assert protocol.engines.engines["e1"] is engine
    # its replies to the live engine's call ids go nowhere
    assert feed(protocol, b"e1/fake", result(call.call_id, 666), 1.0) is None
    assert state_of(call) is CallState.IN_FLIGHT
    assert feed(protocol, b"e1/real", result(call.call_id, 3), 1.0) is call
    assert state_of(call) is CallState.REPLIED


def test_restarted_engine_replaces_a_session_whose_peer_is_gone() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"e1/old")
    call = start(protocol, engine)
    check = feed(protocol, b"e1/new", hello("e1", epoch=9), 1.0)
    assert isinstance(check, CheckReachable)
    protocol.reachable(check, False, 1.0)
    lost, event = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert lost.engine is engine
    assert isinstance(event, EngineJoined)
    assert isinstance(call.error, EngineDeadError)
    assert "unreachable" in str(call.error)
    assert protocol.engines.by_peer(b"e1/new") is event.engine


def test_strangers_cost_constant_memory() -> None:
    protocol = make_protocol()
    for i in range(5000):
        feed(protocol, f"p{i}".encode(), hello(f"{i}-" + "x" * 1000, fingerprint="bad"), 0.0)
        protocol.frames_to_send()
    assert len(protocol.engines.rejected) == MAX_REJECTED
    assert protocol.engines.rejected_total == 5000
    assert sum(len(k) + len(v) for k, v in protocol.engines.rejected.items()) <= MAX_REJECTED * (
        MAX_REJECTED_KEY + MAX_REJECTED_TEXT
    )
    assert not protocol.engines.engines


def test_reject_from_an_engine_ends_its_session_and_is_remembered() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine)
    lost, event = feed(protocol, b"p", reject("fingerprint"), 1.0)
    assert isinstance(event, EngineRefused)
    assert not event.by_client
    assert isinstance(lost, EngineLost)
    assert isinstance(call.error, EngineDeadError)
    assert protocol.engines.rejected["e1"] == "fingerprint: no"


# -- calls -----------------------------------------------------------------------------------


def test_unary_reply_is_delivered_once_and_late_or_foreign_replies_dropped() -> None:
    protocol = make_protocol()
    e1 = join(protocol, "e1", b"p1")
    join(protocol, "e2", b"p2")
    call = start(protocol, e1)
    assert feed(protocol, b"p2", result(call.call_id, 0), 0.1) is not call
    assert state_of(call) is CallState.IN_FLIGHT
    assert feed(protocol, b"p1", result(call.call_id, 3), 0.1) is call
    assert state_of(call) is CallState.REPLIED
    assert call.reply_kind is K.RESULT
    late = feed(protocol, b"p1", result(call.call_id, 4), 0.2)
    assert isinstance(late, Dropped)  # its torch_shm leases (if any) get released
    # dropped (it would end an argument lease kept for a call of that id: none here)
    assert feed(protocol, b"p1", error(call.call_id), 0.2) is None
    assert e1.in_flight == 0


def test_error_reply_ends_a_unary_call_and_counts_as_an_error() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine)
    assert feed(protocol, b"p", error(call.call_id), 0.1) is call
    assert call.reply_kind is K.ERROR
    assert engine.errors == 1


@pytest.mark.parametrize("kind", [K.STREAM_ITEM, K.STREAM_END])
def test_stream_message_for_a_unary_call_fails_it_and_cancels(kind: MessageKind) -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine)
    frames = result(call.call_id, 1, kind) if kind is K.STREAM_ITEM else end(call.call_id)
    event = feed(protocol, b"p", frames, 0.1)
    got = event.call if isinstance(event, Dropped) else event
    assert got is call
    assert state_of(call) is CallState.FAILED
    assert isinstance(call.error, RemoteProtocolError)
    assert [(s.kind, s.call_id) for s in sent(protocol)] == [(K.CANCEL, call.call_id)]


def test_result_for_a_stream_is_a_violation() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine, stream=True)
    event = feed(protocol, b"p", result(call.call_id, 1), 0.1)
    assert isinstance(event, Dropped)
    assert event.call is call
    assert "RESULT for a streaming call" in str(call.error)


def test_stream_credit_flows_back_in_half_windows_and_end_closes() -> None:
    protocol = make_protocol(stream_window=4)
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine, stream=True)
    for i in range(4):
        assert feed(protocol, b"p", result(call.call_id, i, K.STREAM_ITEM), 0.1) is call
    assert state_of(call) is CallState.STREAMING
    protocol.take_item(call, 0.2)
    assert kinds(protocol) == []
    protocol.take_item(call, 0.2)
    [credit] = sent(protocol)
    assert (credit.kind, credit.call_id, credit.body) == (K.CREDIT, call.call_id, Credit(2))
    assert call.credit is not None
    assert call.credit.remaining == 2
    assert feed(protocol, b"p", end(call.call_id), 0.3) is call
    assert state_of(call) is CallState.REPLIED
    protocol.take_item(call, 0.4)
    protocol.take_item(call, 0.4)
    assert kinds(protocol) == []  # nothing is sent for a call after its end


def test_stream_item_beyond_window_and_credit_fails_the_stream() -> None:
    protocol = make_protocol(stream_window=2)
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine, stream=True)
    for i in range(2):
        feed(protocol, b"p", result(call.call_id, i, K.STREAM_ITEM), 0.1)
    event = feed(protocol, b"p", result(call.call_id, 2, K.STREAM_ITEM), 0.1)
    assert isinstance(event, Dropped)
    assert state_of(call) is CallState.FAILED
    assert "window" in str(call.error)
    assert kinds(protocol) == [K.CANCEL]


def test_cancel_sends_one_cancel_and_then_nothing() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine, stream=True)
    assert protocol.cancel(call, 0.1)
    assert not protocol.cancel(call, 0.2)
    assert [(s.kind, s.call_id) for s in sent(protocol)] == [(K.CANCEL, call.call_id)]
    assert feed(protocol, b"p", result(call.call_id, 0, K.STREAM_ITEM), 0.3) is not call
    assert state_of(call) is CallState.CANCELLED
    assert engine.in_flight == 0


def test_error_with_call_id_zero_is_reported() -> None:
    protocol = make_protocol()
    join(protocol, "e1", b"p")
    event = feed(protocol, b"p", error(0, 11, "bad header"), 0.1)
    assert isinstance(event, Ignored)
    assert "bad header" in event.why


def test_malformed_frames_are_ignored_and_the_session_stays() -> None:
    protocol = make_protocol()
    join(protocol, "e1", b"p")
    assert isinstance(feed(protocol, b"p", [b"junk"], 0.1), Ignored)
    assert "e1" in protocol.engines.engines


# -- liveness --------------------------------------------------------------------------------


@pytest.mark.parametrize("nonce", [0, 1, 2**64 - 1])
def test_every_ping_gets_a_pong_echoing_its_nonce(nonce: int) -> None:
    protocol = make_protocol()
    join(protocol, "e1", b"p")
    feed(protocol, b"p", control(K.PING, None, nonce), 0.1)
    assert [(s.kind, s.call_id) for s in sent(protocol)] == [(K.PONG, nonce)]


def test_pings_from_strangers_are_not_answered() -> None:
    protocol = make_protocol()
    feed(protocol, b"who", control(K.PING, None, 5), 0.1)
    assert kinds(protocol) == []


def test_any_message_counts_as_life_and_silence_kills() -> None:
    protocol = make_protocol()  # dead_after 5 s
    engine = join(protocol, "e1", b"p", dead_after_ms=3_600_000)
    call = start(protocol, engine)
    for t in (2.0, 4.0, 6.0, 8.0):
        feed(protocol, b"p", control(K.PONG, None, 1), t)
        assert tick(protocol, t) == []
    [lost] = tick(protocol, 13.1)
    assert lost.engine is engine
    assert lost.calls == (call,)
    assert isinstance(call.error, EngineDeadError)
    assert "sent nothing for 5.1 s" in str(call.error)


def test_we_ping_often_enough_for_the_engines_bound() -> None:
    protocol = make_protocol()  # our own interval: 1 s
    join(protocol, "fast", b"f", dead_after_ms=300)
    join(protocol, "slow", b"s", dead_after_ms=3_600_000)
    pings: dict[bytes, int] = {b"f": 0, b"s": 0}
    now = 0.0
    while now < 3.0:
        now += protocol.next_tick(now)
        protocol.tick(now)
        for s in sent(protocol):
            if s.kind is K.PING:
                pings[s.peer] += 1
        feed(protocol, b"f", control(K.PONG, None, 1), now)
        feed(protocol, b"s", control(K.PONG, None, 1), now)
    assert pings[b"f"] >= 3 * 3 - 1  # three per 0.3 s bound
    assert pings[b"s"] in (2, 3)  # every 1 s


def test_a_stalled_client_ends_calls_of_engines_that_forgot_it() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", dead_after_ms=2000, epoch=7)
    call = start(protocol, engine, now=0.0)
    # the loop stalls for 10 s: no ticks, no sends; then the engine's new HELLO arrives
    lost, event = feed(protocol, b"p", hello("e1", epoch=7, dead_after_ms=2000), 10.0)
    assert isinstance(event, EngineJoined)  # even a repeated epoch starts a new session
    assert isinstance(lost, EngineLost)
    assert lost.calls == (call,)
    assert isinstance(call.error, EngineDeadError)
    assert "lost this client's session" in str(call.error)


def test_a_stalled_client_learns_it_at_the_next_tick_too() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", dead_after_ms=2000)
    call = start(protocol, engine, now=0.0)
    [lost] = tick(protocol, 2.5)
    assert lost.calls == (call,)
    assert "stall" in str(call.error)


def test_bye_ends_the_session_and_fails_its_calls() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = start(protocol, engine)
    event = feed(protocol, b"p", bye(), 0.1)
    assert isinstance(event, EngineLost)
    assert "said BYE" in str(call.error)
    assert "e1" in protocol.engines.past


def test_a_lost_bulk_connection_ends_its_session_and_fails_its_calls_at_once() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", epoch=7)
    call = start(protocol, engine)
    protocol.bulk_lost(b"p", 6, 0.1)  # an older session's connection: nothing
    assert not protocol.pending
    assert "e1" in protocol.engines.engines
    protocol.bulk_lost(b"p", 7, 0.1)
    [lost] = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert lost.calls == (call,)
    assert isinstance(call.error, EngineDeadError)
    assert "lost its bulk connection" in str(call.error)
    assert "e1" in protocol.engines.past
    sent(protocol)  # (it dialed us: BYE and a hello request, as tests/unit/test_bulk_bye.py says)
    protocol.bulk_lost(b"p", 7, 0.1)  # over already
    protocol.bulk_lost(b"stranger", 7, 0.1)
    assert not protocol.pending


# -- dialling --------------------------------------------------------------------------------


def test_dialled_address_gets_hello_requests_retried_until_connected() -> None:
    protocol = make_protocol()
    protocol.dial(b"@a/0", "ipc://x", 0.0)
    [ping] = sent(protocol)
    assert (ping.peer, ping.kind, ping.call_id) == (b"@a/0", K.PING, HELLO_REQUEST)
    now = 0.0
    delays = []
    for _ in range(4):  # ROUTER_MANDATORY: the send failed, not connected yet
        protocol.send_failed(b"@a/0", now)
        assert protocol.next_events() == []
        delay = protocol.next_tick(now)
        delays.append(delay)
        now += delay
        protocol.tick(now)
        assert kinds(protocol) == [K.PING]
    assert delays == pytest.approx([DIAL_RETRY_MIN_S * 2**i for i in range(4)])
    # connected: the next request waits a heartbeat interval
    assert protocol.next_tick(now) == pytest.approx(1.0)
    event = feed(protocol, b"@a/0", hello("e1"), now)
    assert isinstance(event, EngineJoined)
    assert event.engine.info.address == "ipc://x"
    sent(protocol)
    protocol.tick(now + 1.5)
    assert kinds(protocol) == [K.PING]  # the heartbeat; no more hello requests
    feed(protocol, b"@a/0", bye(), now + 1.6)
    protocol.tick(now + 1.6)
    assert [(s.kind, s.call_id) for s in sent(protocol)] == [(K.PING, HELLO_REQUEST)]


def test_undialled_address_gets_no_more_requests() -> None:
    protocol = make_protocol()
    protocol.dial(b"@a/0", "ipc://x", 0.0)
    sent(protocol)
    assert protocol.undial("ipc://x") == [b"@a/0"]
    protocol.tick(5.0)
    assert kinds(protocol) == []


def test_declare_dead_needs_the_right_pid() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", pid=42)
    call = start(protocol, engine)
    assert not protocol.declare_dead("e1", pid=41, reason="x")
    assert not protocol.pending
    assert protocol.declare_dead("e1", pid=42, reason="died (supervisor)")
    [lost] = protocol.next_events()
    assert isinstance(lost, EngineLost)
    assert "died (supervisor)" in str(call.error)


# -- capacity and close -----------------------------------------------------------------------


def test_new_callers_queue_behind_waiters() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    assert protocol.select(None) is engine
    protocol.capacity.add(None, "w")
    assert protocol.select(None) is None
    assert protocol.select("e1") is engine


def test_close_says_bye_and_fails_every_call() -> None:
    protocol = make_protocol()
    e1 = join(protocol, "e1", b"p1")
    e2 = join(protocol, "e2", b"p2")
    calls = [start(protocol, e1), start(protocol, e2, stream=True)]
    protocol.close(1.0)
    assert set(protocol.next_events()) == set(calls)  # the calls it ended
    assert all(isinstance(c.error, ClosedError) for c in calls)
    assert sorted((s.peer, s.kind) for s in sent(protocol)) == [(b"p1", K.BYE), (b"p2", K.BYE)]
    protocol.close(2.0)
    assert not protocol.pending
    with pytest.raises(ClosedError):
        start(protocol, e1)
    assert not protocol.cancel(calls[0], 3.0)
    assert kinds(protocol) == []


# -- the torch_shm lease table ----------------------------------------------------------------


def leased(protocol: ClientProtocol, engine: Engine, lease: int) -> Call:
    call = protocol.start_call(engine, ADD, object(), stream=False, now=0.0, lease=lease)
    protocol.frames_to_send()  # the CALL
    return call


def test_a_cancelled_calls_argument_lease_is_kept_until_the_engines_release() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = leased(protocol, engine, 5)
    assert protocol.cancel(call, 1.0)
    assert kinds(protocol) == [K.CANCEL]
    assert take_lease(call) is None  # not freed: the engine may still read it
    assert len(protocol.leases) == 1
    freed = feed(protocol, b"p", control(K.RELEASE, Release((5, 99))), 1.0)
    assert freed == LeasesFreed(engine, (5,), refused=1)  # 99 was never kept: refused
    assert len(protocol.leases) == 0
    again = feed(protocol, b"p", control(K.RELEASE, Release((5,))), 1.0)
    assert again == LeasesFreed(engine, (), refused=1)  # twice: refused


def test_a_release_from_another_engine_or_for_a_running_call_frees_nothing() -> None:
    protocol = make_protocol()
    e1 = join(protocol, "e1", b"p1")
    join(protocol, "e2", b"p2")
    running = leased(protocol, e1, 7)
    cancelled = leased(protocol, e1, 8)
    protocol.cancel(cancelled, 1.0)
    freed = feed(protocol, b"p2", control(K.RELEASE, Release((8,))), 1.0)
    assert isinstance(freed, LeasesFreed)
    assert (freed.leases, freed.refused) == ((), 1)
    freed = feed(protocol, b"p1", control(K.RELEASE, Release((7,))), 1.0)
    assert isinstance(freed, LeasesFreed)
    assert (freed.leases, freed.refused) == ((), 1)
    assert running.lease == 7
    assert len(protocol.leases) == 1


@pytest.mark.parametrize("late", ["result", "error", "end"])
def test_a_late_reply_to_a_cancelled_call_ends_its_kept_lease(late: str) -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    call = leased(protocol, engine, 9)
    protocol.cancel(call, 1.0)
    cid = call.call_id
    frames = {"result": result(cid, 3), "error": error(cid), "end": end(cid)}[late]
    event = feed(protocol, b"p", frames, 1.0)
    if late == "result":  # nobody decodes it: its own leases go back too
        event, dropped = event
        assert isinstance(dropped, Dropped)
        assert dropped.call_id == cid
    assert event == LeasesFreed(engine, (9,))
    assert len(protocol.leases) == 0


def test_an_engines_end_drops_the_leases_kept_for_it_and_those_to_return() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    protocol.cancel(leased(protocol, engine, 3), 1.0)
    assert protocol.leases.give_back(engine, [40, 41])
    feed(protocol, b"p", bye(), 1.0)
    assert len(protocol.leases) == 0
    assert engine.releases == []
    sent(protocol)
    protocol.leases.release_pending(2.0)
    assert kinds(protocol) == []  # it dropped our leases itself


def test_result_leases_ride_in_the_next_call() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    assert protocol.leases.give_back(engine, [4, 5])
    assert not protocol.leases.give_back(engine, [5, 6])  # already due: no second flush
    call = protocol.start_call(
        engine, ADD, object(), stream=False, now=1.0, payload=b"\x90", returns=(7,)
    )
    [(_, frames)] = protocol.frames_to_send()
    header = split_frames(frames)[0]
    assert header.releases == (4, 5, 6, 7)  # each once
    assert call.releases == (4, 5, 6, 7)
    assert kinds(protocol) == []
    protocol.leases.release_pending(1.0)
    assert kinds(protocol) == []  # the CALL took them
    # Not sent after all: they go in a RELEASE instead.
    protocol.call_unsent(call, 1.0)
    [release] = sent(protocol)
    assert (release.kind, release.body) == (K.RELEASE, Release((4, 5, 6, 7)))


def test_result_leases_a_call_cannot_carry_go_in_a_release_first() -> None:
    count = MAX_CALL_RELEASES + 1
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    protocol.leases.give_back(engine, range(1, count + 1))
    protocol.start_call(engine, ADD, object(), stream=False, now=1.0, payload=b"\x90")
    (_, release), (_, call) = protocol.frames_to_send()  # the CALL is queued last
    header, payload, _ = split_frames(release)
    assert decode_control(header, payload) == Release(tuple(range(1, count + 1)))
    header = split_frames(call)[0]
    assert (header.kind, header.releases) == (K.CALL, ())


def test_a_release_is_split_at_the_protocol_limit_and_names_each_lease_once() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    protocol.leases.give_back(engine, [1, 1, 2])
    protocol.leases.release(engine, range(2, MAX_RELEASE_LEASES + 10), 1.0)
    first, second = sent(protocol)
    assert first.body.leases == tuple(range(1, MAX_RELEASE_LEASES + 1))
    assert second.body.leases == tuple(range(MAX_RELEASE_LEASES + 1, MAX_RELEASE_LEASES + 10))


# -- wait-for-ready ----------------------------------------------------------------------------


def test_wait_for_ready_waits_where_fail_fast_raises_and_absence_says_why() -> None:
    from tensorrpc._exceptions import EngineNotFoundError

    protocol = make_protocol()
    with pytest.raises(EngineNotFoundError, match="no engine has joined yet"):
        protocol.select(None, 0.0)
    assert protocol.select(None, 0.0, wait_for_ready=True) is None  # the caller waits
    assert protocol.select("e1", 0.0, wait_for_ready=True) is None
    assert protocol.absence(None, 0.0) == "no engine has joined yet"

    engine = join(protocol, "e1", b"p")
    assert protocol.select(None, 1.0, wait_for_ready=True) is engine
    assert protocol.absence(None, 1.0) is None
    event = feed(protocol, b"p", bye(), 2.0)  # the engine stops: a restart looks like this
    assert isinstance(event, EngineLost)
    assert protocol.select("e1", 2.0, wait_for_ready=True) is None
    why = protocol.absence(None, 2.0)
    assert why is not None
    assert "left (died or stopped) and none has rejoined yet: restarting? ('e1')" in why
    assert join(protocol, "e1", b"p2", now=3.0) is protocol.select("e1", 3.0, wait_for_ready=True)


def test_with_engine_keys_the_key_the_shell_read_decides_the_id() -> None:
    key, other = "k" * 40, "o" * 40
    protocol = make_protocol(engine_keys={"e1": key})
    refused = feed(protocol, b"squat", hello("e1"), 0.0, other)
    assert isinstance(refused, EngineRefused)
    assert "bound to another CURVE key" in refused.message
    assert isinstance(feed(protocol, b"squat", hello("e1"), 0.0), EngineRefused)  # no key
    assert isinstance(feed(protocol, b"real", hello("e1"), 0.0, key), EngineJoined)


# -- counters (the only client counters: Prometheus reads them) -------------------------------


def test_the_machine_counts_calls_items_outcomes_events_and_heartbeats() -> None:
    protocol = make_protocol(stream_window=4)
    engine = join(protocol, "e1", b"p")
    unary = start(protocol, engine, now=1.0)
    stream = start(protocol, engine, stream=True, now=1.0)
    for i in range(2):
        feed(protocol, b"p", result(stream.call_id, i, K.STREAM_ITEM), 1.1)
    protocol.take_item(stream, 1.2)
    protocol.take_item(stream, 1.2)
    assert feed(protocol, b"p", error(unary.call_id), 1.5) is unary
    assert protocol.call_ended(unary, "REMOTE", 1.5)
    assert not protocol.call_ended(unary, "ok", 2.0)  # an end is counted once
    assert protocol.call_ended(stream, "cancelled", 3.0)
    feed(protocol, b"p", control(K.PONG, None, int(0.75e9)), 1.0)  # sent at 0.75 s
    sent(protocol)
    feed(protocol, b"p", bye(), 4.0)
    join(protocol, "e1", b"q", now=5.0)
    counters = protocol.counters.engines["e1"].snapshot()
    add, count = counters["methods"]["add"], counters["methods"]["count"]
    assert (add["calls"], add["items"], add["outcomes"]) == (1, 0, {"REMOTE": 1})
    assert add["duration_sum_s"] == pytest.approx(0.5)
    assert (count["calls"], count["items"], count["outcomes"]) == (1, 2, {"cancelled": 1})
    assert count["duration_sum_s"] == pytest.approx(2.0)
    assert counters["events"] == {"joined": 1, "lost": 1, "rejoined": 1}
    assert counters["heartbeat_rtt_sum_s"] == pytest.approx(0.25)
    assert sum(n for _, n in counters["heartbeat_rtt"]) == 1


def test_counters_keep_only_the_engine_ids_the_client_still_reports() -> None:
    protocol = make_protocol()
    for i in range(2 * MAX_PAST + 1):
        join(protocol, f"e{i}", b"p")
        feed(protocol, b"p", bye(), 0.0)
    kept = protocol.counters.engines
    assert len(kept) <= MAX_PAST + 1
    assert set(kept) <= set(protocol.engines.past)
    assert f"e{2 * MAX_PAST}" in kept
