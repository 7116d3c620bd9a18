"""The client's transition table is the one `ClientProtocol.receive` dispatches on, the
one docs/protocol.md §13 shows, and every row leads where it says: each row is driven
here through the machine."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import ormsgpack
import pytest

from tensorrpc import _streams
from tensorrpc._client_events import CheckReachable, PeerState
from tensorrpc._client_protocol import _DISPATCH, _REPLIES, TRANSITIONS
from tensorrpc._machine import Transition, render_transitions
from tensorrpc._protocol import Credit, MessageKind, Release, pack_reply_header

from .client_script import (
    UPLOAD,
    bye,
    control,
    feed,
    hello,
    join,
    kinds,
    make_protocol,
    reject,
    result,
    sent,
)

K = MessageKind
S = PeerState
PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
START = "<!-- transitions: client -->"
END = "<!-- /transitions -->"
PEER = b"p"
LONG = 3_600_000  # an engine bound (ms) no row here reaches


def test_the_page_shows_the_table_the_client_runs() -> None:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(START) + len(START) : text.index(END, text.index(START))]
    assert section.strip() == render_transitions(TRANSITIONS).strip()


def test_every_dispatched_pair_has_a_row_and_every_message_row_a_handler() -> None:
    rows = {(t.state, kind) for t in TRANSITIONS for kind in t.kinds}
    inline = {(S.LIVE, kind) for kind in _REPLIES}  # live replies are delivered inline
    assert rows == set(_DISPATCH) | inline


def _state(protocol: Any, peer: bytes = PEER) -> PeerState:
    rec = protocol._peers.get(peer)
    return S.NONE if rec is None else rec.state


def _enter(row: Transition[PeerState]) -> Any:
    protocol = make_protocol()
    dialled = row.state is S.DIALING or "dialled" in row.input
    if dialled:
        protocol.dial(PEER, "tcp://engine:7000", 0.0)
        sent(protocol)
    if row.state is S.LIVE:
        bound = 2000 if "sent nothing" in row.input else LONG
        join(protocol, "e1", PEER, dead_after_ms=bound)
    if "another peer" in row.input:
        join(protocol, "e1", b"other", dead_after_ms=LONG)
    if "bulk" in row.input:
        engine = protocol.engines.engines["e1"]
        protocol.bulk_bound(PEER, engine.client_epoch, ours=True)
        assert engine.bulk_bound
        if "after its BYE" in row.input:
            protocol.receive(PEER, bye(), 0.2, bulk=True)
            assert protocol.next_events() == []
    assert _state(protocol) is row.state
    return protocol


def _message(label: str) -> list[Any]:
    if label == "HELLO, malformed":
        return [pack_reply_header(K.HELLO), ormsgpack.packb({"engine_id": 1})]
    if label == "HELLO of another protocol version":
        return [struct.pack("<2sBBHHQI", b"TR", 2, int(K.HELLO), 0, 0, 0, 0), b"\x80"]
    if label.startswith("HELLO"):
        if "differ" in label or "refused" in label:
            return hello("e1", service="Other")
        epoch = 8 if "new epoch" in label else 7
        return hello("e1", epoch=epoch, dead_after_ms=LONG)
    return {
        "REJECT": reject(),
        "any other message": control(K.PING, None, 5),
        "any well-formed message": control(K.PONG, None, 1),
        "PING n": control(K.PING, None, 5),
        "PONG": control(K.PONG, None, 1),
        "RESULT/ERROR/STREAM_ITEM/STREAM_END": result(1, 3),
        "RELEASE": control(K.RELEASE, Release((4,))),
        "BYE": bye(),
        "BYE, the first of two (a bound bulk connection)": bye(),
        "the session ends, at a dialled address": bye(),
    }[label]


def _open_upload(protocol: Any) -> Any:
    engine = protocol.engines.engines["e1"]
    call = protocol.start_call(engine, UPLOAD, object(), stream=False, now=0.5)
    protocol.frames_to_send()  # the CALL
    return call


def _request_row(protocol: Any, label: str) -> list[K]:
    call = _open_upload(protocol)
    if label == "CREDIT for a request stream":
        before = call.request.credit
        event = feed(protocol, PEER, control(K.CREDIT, Credit(3), call.call_id), 0.5)
        assert event == _streams.CreditGranted(call)
        assert call.request.credit == before + 3
    elif label == "a request item is due":
        assert _streams.send_item(protocol, call, b"\x01", (), 0.5)
    else:
        assert _streams.half_close(protocol, call, 0.5)
    return [s.kind for s in sent(protocol) if s.peer == PEER]


REQUEST_ROWS = (
    "CREDIT for a request stream",
    "a request item is due",
    "the request stream is exhausted",
)


def _apply(protocol: Any, row: Transition[PeerState]) -> list[K]:
    label = row.input
    if label in REQUEST_ROWS:
        return _request_row(protocol, label)
    if label == "timer: hello request due":
        protocol.tick(1.0)
    elif label == "timer: heartbeat due":
        protocol.tick(1.01)
    elif label == "timer: engine silent past our dead_after":
        protocol.tick(5.1)
    elif label.startswith("timer, message or new call"):
        feed(protocol, PEER, control(K.PONG, None, 1), 2.5)
    elif label.startswith("send fails"):
        protocol.send_failed(PEER, 0.5)
    elif label == "close()":
        protocol.close(0.5)
    elif label.startswith("the bound bulk connection is lost"):
        epoch = protocol.engines.engines["e1"].client_epoch
        protocol.bulk_lost(PEER, epoch, 0.5, ours=True)
    elif label.startswith("a message other than RESULT or BYE on the bulk"):
        protocol.receive(PEER, control(K.PING, None, 5), 0.5, bulk=True)
    elif "live on another peer" in label:
        check = feed(protocol, PEER, hello("e1", epoch=99), 0.5)
        assert isinstance(check, CheckReachable)
        protocol.reachable(check, "unreachable" not in label, 0.5)
    else:
        feed(protocol, PEER, _message(label), 0.5)
    return [s.kind for s in sent(protocol) if s.peer == PEER]


#: What a row sends to the peer, where it sends anything (checked beside the next state).
SENDS: dict[tuple[PeerState, str], list[K]] = {
    (S.NONE, "HELLO, acceptable"): [K.WELCOME],
    (S.NONE, "HELLO, version/service/fingerprint differ"): [K.REJECT],
    (S.NONE, "HELLO, malformed"): [K.REJECT],
    (S.NONE, "HELLO of another protocol version"): [K.REJECT],
    (S.NONE, "HELLO, engine id live on another peer that is reachable"): [K.REJECT],
    (S.NONE, "HELLO, engine id live on another peer that is unreachable"): [K.WELCOME],
    (S.NONE, "any other message"): [],
    (S.DIALING, "timer: hello request due"): [K.PING],
    (S.LIVE, "HELLO, same epoch"): [K.WELCOME],
    (S.LIVE, "PING n"): [K.PONG],
    (S.LIVE, "timer: heartbeat due"): [K.PING],
    (S.LIVE, "close()"): [K.BYE],
    (S.LIVE, "BYE, the first of two (a bound bulk connection)"): [],
    (S.LIVE, "a message other than RESULT or BYE on the bulk connection"): [],
    (S.LIVE, "the bound bulk connection is lost, the engine connected to us"): [K.BYE, K.PING],
    (S.LIVE, "CREDIT for a request stream"): [],
    (S.LIVE, "a request item is due"): [K.STREAM_ITEM],
    (S.LIVE, "the request stream is exhausted"): [K.STREAM_END],
}


@pytest.mark.parametrize(
    "row", TRANSITIONS, ids=[f"{t.state.value}|{t.input}" for t in TRANSITIONS]
)
def test_each_row_leads_to_its_next_state(row: Transition[PeerState]) -> None:
    protocol = _enter(row)
    out = _apply(protocol, row)
    assert _state(protocol) is row.next
    expected = SENDS.get((row.state, row.input))
    if expected is not None:
        assert out == expected


def test_a_hello_of_another_version_is_refused_naming_both() -> None:
    protocol = make_protocol()
    feed(protocol, PEER, _message("HELLO of another protocol version"), 0.0)
    [out] = sent(protocol)
    assert (out.kind, out.body.reason) == (K.REJECT, "version")
    assert "version 2" in out.body.message
    assert kinds(protocol) == []
