"""The engine's transition table is the one `ServerProtocol.receive` dispatches on, the
one docs/protocol.md shows, and every row does what it says to the state: each row is
driven here through the machine, in each topology it applies to."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tensorrpc import _streams
from tensorrpc._machine import Transition, render_transitions
from tensorrpc._protocol import Bye, MessageKind, Reject, Release
from tensorrpc._server_protocol import _DISPATCH, TRANSITIONS, SessionState

from .server_helpers import Engine

K = MessageKind
S = SessionState
PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
START = "<!-- transitions: engine -->"
END = "<!-- /transitions -->"
HEARTBEAT, DEAD_AFTER = 1.0, 5.0


def test_the_page_shows_the_table_the_engine_runs() -> None:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(START) + len(START) : text.index(END, text.index(START))]
    assert section.strip() == render_transitions(TRANSITIONS).strip()


def test_every_dispatched_pair_has_a_row_and_every_message_row_a_handler() -> None:
    rows = {(t.state, kind) for t in TRANSITIONS for kind in t.kinds}
    dispatched = {pair for pair in _DISPATCH if pair[0] is not S.PARTED}
    # A live CALL and request STREAM_ITEM (the hot path) are handled in `receive` itself.
    assert rows == dispatched | {(S.LIVE, K.STREAM_ITEM), (S.LIVE, K.CALL)}
    # PARTED answers every kind alike (its row is about any message)
    assert {kind for state, kind in _DISPATCH if state is S.PARTED} == set(MessageKind)


def _key(listen: bool) -> object:
    return b"c1" if listen else "addr"


def _enter(state: SessionState, listen: bool) -> Engine:
    """An engine whose client (``_key``) is in ``state``, with nothing left to take."""
    engine = Engine.make(listen=listen, heartbeat_interval=HEARTBEAT, dead_after=DEAD_AFTER)
    key = _key(listen)
    if state is S.NONE:
        return engine
    if listen:
        engine.control(key, K.PING, None, 1)
    else:
        engine.proto.add_client(key, engine.now)
        engine.advance(0)
    if state is S.REJECTED:
        engine.control(key, K.REJECT, Reject("service", "s"))
    elif state is not S.GREETING:
        engine.welcome(key, epoch=7)
        if state is S.PARTED:
            engine.control(key, K.BYE, Bye("closed"))
    engine.take()
    assert _state(engine, listen) is state
    return engine


def _state(engine: Engine, listen: bool) -> SessionState:
    session = engine.proto.sessions.get(_key(listen))
    return S.NONE if session is None else session.state


def _malformed_welcome() -> list[bytes]:
    header = struct.pack("<2sBBHHQI", b"TR", 1, int(K.WELCOME), 0, 0, 0, 0)
    return [header, b"\x81\xa9client_id\x07"]


def _apply(engine: Engine, row: Transition[SessionState], listen: bool) -> list[K]:
    """Feed the row's input; the kinds it made the engine send."""
    key = _key(listen)
    label = row.input
    if label in REQUEST_ROWS:
        return REQUEST_ROWS[label](engine, key)
    if label.startswith("timer:"):
        if "ping due" in label or "hello due" in label:
            engine.advance(HEARTBEAT)
        else:
            engine.advance(DEAD_AFTER + 0.1)
        return engine.kinds()
    if label == "WELCOME, malformed":
        engine.send(key, _malformed_welcome())
    elif label.startswith("WELCOME"):
        epoch = 7 if "same" in label else 8
        fingerprint = "0" * 64 if "fingerprint" in label else ""
        engine.welcome(key, epoch=epoch, fingerprint=fingerprint)
    elif label.startswith("CALL"):
        if "in flight" in label:
            engine.call(key, 1)
            engine.take()
        engine.call(key, 1)
    elif label.startswith("REJECT"):
        reason = "duplicate_id" if "duplicate_id" in label else "service"
        engine.control(key, K.REJECT, Reject(reason, "r"))
    else:
        kind, body, call_id = {
            "PING": (K.PING, None, 1),
            "PING n": (K.PING, None, 5),
            "PONG": (K.PONG, None, 1),
            "BYE": (K.BYE, Bye("closed"), 0),
            "CANCEL": (K.CANCEL, None, 3),
            "CREDIT": (K.CREDIT, None, 3),
            "RELEASE": (K.RELEASE, Release((4,)), 0),
            "any message": (K.PING, None, 1),
            "any other message": (K.PONG, None, 1),
        }[label]
        if kind is K.CREDIT:
            engine.credit(key, call_id, 1)
        else:
            engine.control(key, kind, body, call_id)
    return engine.kinds()


def _item_past_credit(engine: Engine, key: object) -> list[K]:
    engine.call(key, 3)  # a unary call: its request is not a stream
    engine.take()
    engine.item(key, 3)
    return engine.kinds()


def _items_taken(engine: Engine, key: object) -> list[K]:
    call = engine.open_upload(key, 3)
    for _ in range(8):
        engine.item(key, 3)
    for _ in range(8):
        assert _streams.take_item(engine.proto, call) is not None
    engine.collect()
    return engine.kinds()


def _open_then(action: str) -> Callable[[Engine, object], list[K]]:
    def row(engine: Engine, key: object) -> list[K]:
        engine.open_upload(key, 3)
        if action == "item":
            engine.item(key, 3)
        elif action == "end":
            engine.half_close(key, 3)
        return engine.kinds()

    return row


def _end_again(engine: Engine, key: object) -> list[K]:
    engine.open_upload(key, 3)
    engine.half_close(key, 3)
    engine.half_close(key, 3)
    return engine.kinds()


def _stray(engine: Engine, key: object) -> list[K]:
    engine.item(key, 99)
    engine.half_close(key, 98)
    return engine.kinds()


#: How each request-stream row is driven: its input, and what it sends.
REQUEST_ROWS: dict[str, Callable[[Engine, object], list[K]]] = {
    "STREAM_ITEM of a request stream": _open_then("item"),
    "STREAM_ITEM past the credit, after STREAM_END, or for a call whose request is not a "
    "stream": _item_past_credit,
    "STREAM_END of a request stream": _open_then("end"),
    "STREAM_END again, or for a call whose request is not a stream": _end_again,
    "STREAM_ITEM/STREAM_END, no call of that id": _stray,
    "handler takes request items": _items_taken,
}


def _cases() -> list[Any]:
    cases = []
    for row in TRANSITIONS:
        tops = [True] if row.state is S.NONE else [True, False]
        if "(listen)" in row.input:
            tops = [True]
        elif "(dial-in)" in row.input:
            tops = [False]
        for listen in tops:
            name = f"{row.state.value}|{row.input}|{'listen' if listen else 'dial-in'}"
            cases.append(pytest.param(row, listen, id=name))
    return cases


#: What a row's action sends, where it sends anything (checked beside the next state).
SENDS: dict[tuple[SessionState, str], list[K]] = {
    (S.NONE, "PING"): [K.HELLO],
    (S.NONE, "WELCOME"): [K.HELLO],
    (S.NONE, "CALL"): [K.ERROR],
    (S.NONE, "any other message"): [],
    (S.GREETING, "PING"): [],  # the HELLO went out within this heartbeat
    (S.GREETING, "WELCOME"): [],
    (S.GREETING, "WELCOME, malformed"): [K.REJECT],
    (S.GREETING, "WELCOME, another non-empty fingerprint"): [K.REJECT],
    (S.GREETING, "CALL"): [K.ERROR],
    (S.GREETING, "BYE"): [],
    (S.LIVE, "PING n"): [K.PONG],
    (S.LIVE, "PONG"): [],
    (S.LIVE, "CALL"): [],
    (S.LIVE, "CALL with an id in flight"): [K.ERROR],
    (S.LIVE, "WELCOME, same client epoch"): [],
    (S.LIVE, "timer: ping due"): [K.PING],
    (S.LIVE, "STREAM_ITEM of a request stream"): [],
    (
        S.LIVE,
        "STREAM_ITEM past the credit, after STREAM_END, or for a call whose request is not a "
        "stream",
    ): [K.ERROR],
    (S.LIVE, "STREAM_END of a request stream"): [],
    (S.LIVE, "STREAM_END again, or for a call whose request is not a stream"): [K.ERROR],
    (S.LIVE, "STREAM_ITEM/STREAM_END, no call of that id"): [],
    (S.LIVE, "handler takes request items"): [K.CREDIT],
    (S.LIVE, "timer: dead_after"): [K.HELLO],
    (S.PARTED, "any message"): [K.HELLO],
    (S.PARTED, "timer: dead_after (dial-in)"): [K.HELLO],
    (S.REJECTED, "any message"): [],
}


@pytest.mark.parametrize(("row", "listen"), _cases())
def test_each_row_leads_to_its_next_state(row: Transition[SessionState], listen: bool) -> None:
    engine = _enter(row.state, listen)
    if row.state is S.LIVE and row.input in ("CANCEL", "CREDIT"):
        engine.call(_key(listen), 3, "count")  # a call for it to name
        engine.take()
    sent = _apply(engine, row, listen)
    assert _state(engine, listen) is row.next
    expected = SENDS.get((row.state, row.input))
    if expected is not None:
        assert sent == expected


def test_a_parted_client_that_calls_gets_a_new_hello_and_its_error() -> None:
    # The first CALL after a BYE: HELLO (new epoch) and ERROR(id, PROTOCOL), both
    # topologies alike (a listening engine used to answer ERROR alone).
    for listen in (True, False):
        engine = _enter(S.PARTED, listen)
        old = engine.proto.sessions[_key(listen)].epoch
        engine.call(_key(listen), 9)
        sent = engine.take()
        assert [s.kind for s in sent] == [K.ERROR, K.HELLO]
        assert sent[1].body.epoch != old
        assert _state(engine, listen) is S.GREETING


def test_a_welcome_the_engine_cannot_match_gets_a_hello_of_a_new_session() -> None:
    engine = _enter(S.NONE, True)
    engine.welcome(b"c1", epoch=7)
    [hello] = engine.take()
    assert hello.kind is K.HELLO
    engine.welcome(b"c1", epoch=8)  # the client welcomes it: a session
    assert _state(engine, True) is S.LIVE
