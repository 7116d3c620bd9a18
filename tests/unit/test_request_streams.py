"""Request streams (client streaming, bidirectional) at the protocol layer: the machines
and `tensorrpc._streams`, without sockets (rules cited from the module docstring)."""

from __future__ import annotations

import struct
from dataclasses import replace

import ormsgpack
import pytest

from tensorrpc import _streams
from tensorrpc._calls import Call, CallState
from tensorrpc._client_events import LeasesFreed
from tensorrpc._client_leases import take_item_leases
from tensorrpc._client_protocol import ClientProtocol
from tensorrpc._exceptions import ErrorCode, LocalProtocolError, RemoteProtocolError
from tensorrpc._protocol import (
    Bye,
    Credit,
    Flags,
    Hello,
    MessageKind,
    Release,
    decode_control,
    encode_control,
    split_frames,
)
from tensorrpc._server_calls import ServerCall
from tensorrpc._server_protocol import ShmPeer

from .client_script import ADD, CHAT, UPLOAD, control, feed, join, make_protocol, result, sent
from .server_helpers import Engine, make_hello

K = MessageKind
KEY = b"c1"


def live_engine(window: int = 4) -> Engine:
    """An engine whose HELLO announces ``window`` for request streams, with a client."""
    engine = Engine.make(hello=replace(make_hello(), stream_window=window))
    engine.join()
    return engine


# -- the engine's rows --------------------------------------------------------------------


def test_items_within_the_window_are_buffered_and_credit_returns_as_the_handler_takes() -> None:
    engine = live_engine(window=4)
    call = engine.open_upload(KEY, 1)
    for i in range(4):
        engine.item(KEY, 1, bytes([i]))
    assert engine.take() == []
    stream = call.request
    assert stream is not None
    assert stream.credit == 0
    assert len(stream.items) == 4
    # Half the window taken: CREDIT(2) goes back (rule 1).
    assert _streams.take_item(engine.proto, call) == (b"\x00", [])
    assert engine.kinds() == []
    assert _streams.take_item(engine.proto, call) == (b"\x01", [])
    engine.collect()
    [credit] = engine.take()
    assert (credit.kind, credit.header.call_id, credit.body) == (K.CREDIT, 1, Credit(2))
    assert stream.credit == 2


def test_an_item_beyond_the_credit_ends_the_call_with_a_protocol_error() -> None:
    engine = live_engine(window=2)
    call = engine.open_upload(KEY, 1)
    engine.item(KEY, 1)
    engine.item(KEY, 1)
    engine.item(KEY, 1)  # rule 2: past window + credit
    info = engine.error(1)
    assert info.code == ErrorCode.PROTOCOL
    assert "stream_window and CREDIT" in info.message
    assert call.cancelled
    assert call in engine.events  # its worker is woken to stop it


def test_items_and_a_second_end_after_the_half_close_are_protocol_errors() -> None:
    engine = live_engine()
    engine.open_upload(KEY, 1)
    engine.half_close(KEY, 1)
    engine.item(KEY, 1)
    assert "after the request stream's STREAM_END" in engine.error(1).message
    engine.open_upload(KEY, 2)
    engine.half_close(KEY, 2)
    engine.half_close(KEY, 2)
    assert "second STREAM_END" in engine.error(2).message


@pytest.mark.parametrize("method", ["add", "count"])
def test_an_item_for_a_call_whose_request_is_not_a_stream_is_a_protocol_error(
    method: str,
) -> None:
    engine = live_engine()
    flags = int(Flags.STREAM) if method == "count" else 0
    call = engine.call(KEY, 1, method, flags)
    assert call is not None
    engine.take()
    engine.item(KEY, 1)
    assert "whose request is not a stream" in engine.error(1).message
    assert call.cancelled


def test_items_for_a_call_id_not_in_flight_are_dropped_and_counted() -> None:
    engine = live_engine()
    before = engine.proto.dropped
    engine.item(KEY, 42)
    engine.half_close(KEY, 43)
    assert engine.take() == []
    assert engine.proto.dropped == before + 2  # rule 3


def test_a_malformed_item_that_names_a_call_is_answered_by_the_one_rule() -> None:
    engine = live_engine()
    call = engine.open_upload(KEY, 1)
    bad = struct.pack("<2sBBHHQI", b"TR", 1, int(K.STREAM_ITEM), 1, 0, 1, 0)  # a flag bit
    engine.send(KEY, [bad, b"\x01"])
    assert engine.error(1).code == ErrorCode.PROTOCOL
    assert call.cancelled


@pytest.mark.parametrize(
    ("method", "flags", "refused"),
    [
        ("upload", 0, True),
        ("upload", int(Flags.REQUEST_STREAM), False),
        ("upload", int(Flags.REQUEST_STREAM | Flags.STREAM), True),
        ("chat", int(Flags.REQUEST_STREAM), True),
        ("chat", int(Flags.REQUEST_STREAM | Flags.STREAM), False),
        ("add", int(Flags.REQUEST_STREAM), True),
    ],
)
def test_admission_checks_both_stream_flags(method: str, flags: int, refused: bool) -> None:
    engine = live_engine()
    call = engine.call(KEY, 1, method, flags)
    if refused:
        assert call is None
        info = engine.error(1)
        assert info.code == ErrorCode.INVALID_ARGUMENT
        assert "must be called as" in info.message
    else:
        assert call is not None
        assert call.request is not None


def test_the_handler_waiting_for_an_item_is_woken_by_it_and_by_the_half_close() -> None:
    engine = live_engine()
    call = engine.open_upload(KEY, 1)
    stream = call.request
    assert stream is not None

    class Waiter:
        woken = 0

        def set(self) -> None:
            self.woken += 1

    waiter = stream.waiter = Waiter()
    engine.events.clear()
    engine.item(KEY, 1)
    assert engine.events == [call]
    call.wake()
    engine.half_close(KEY, 1)
    call.wake()
    assert waiter.woken == 2
    assert _streams.take_item(engine.proto, call) is not None
    assert stream.done


def test_no_credit_is_granted_after_the_half_close() -> None:
    stream = _streams.RequestStream(2)
    assert stream.push(b"a", ()) is None
    assert stream.push(b"b", ()) is None
    assert stream.end() is None
    assert stream.take() == ((b"a", ()), 0)
    assert stream.take() == ((b"b", ()), 0)
    assert stream.take() == (None, 0)


def test_hello_names_only_methods_as_request_streaming() -> None:
    bad = Hello(
        engine_id="e", service="s", fingerprint="f", protocol_version=1, host_id="h", pid=1,
        methods=("m",), signatures=("m()",), request_streaming=("x",),
    )  # fmt: skip
    with pytest.raises(LocalProtocolError, match="request_streaming names 1 entries"):
        encode_control(K.HELLO, bad)
    good = encode_control(K.HELLO, replace(bad, request_streaming=("m",)))
    wire = ormsgpack.unpackb(good[1])
    wire["request_streaming"] = ["x"]
    header, _, _ = split_frames(good)
    with pytest.raises(RemoteProtocolError, match="request_streaming names 1 entries"):
        decode_control(header, ormsgpack.packb(wire))
    wire["request_streaming"] = ["m"]
    wire["stream_window"] = 0
    with pytest.raises(RemoteProtocolError, match="stream_window must be at least 1"):
        decode_control(header, ormsgpack.packb(wire))
    del wire["request_streaming"]
    with pytest.raises(RemoteProtocolError, match="missing the field 'request_streaming'"):
        decode_control(header, ormsgpack.packb(wire))


# -- the client's side --------------------------------------------------------------------


def open_client(window: int = 3) -> tuple[ClientProtocol, Call]:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p", stream_window=window)
    flags = int(Flags.REQUEST_STREAM)
    call = protocol.start_call(engine, UPLOAD, object(), stream=False, now=0.0, flags=flags)
    protocol.frames_to_send()  # the CALL
    return protocol, call


def test_the_client_sends_at_most_the_window_then_waits_for_credit() -> None:
    protocol, call = open_client(window=3)
    for _ in range(3):
        assert _streams.send_item(protocol, call, b"\x01", (), 0.0)
    assert not _streams.send_item(protocol, call, b"\x01", (), 0.0)  # rule 1
    event = feed(protocol, b"p", control(K.CREDIT, Credit(2), call.call_id), 0.1)
    assert event == _streams.CreditGranted(call)
    assert _streams.send_item(protocol, call, b"\x01", (), 0.1)
    assert call.request is not None
    assert call.request.sent == 4


def test_nothing_is_sent_for_a_request_stream_after_its_call_ended() -> None:
    protocol, call = open_client()
    feed(protocol, b"p", result(call.call_id, 5), 0.1)
    assert call.state is CallState.REPLIED
    assert not _streams.send_item(protocol, call, b"\x01", (), 0.1)  # rule 4
    assert not _streams.half_close(protocol, call, 0.1)
    assert sent(protocol) == []


def test_the_half_close_goes_once_and_ends_the_items() -> None:
    protocol, call = open_client()
    assert _streams.half_close(protocol, call, 0.0)
    assert not _streams.half_close(protocol, call, 0.0)
    assert [s.kind for s in sent(protocol)] == [K.STREAM_END]
    assert not _streams.send_item(protocol, call, b"\x01", (), 0.0)


def test_credit_for_an_unknown_call_or_a_call_without_a_request_stream_is_dropped() -> None:
    protocol = make_protocol()
    engine = join(protocol, "e1", b"p")
    assert feed(protocol, b"p", control(K.CREDIT, Credit(1), 77), 0.0) is None
    chat = protocol.start_call(engine, CHAT, object(), stream=True, now=0.0)
    assert chat.request is not None  # both ways
    assert chat.credit is not None
    unary = protocol.start_call(engine, ADD, object(), stream=False, now=0.0)
    assert unary.request is None
    assert feed(protocol, b"p", control(K.CREDIT, Credit(1), unary.call_id), 0.0) is None
    zero = encode_control(K.CREDIT, Credit(1), chat.call_id)
    zero[1] = b"\x81\xa1n\x00"  # n = 0: malformed, dropped
    assert not isinstance(feed(protocol, b"p", zero, 0.0), _streams.CreditGranted)


# -- rule 6: torch_shm item leases end with the call ----------------------------------------


def shm_upload(method: str = "upload") -> tuple[Engine, ServerCall]:
    """A live torch_shm session and a request stream whose handler took it."""
    engine = live_engine(window=4)
    engine.proto.shm_decided(engine.proto.sessions[KEY], ShmPeer(9, True, True))
    return engine, engine.open_upload(KEY, 1, method)


def held_by(stream: _streams.RequestStream) -> tuple[object, list[int]]:
    """What the engine holds of a request stream's item leases (its detach key, leases)."""
    return stream.keep, stream.leases


def releases(engine: Engine) -> list[tuple[int, ...]]:
    engine.collect()
    return [s.body.leases for s in engine.take() if s.kind is K.RELEASE]


@pytest.mark.parametrize("reply", ["result", "stream_end", "error"])
def test_the_final_reply_ends_every_item_lease_and_owes_no_release(reply: str) -> None:
    engine, call = shm_upload("chat" if reply == "stream_end" else "upload")
    for _ in range(2):
        engine.item(KEY, 1)
        assert _streams.take_item(engine.proto, call) is not None
    engine.proto.items_resolved(call, (3,))
    engine.proto.items_resolved(call, (4, 5))
    stream = call.request
    assert stream is not None
    assert stream.keep == (engine.proto.sessions[KEY], 1, "items")  # for the shell's detach
    assert stream.leases == [3, 4, 5]
    # A response item is not the final reply: the items' leases stay (unlike arguments').
    if reply == "stream_end":
        assert engine.proto.stream_item(call, b"\x01", ())
        assert stream.leases == [3, 4, 5]
        assert engine.proto.stream_end(call)
    elif reply == "result":
        assert engine.proto.result(call, b"\x01", ())
    else:
        assert engine.proto.error_reply(call, ErrorCode.REMOTE, "boom")
    assert held_by(stream) == (None, [])
    call.cancelled = True  # a CANCEL that crossed the final reply
    engine.proto.args_done(call)
    assert releases(engine) == []


def test_a_cancelled_request_stream_releases_the_items_it_decoded_and_never_took() -> None:
    engine, call = shm_upload()
    engine.item(KEY, 1)
    assert _streams.take_item(engine.proto, call) is not None
    engine.proto.items_resolved(call, (3, 4))
    engine.item(KEY, 1)  # buffered, never taken: the shell reads its lease ids
    engine.control(KEY, K.CANCEL, None, 1)
    assert call.cancelled
    engine.proto.args_done(call, (), [7])
    assert releases(engine) == [(3, 4, 7)]
    stream = call.request
    assert stream is not None
    assert held_by(stream) == (None, [])


def test_a_request_stream_of_an_ended_session_owes_no_release() -> None:
    engine, call = shm_upload()
    engine.item(KEY, 1)
    assert _streams.take_item(engine.proto, call) is not None
    engine.proto.items_resolved(call, (3,))
    engine.control(KEY, K.BYE, Bye("closed"))
    engine.proto.args_done(call, (), [8])
    assert releases(engine) == []


def test_the_client_keeps_item_leases_until_the_call_ends() -> None:
    protocol, call = open_client(window=3)
    assert _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=11)
    assert _streams.send_item(protocol, call, b"\x01", (), 0.0)  # frames
    assert _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=12)
    # A response or CREDIT ends nothing; only the call's end does (rule 6).
    feed(protocol, b"p", control(K.CREDIT, Credit(1), call.call_id), 0.1)
    assert take_item_leases(call) == [11, 12]
    assert take_item_leases(call) == []


def test_an_item_that_may_not_go_takes_no_lease() -> None:
    protocol, call = open_client(window=1)
    assert _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=11)
    assert not _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=12)
    assert take_item_leases(call) == [11]  # the shell aborts 12's placer


def test_a_request_stream_given_up_on_keeps_its_item_leases_until_the_engines_release() -> None:
    protocol, call = open_client()
    _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=11)
    _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=12)
    assert protocol.cancel(call, 0.5)
    assert take_item_leases(call) == []  # not freed: the engine may read them
    assert len(protocol.leases) == 2
    freed = feed(protocol, b"p", control(K.RELEASE, Release((11,))), 1.0)
    assert isinstance(freed, LeasesFreed)
    assert freed.leases == (11,)
    assert len(protocol.leases) == 1
    freed = feed(protocol, b"p", control(K.RELEASE, Release((12, 11))), 1.0)
    assert isinstance(freed, LeasesFreed)
    assert (freed.leases, freed.refused) == ((12,), 1)
    assert len(protocol.leases) == 0


@pytest.mark.parametrize("end", ["late_reply", "engine_end"])
def test_a_given_up_request_streams_item_leases_end_with_a_late_reply_or_the_engine(
    end: str,
) -> None:
    protocol, call = open_client()
    _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=11)
    _streams.send_item(protocol, call, b"\x01", (), 0.0, lease=12)
    protocol.cancel(call, 0.5)
    if end == "late_reply":
        freed = feed(protocol, b"p", control(K.STREAM_END, None, call.call_id), 1.0)
        assert isinstance(freed, LeasesFreed)
        assert freed.leases == (11, 12)
    else:
        feed(protocol, b"p", control(K.BYE, Bye("shutdown")), 1.0)
    assert len(protocol.leases) == 0


def test_drop_hands_back_the_buffers_of_untaken_items() -> None:
    stream = _streams.RequestStream(4)
    big, small = bytearray(8), bytearray(2)
    assert stream.push(b"p0", [big]) is None
    assert stream.push(b"p1", [small]) is None
    assert stream.push(b"p2", []) is None  # inline: nothing to release
    item, _ = stream.take()
    assert item == (b"p0", [big])
    assert stream.drop() == [[small]]
    assert not stream.items
    assert stream.take() == (None, 0)
