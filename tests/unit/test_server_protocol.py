"""The engine's protocol machine, driven in memory with a fake clock: no sockets, no sleeps."""

from __future__ import annotations

import struct
from typing import cast

import pytest

from tensorrpc._exceptions import ErrorCode
from tensorrpc._machine import MAX_RELEASE_LEASES
from tensorrpc._protocol import (
    Bye,
    Flags,
    Hello,
    MessageKind,
    Reject,
    RejectReason,
    Release,
    pack_call_header,
    pack_reply_header,
    split_frames,
)
from tensorrpc._server_protocol import (
    ADMISSION,
    AllRejected,
    CallExpired,
    Released,
    ServerCall,
    SessionEnded,
    SessionStarted,
    SessionState,
    ShmPeer,
    readable_call_id,
)

from .server_helpers import PAYLOAD, SPEC, Engine

PING = MessageKind.PING
PONG = MessageKind.PONG
HELLO = MessageKind.HELLO
ERROR = MessageKind.ERROR


def cancelled(call: ServerCall) -> bool:
    return call.cancelled


def hello_of(engine: Engine) -> Hello:
    msg = engine.only(HELLO)
    assert isinstance(msg.body, Hello)
    return msg.body


# -- handshake and strangers ----------------------------------------------------------------


def test_a_stranger_ping_gets_one_hello_per_heartbeat_with_epoch_and_bound() -> None:
    engine = Engine.make(heartbeat_interval=1.0, dead_after=5.0)
    engine.control(b"c1", PING, None, 1)
    hello = hello_of(engine)
    assert hello.epoch == 1000
    assert hello.dead_after_ms == 5000
    engine.control(b"c1", PING, None, 1)
    assert engine.take() == []  # rate-limited
    engine.now += 1.0
    engine.control(b"c1", PING, None, 1)
    assert hello_of(engine).epoch == 1000  # same session, same epoch


def test_strangers_cost_a_bounded_table_and_are_forgotten_after_dead_after() -> None:
    engine = Engine.make(max_strangers=3, dead_after=2.0, heartbeat_interval=0.5)
    for i in range(5):
        engine.control(b"s%d" % i, PING, None, 1)
    assert len(engine.proto.sessions) == 3
    assert engine.proto.strangers_evicted == 2
    assert set(engine.proto.sessions) == {b"s2", b"s3", b"s4"}
    engine.advance(2.5)
    assert engine.proto.sessions == {}


def test_a_stranger_that_only_pongs_or_calls_gets_no_entry() -> None:
    engine = Engine.make()
    engine.control(b"x", PONG, None, 5)
    assert engine.take() == []
    engine.call(b"x", 9)
    assert engine.error(9).code == ErrorCode.PROTOCOL
    assert engine.proto.sessions == {}
    assert engine.proto.dropped == 2


def test_welcome_starts_the_session_and_announces_it() -> None:
    engine = Engine.make()
    engine.control(b"c1", PING, None, 1)
    engine.take()
    engine.welcome(b"c1", epoch=42, stream_window=3, dead_after_ms=900)
    session = engine.proto.sessions[b"c1"]
    assert session.state is SessionState.LIVE
    assert (session.client_epoch, session.stream_window, session.peer_dead_after_ms) == (
        42,
        3,
        900,
    )
    assert [type(e) for e in engine.events] == [SessionStarted]


def test_malformed_welcome_is_refused_with_the_reason() -> None:
    engine = Engine.make()
    engine.control(b"c1", PING, None, 1)
    engine.take()
    header = encode_welcome_header()
    engine.send(b"c1", [header, b"\x81\xa9client_id\x07"])  # client_id is not a string
    reject = engine.only(MessageKind.REJECT).body
    assert isinstance(reject, Reject)
    assert reject.reason == RejectReason.PROTOCOL
    assert "client_id" in reject.message
    assert engine.proto.sessions[b"c1"].state is SessionState.REJECTED
    engine.advance(engine.proto.settings.dead_after + 0.1)
    assert b"c1" not in engine.proto.sessions  # a stranger: forgotten after dead_after


def encode_welcome_header() -> bytes:
    return struct.pack("<2sBBHHQI", b"TR", 1, int(MessageKind.WELCOME), 0, 0, 0, 0)


def test_a_welcome_with_another_fingerprint_is_refused() -> None:
    engine = Engine.make()
    engine.control(b"c1", PING, None, 1)
    engine.take()
    engine.welcome(b"c1", fingerprint="0" * 64)
    reject = engine.only(MessageKind.REJECT).body
    assert isinstance(reject, Reject)
    assert reject.reason == RejectReason.FINGERPRINT
    assert f"fingerprint {'0' * 12}, engine's {SPEC.fingerprint[:12]})" in reject.message
    engine.control(b"c2", PING, None, 1)
    engine.take()
    engine.welcome(b"c2", fingerprint=SPEC.fingerprint)
    assert engine.proto.sessions[b"c2"].state is SessionState.LIVE


def test_a_repeated_welcome_is_harmless_and_a_new_epoch_starts_a_new_session() -> None:
    engine = Engine.make()
    engine.join(epoch=5)
    call = engine.call(b"c1", 1)
    assert call is not None
    engine.welcome(b"c1", epoch=5)
    assert not cancelled(call)
    engine.events.clear()
    engine.welcome(b"c1", epoch=6)
    assert cancelled(call)
    assert call in engine.events
    assert not engine.proto.may_reply(call)
    assert [type(e) for e in engine.events if not isinstance(e, ServerCall)] == [
        SessionEnded,
        SessionStarted,
    ]
    assert engine.proto.sessions[b"c1"].client_epoch == 6
    assert engine.take() == []  # no HELLO: the client already has our epoch


# -- liveness -------------------------------------------------------------------------------


@pytest.mark.parametrize("nonce", [0, 1, 2**64 - 1])
def test_a_ping_with_any_nonce_gets_a_pong_echoing_it(nonce: int) -> None:
    engine = Engine.make(listen=False)
    engine.proto.add_client("addr", engine.now)
    engine.advance(0)
    engine.take()
    engine.welcome("addr")
    engine.control("addr", PING, None, nonce)
    pong = engine.only(PONG)
    assert pong.header.call_id == nonce


def test_the_hello_request_gets_pong_and_the_same_hello() -> None:
    engine = Engine.make()
    engine.join()
    epoch = engine.proto.sessions[b"c1"].epoch
    engine.now += 1.0
    engine.control(b"c1", PING, None, 0)
    sent = engine.take()
    assert [s.kind for s in sent] == [PONG, HELLO]
    assert sent[0].header.call_id == 0
    assert isinstance(sent[1].body, Hello)
    assert sent[1].body.epoch == epoch


def test_pings_alone_keep_a_session_alive() -> None:
    engine = Engine.make(heartbeat_interval=0.5, dead_after=2.0)
    engine.join()
    for _ in range(10):  # 5 s of PINGs only: 2.5 times the bound
        engine.now += 0.5
        engine.control(b"c1", PING, None, 1)
        engine.advance(0)
    assert engine.proto.sessions[b"c1"].state is SessionState.LIVE


def test_a_silent_client_loses_its_session_and_calls_and_gets_a_new_epoch() -> None:
    engine = Engine.make(heartbeat_interval=0.5, dead_after=2.0)
    engine.join()
    old_epoch = engine.proto.sessions[b"c1"].epoch
    call = engine.call(b"c1", 1)
    assert call is not None
    engine.advance(2.1)
    assert call.cancelled
    assert not engine.proto.may_reply(call)
    ended = [e for e in engine.events if isinstance(e, SessionEnded)]
    assert ended
    assert ended[0].warn
    # As in the dial-in topology: a HELLO of a new session goes at once.
    new_epoch = hello_of(engine).epoch
    assert new_epoch != old_epoch
    states = [engine.proto.sessions[b"c1"].state]
    engine.take()
    engine.call(b"c1", 2)
    assert engine.error(2).code == ErrorCode.PROTOCOL
    engine.welcome(b"c1", epoch=8)  # the client welcomes the new session
    states.append(engine.proto.sessions[b"c1"].state)
    assert states == [SessionState.GREETING, SessionState.LIVE]


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "dial-in"])
def test_no_session_is_found_silent_before_silent_at(listen: bool) -> None:
    # The shell takes what its sockets hold before a tick at or past silent_at (rule 2):
    # a tick before it must end no session, and the first session moves it from never.
    engine = Engine.make(listen=listen, heartbeat_interval=0.5, dead_after=2.0)
    assert engine.proto.silent_at == float("inf")
    key: object = b"c1"
    if listen:
        engine.join()
    else:
        key = "addr"
        engine.proto.add_client(key, engine.now)
        engine.advance(0)
        engine.welcome(key)
    assert engine.proto.silent_at == engine.now + 2.0  # set by the WELCOME itself
    for _ in range(3):  # PINGs heard: the next tick finds the bound later
        engine.advance(0.9)
        engine.control(key, PING, None, 1)
    heard = engine.now
    engine.advance(0.1)
    assert engine.proto.silent_at == heard + 2.0
    engine.advance(engine.proto.silent_at - engine.now - 1e-6)  # just before it: alive
    assert engine.proto.sessions[key].state is SessionState.LIVE
    engine.advance(0.01)  # past it, nothing heard: silent
    assert engine.proto.sessions[key].state is SessionState.GREETING
    assert engine.proto.silent_at == float("inf")


def test_dial_in_silence_greets_again_at_once_with_a_new_epoch() -> None:
    engine = Engine.make(listen=False, heartbeat_interval=0.5, dead_after=2.0)
    engine.proto.add_client("addr", engine.now)
    engine.advance(0)
    first = hello_of(engine).epoch
    engine.welcome("addr")
    engine.advance(2.1)
    hellos = [s for s in engine.take() if s.kind is HELLO]
    assert len(hellos) == 1
    assert isinstance(hellos[0].body, Hello)
    assert hellos[0].body.epoch != first
    assert engine.proto.sessions["addr"].state is SessionState.GREETING


def test_the_engine_pings_often_enough_for_the_clients_bound() -> None:
    engine = Engine.make(heartbeat_interval=1.0, dead_after=5.0)
    engine.join(dead_after_ms=300)
    pings = 0
    for _ in range(100):
        engine.advance(0.01)
        pings += sum(1 for s in engine.take() if s.kind is PING)
    assert pings >= 3 * 1.0 / 0.3 - 1  # at least 3 per 300 ms over one second
    assert engine.proto.wake_at - engine.now <= 0.1 + 1e-9


def test_dial_in_hello_backs_off_while_not_connected() -> None:
    engine = Engine.make(listen=False, heartbeat_interval=1.0)
    engine.proto.add_client("addr", engine.now)
    engine.advance(0)
    assert engine.take()[0].hello
    hello = engine.proto.sessions["addr"].hello_frames
    engine.proto.send_failed("addr", hello, engine.now)
    assert engine.proto.wake_at == pytest.approx(engine.now + 0.05)
    engine.advance(0.05)
    assert engine.kinds() == [HELLO]
    engine.proto.send_failed("addr", hello, engine.now)
    assert engine.proto.wake_at == pytest.approx(engine.now + 0.1)
    assert engine.proto.dropped == 0  # a HELLO that could not go yet is no drop


# -- BYE and REJECT -------------------------------------------------------------------------


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "dial-in"])
def test_a_clients_bye_ends_the_session_and_no_hello_follows_until_it_speaks(
    listen: bool,
) -> None:
    # Both topologies alike (issue 23): BYE parts, silence until the client speaks, then
    # a HELLO of a new session.
    engine = Engine.make(listen=listen, heartbeat_interval=0.5, dead_after=2.0)
    key: object = b"c1" if listen else "addr"
    if listen:
        engine.control(key, PING, None, 1)
    else:
        engine.proto.add_client(key, engine.now)
        engine.advance(0)
    first = hello_of(engine).epoch
    engine.take()
    engine.welcome(key)
    call = engine.call(key, 1)
    assert call is not None
    engine.control(key, MessageKind.BYE, Bye("closed"))
    assert call.cancelled
    assert engine.proto.sessions[key].state is SessionState.PARTED
    engine.advance(1.0)
    assert engine.take() == []
    engine.control(key, PING, None, 1)
    assert hello_of(engine).epoch not in (0, first)


def test_a_parted_dial_in_client_is_greeted_again_after_dead_after() -> None:
    engine = Engine.make(listen=False, heartbeat_interval=0.5, dead_after=2.0)
    engine.proto.add_client("addr", engine.now)
    engine.advance(0)
    engine.welcome("addr")
    engine.take()
    engine.control("addr", MessageKind.BYE, Bye("closed"))
    engine.advance(2.1)
    assert engine.kinds() == [HELLO]


def test_every_client_refusing_a_dial_in_engine_is_fatal() -> None:
    engine = Engine.make(listen=False)
    for key in ("a", "b"):
        engine.proto.add_client(key, engine.now)
    engine.advance(0)
    engine.take()
    engine.control("a", MessageKind.REJECT, Reject("fingerprint", "x != y"))
    assert not [e for e in engine.events if isinstance(e, AllRejected)]
    engine.control("b", MessageKind.REJECT, Reject("service", "s != t"))
    fatal = [e for e in engine.events if isinstance(e, AllRejected)]
    assert len(fatal) == 1
    assert "x != y" in fatal[0].message
    assert "s != t" in fatal[0].message
    engine.advance(10)
    assert engine.take() == []  # refused: no more HELLOs


# -- admission -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "fault"),
    [
        (
            struct.pack("<2sBBHHQI", b"TR", 1, 4, 0x200, 0, 11, 0) + b"add",
            "unknown flag bits 0x200",
        ),
        (struct.pack("<2sBBHHQI", b"TR", 1, 4, 0, 3, 11, 0) + b"add", "reserved"),
        (struct.pack("<2sBBHHQI", b"TR", 1, 4, 0, 0, 11, 0), "without a method name"),
        (struct.pack("<2sBBHHQI", b"TR", 2, 4, 0, 0, 11, 0) + b"add", "version 2"),
        (struct.pack("<2sBBHHQI", b"TR", 1, 4, 0, 0, 11, 0) + b"\xff", "UTF-8"),
    ],
)
def test_every_readable_call_id_gets_a_protocol_error_naming_the_fault(
    frame: bytes, fault: str
) -> None:
    engine = Engine.make()
    engine.join()
    assert readable_call_id(frame) == 11
    engine.send(b"c1", [frame, PAYLOAD])
    error = engine.error(11)
    assert error.code == ErrorCode.PROTOCOL
    assert fault in error.message


def test_a_malformed_message_without_a_call_id_is_dropped_silently() -> None:
    engine = Engine.make()
    engine.join()
    engine.send(b"c1", [b"garbage", b""])
    assert engine.take() == []
    assert engine.proto.dropped == 1


def test_a_reused_call_id_cancels_the_original_and_gets_one_protocol_error() -> None:
    engine = Engine.make()
    engine.join()
    original = engine.call(b"c1", 5)
    assert original is not None
    assert engine.call(b"c1", 5) is None
    error = engine.error(5)
    assert error.code == ErrorCode.PROTOCOL
    assert "already in flight" in error.message
    assert original.cancelled
    assert original in engine.events
    assert not engine.proto.may_reply(original)
    assert not engine.proto.error_reply(original, ErrorCode.REMOTE, "late")


def test_the_admission_table_names_every_refusal_in_order() -> None:
    assert [code for _, code in ADMISSION] == [
        ErrorCode.PROTOCOL,
        ErrorCode.PROTOCOL,
        ErrorCode.PROTOCOL,
        ErrorCode.PROTOCOL,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.DRAINING,
        ErrorCode.METHOD_NOT_FOUND,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.OVERLOADED,
        ErrorCode.OVERLOADED,
    ]


def test_admission_refusals_have_their_codes() -> None:
    engine = Engine.make(max_concurrency=1, max_queued=1)
    engine.join()
    engine.call(b"c1", 1, "nope")
    assert engine.error(1).code == ErrorCode.METHOD_NOT_FOUND
    engine.call(b"c1", 2, "add", int(Flags.STREAM))
    assert engine.error(2).code == ErrorCode.INVALID_ARGUMENT
    engine.call(b"c1", 3, "count")
    assert engine.error(3).code == ErrorCode.INVALID_ARGUMENT
    assert engine.call(b"c1", 4) is not None
    engine.call(b"c1", 5, flags=int(Flags.NO_WAIT))
    assert "busy" in engine.error(5).message
    assert engine.call(b"c1", 6) is not None
    engine.call(b"c1", 7)
    assert "full" in engine.error(7).message
    assert engine.proto.overloaded == 2
    engine.proto.start_drain()
    engine.call(b"c1", 8)
    assert engine.error(8).code == ErrorCode.DRAINING


def test_a_call_before_welcome_is_refused() -> None:
    engine = Engine.make()
    engine.control(b"c1", PING, None, 1)
    engine.take()
    engine.call(b"c1", 3)
    assert engine.error(3).code == ErrorCode.PROTOCOL


def test_deadline_is_relative_to_receipt_on_the_protocol_clock() -> None:
    engine = Engine.make()
    engine.join()
    call = engine.call(b"c1", 1, timeout_ms=250)
    assert call is not None
    assert call.deadline == pytest.approx(engine.now + 0.25)
    untimed = engine.call(b"c1", 2)
    assert untimed is not None
    assert untimed.deadline == float("inf")


def test_in_flight_counts_follow_the_call_table() -> None:
    engine = Engine.make()
    engine.join()
    calls = [engine.call(b"c1", i) for i in range(1, 4)]
    proto = engine.proto
    assert proto.in_flight() == len(proto.sessions[b"c1"].calls) == 3
    taken = proto.next_call()
    assert taken is not None
    assert taken is calls[0]
    assert proto.busy == 1
    assert proto.in_flight() == 3
    proto.done(taken, engine.now)
    assert proto.in_flight() == len(proto.sessions[b"c1"].calls) == 2


def test_a_final_reply_is_handed_out_once_and_never_after_cancel() -> None:
    engine = Engine.make()
    engine.join()
    call = engine.call(b"c1", 1)
    other = engine.call(b"c1", 2)
    assert call is not None
    assert other is not None
    assert engine.proto.may_reply(call)
    assert not engine.proto.may_reply(call)
    engine.control(b"c1", MessageKind.CANCEL, None, 2)
    assert other.cancelled
    assert not engine.proto.error_reply(other, ErrorCode.REMOTE, "x")


# -- streams --------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 1, 4])
def test_a_stream_sends_at_most_window_plus_credit(window: int) -> None:
    engine = Engine.make()
    engine.join(stream_window=window)
    call = engine.call(b"c1", 1, "count", int(Flags.STREAM))
    assert call is not None
    proto = engine.proto
    sent = 0
    granted = 0
    for credit in (0, 2, 0, 3, 1):
        if credit:
            engine.credit(b"c1", 1, credit)
            granted += credit
        while proto.may_send_item(call):
            assert proto.stream_item(call, b"\xc0", ())
            sent += 1
        assert sent == window + granted
    assert call.credits == 0


def test_credit_wakes_a_parked_stream_and_parked_streams_are_capped_per_client() -> None:
    engine = Engine.make(max_parked_streams=1)
    engine.join(stream_window=0)
    first = engine.call(b"c1", 1, "count", int(Flags.STREAM))
    second = engine.call(b"c1", 2, "count", int(Flags.STREAM))
    assert first is not None
    assert second is not None
    proto = engine.proto
    for call in (first, second):
        assert proto.next_call() is call
    assert proto.park(first) is None
    assert proto.busy == 1  # a parked stream holds no worker
    reason = proto.park(second)
    assert reason is not None
    assert "waiting for credit" in reason
    engine.credit(b"c1", 1, 2)
    assert first in engine.events
    proto.unpark(first)
    assert proto.busy == 2
    assert proto.may_send_item(first)


def test_release_is_passed_on() -> None:
    engine = Engine.make()
    engine.join()
    engine.control(b"c1", MessageKind.RELEASE, Release((3, 4)))
    released = [e for e in engine.events if isinstance(e, Released)]
    assert released[0].leases == (3, 4)


def test_lease_ids_in_a_call_header_are_passed_on_whatever_becomes_of_the_call() -> None:
    engine = Engine.make(max_concurrency=1, max_queued=0)
    engine.join()
    header = pack_call_header(1, "add", releases=(5, 6))
    assert engine.send(b"c1", [header, PAYLOAD]) is not None
    # Refused (the engine is full): the leases it returns still count.
    full = pack_call_header(2, "add", int(Flags.NO_WAIT), releases=(7,))
    assert engine.send(b"c1", [full, PAYLOAD]) is None
    assert engine.error(2).code == ErrorCode.OVERLOADED
    released = [e.leases for e in engine.events if isinstance(e, Released)]
    assert released == [(5, 6), (7,)]


def test_lease_ids_in_a_call_outside_a_session_free_nothing() -> None:
    engine = Engine.make()
    engine.send(b"stranger", [pack_call_header(1, "add", releases=(5,)), PAYLOAD])
    assert not [e for e in engine.events if isinstance(e, Released)]


# -- drain ----------------------------------------------------------------------------------


def test_drain_stops_calls_and_says_bye_to_every_session_not_refused() -> None:
    engine = Engine.make()
    engine.join(b"c1")
    engine.control(b"c2", PING, None, 1)
    engine.take()
    call = engine.call(b"c1", 1)
    assert call is not None
    engine.proto.start_drain()
    engine.proto.stop_all()
    engine.collect()
    assert call.shutdown
    assert call in engine.events
    engine.proto.goodbye()
    engine.collect()
    assert sorted(cast("bytes", s.key) for s in engine.take() if s.kind is MessageKind.BYE) == [
        b"c1",
        b"c2",
    ]
    engine.control(b"c3", PING, None, 1)
    assert engine.take() == []  # no new sessions while draining


def test_pack_call_header_round_trips_through_readable_call_id() -> None:
    assert readable_call_id(pack_call_header(77, "add")) == 77
    assert readable_call_id(b"short") is None


# -- torch_shm argument leases ----------------------------------------------------------------


def shm_call(engine: Engine, call_id: int, leases: tuple[int, ...]) -> ServerCall:
    """A live session with torch_shm; a call a worker took whose arguments resolved."""
    if b"c1" not in engine.proto.sessions:
        engine.join()
        engine.proto.shm_decided(engine.proto.sessions[b"c1"], ShmPeer(9, True, True))
    call = engine.call(b"c1", call_id)
    assert call is not None
    assert engine.proto.next_call() is call
    call.take_args()
    engine.proto.args_resolved(call, leases)
    assert call.keep is not None  # detach before the first reply
    return call


def releases(engine: Engine) -> list[tuple[int, ...]]:
    engine.collect()
    return [s.body.leases for s in engine.take() if s.kind is MessageKind.RELEASE]


def test_a_cancelled_call_that_ends_without_a_reply_releases_its_argument_leases() -> None:
    engine = Engine.make()
    call = shm_call(engine, 1, (3, 4))
    engine.control(b"c1", MessageKind.CANCEL, None, 1)
    assert cancelled(call)
    engine.proto.args_done(call)
    assert call.keep is None
    assert releases(engine) == [(3, 4)]
    engine.proto.done(call, engine.now)


def test_a_reply_ends_the_argument_leases_and_owes_no_release() -> None:
    engine = Engine.make()
    call = shm_call(engine, 1, (3,))
    assert engine.proto.result(call, b"\x01", ())
    assert call.keep is None
    call.cancelled = True  # a CANCEL that crossed the RESULT
    engine.proto.args_done(call)
    assert releases(engine) == []


def test_a_call_of_an_ended_session_owes_no_release() -> None:
    engine = Engine.make()
    call = shm_call(engine, 1, (3,))
    engine.control(b"c1", MessageKind.BYE, Bye("closed"))
    ended = [e for e in engine.events if isinstance(e, SessionEnded)]
    assert ended[-1].shm == ShmPeer(9, True, True)  # for the shell to free what it shared
    engine.proto.args_done(call)
    assert releases(engine) == []


def test_the_leases_of_arguments_never_decoded_are_released_in_protocol_sized_chunks() -> None:
    engine = Engine.make()
    engine.join()
    engine.proto.shm_decided(engine.proto.sessions[b"c1"], ShmPeer(9, True, True))
    call = engine.call(b"c1", 1)
    assert call is not None
    engine.control(b"c1", MessageKind.CANCEL, None, 1)
    unread = tuple(range(1, MAX_RELEASE_LEASES + 3))
    engine.proto.args_done(call, unread)
    assert call.payload is None
    assert releases(engine) == [unread[:MAX_RELEASE_LEASES], unread[MAX_RELEASE_LEASES:]]


def test_reply_frames_are_built_and_counted_by_the_protocol() -> None:
    engine = Engine.make()
    engine.join()
    call = engine.call(b"c1", 1, "count", int(Flags.STREAM))
    assert call is not None
    session = engine.proto.sessions[b"c1"]
    before = session.bytes_out
    assert engine.proto.stream_item(call, b"\x01", [b"abcd"])
    [(key, item)] = engine.proto.frames_to_send()  # queued like every other frame
    header = split_frames(item)[0]
    assert (key, header.kind, header.call_id) == (b"c1", MessageKind.STREAM_ITEM, 1)
    assert session.bytes_out == before + 20 + 1 + 4
    call.credits = 0
    assert not engine.proto.stream_item(call, b"\x01", ())  # no credit: nothing
    assert not engine.proto.pending
    assert engine.proto.stream_end(call)
    assert engine.kinds() == []
    engine.collect()
    assert engine.kinds() == [MessageKind.STREAM_END]
    assert not engine.proto.stream_end(call)  # once
    engine.proto.send_failed(b"c1", item, engine.now)  # it could not go after all
    assert engine.proto.dropped == 1


# -- queued deadlines (issue 21 item 4) -------------------------------------------------------


def test_an_accepted_call_is_the_event_and_the_machine_moves_its_timer() -> None:
    engine = Engine.make()
    engine.join()
    engine.advance(0.0)
    before = engine.proto.wake_at
    engine.proto.receive(b"c1", [pack_call_header(1, "add", 0, 100), PAYLOAD], engine.now)
    [call] = engine.proto.next_events()  # no event object on the hot path: the call itself
    assert isinstance(call, ServerCall)
    assert call.deadline == pytest.approx(engine.now + 0.1)
    assert engine.proto.wake_at == call.deadline < before  # not the shell's to write


def test_a_queued_call_is_answered_when_its_deadline_passes_not_when_taken() -> None:
    engine = Engine.make(max_concurrency=1)
    engine.join()
    proto = engine.proto
    busy = engine.call(b"c1", 1)
    assert proto.next_call() is busy  # the only worker is busy from now on
    start = engine.now
    early = engine.call(b"c1", 2, timeout_ms=100)
    later = engine.call(b"c1", 3, timeout_ms=500)
    untimed = engine.call(b"c1", 4)
    assert proto.tick(engine.now) == pytest.approx(start + 0.1)  # its timer
    engine.advance(0.099)
    assert engine.take() == []
    engine.advance(0.001)
    info = engine.error(2)
    assert info.code == ErrorCode.DEADLINE_EXCEEDED
    assert "waited in the queue past its deadline" in info.message
    assert [e.call for e in engine.events if isinstance(e, CallExpired)] == [early]
    assert list(proto.queue) == [later, untimed]
    assert 2 not in proto.sessions[b"c1"].calls
    assert proto.in_flight() == 3
    assert proto.wake_at == pytest.approx(start + 0.5)
    engine.advance(0.4)
    assert engine.error(3).code == ErrorCode.DEADLINE_EXCEEDED
    assert list(proto.queue) == [untimed]
    assert proto.calls.expiry == float("inf")


def test_a_cancelled_queued_call_is_left_to_its_worker() -> None:
    engine = Engine.make(max_concurrency=1)
    engine.join()
    proto = engine.proto
    busy = engine.call(b"c1", 1)
    assert proto.next_call() is busy
    queued = engine.call(b"c1", 2, timeout_ms=100)
    assert queued is not None
    engine.control(b"c1", MessageKind.CANCEL, None, 2)
    assert queued.cancelled
    engine.advance(0.2)
    assert engine.take() == []  # no reply to a cancelled call
    assert list(proto.queue) == [queued]  # its worker ends it (and releases its leases)
    assert proto.wake_at > engine.now  # no timer spinning on it


# -- duplicate ids (issue 21 item 5) ----------------------------------------------------------


def test_a_duplicate_id_refusal_is_retried_with_backoff_not_final() -> None:
    engine = Engine.make(listen=False, heartbeat_interval=0.5, dead_after=2.0)
    proto = engine.proto
    proto.add_client("addr", engine.now)
    engine.advance(0)
    assert engine.kinds() == [HELLO]
    delays = []
    for _ in range(4):
        start = engine.now
        engine.control("addr", MessageKind.REJECT, Reject(RejectReason.DUPLICATE_ID, "held"))
        ended = [e for e in engine.events if isinstance(e, SessionEnded)]
        assert ended[-1].warn
        assert "duplicate_id: held; HELLO again in" in ended[-1].why
        assert not any(isinstance(e, AllRejected) for e in engine.events)
        assert proto.sessions["addr"].state is SessionState.GREETING
        engine.events.clear()
        delay = proto.sessions["addr"].next_hello - start
        assert proto.wake_at <= start + delay
        delays.append(delay)
        engine.advance(delay - 0.01)
        assert HELLO not in engine.kinds()
        engine.advance(0.02)
        assert engine.kinds() == [HELLO]
    assert delays == pytest.approx([0.5, 1.0, 2.0, 2.0])  # doubling, capped at dead_after
    engine.welcome("addr")  # the holder is gone: the client takes us
    assert proto.sessions["addr"].state is SessionState.LIVE
    assert proto.sessions["addr"].duplicate_backoff is None


def test_other_refusals_stay_final() -> None:
    engine = Engine.make(listen=False)
    engine.proto.add_client("addr", engine.now)
    engine.advance(0)
    engine.take()
    engine.control("addr", MessageKind.REJECT, Reject(RejectReason.FINGERPRINT, "no"))
    assert any(isinstance(e, AllRejected) for e in engine.events)


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([pack_reply_header(MessageKind.CREDIT, 3), b"\x81\xa1n\x00"], id="credit-0"),
        pytest.param([pack_reply_header(MessageKind.CANCEL, 3), b"", b"extra"], id="cancel-3"),
    ],
)
def test_a_malformed_message_about_a_call_ends_it_with_one_protocol_error(
    frames: list[bytes],
) -> None:
    # One rule (docs/protocol.md §11): CREDIT n=0 and a CANCEL with extra frames name a
    # call, so they are answered like a malformed CALL, not dropped in silence.
    engine = Engine.make()
    engine.join()
    call = engine.call(b"c1", 3, "count", flags=int(Flags.STREAM))
    assert call is not None
    engine.send(b"c1", frames)
    assert engine.error(3).code == ErrorCode.PROTOCOL
    assert call.cancelled
    assert not engine.proto.may_reply(call)  # the ERROR was its one reply
