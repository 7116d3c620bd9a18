"""Peer strings never reach a log line, an exception or a terminal raw (issue 21 item 1).

Each path is fed ESC, newlines, an OSC title sequence, a bidirectional override and rich
markup. Ids (HELLO ``engine_id``, WELCOME ``client_id``, reasons, type names) with a
control character are refused when decoded; free text (REJECT and ERROR messages,
tracebacks, string results) is escaped where it is shown.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import anyio
import ormsgpack
import pytest

from tensorrpc import RemoteError
from tensorrpc._client_events import EngineRefused
from tensorrpc._client_io import RefusalLog
from tensorrpc._engines import EngineTable
from tensorrpc._exceptions import (
    ErrorCode,
    HandshakeRejectedError,
    LocalProtocolError,
    RemoteProtocolError,
    error_from_wire,
)
from tensorrpc._protocol import (
    Header,
    Hello,
    MessageKind,
    Reject,
    Welcome,
    decode_control,
    encode_control,
)
from tensorrpc._server import Server, serve
from tensorrpc._service import describe
from tensorrpc._text import peer_text
from tensorrpc.cli import _render

from ..integration.server_peer import WAIT, open_peer
from ..integration.server_services import Probe

SPEC = describe(Probe)
#: Clears the screen, sets the window title, reverses the text, forges a log line.
HOSTILE = "evil\x1b[2J\x1b]0;pwned\x07\u202e[link=https://x.example]click[/link]\nFAKE log line"
RAW = ("\x1b", "\x07", "\u202e", "\n")


def _clean(text: str, *, lines: bool = False) -> bool:
    raw = RAW[:-1] if lines else RAW
    return not any(c in text for c in raw)


def test_peer_text_escapes_controls_and_keeps_markup_as_text() -> None:
    shown = peer_text(HOSTILE)
    assert _clean(shown)
    assert shown == (
        "evil\\x1b[2J\\x1b]0;pwned\\x07\\u202e[link=https://x.example]click[/link]\\nFAKE log line"
    )
    assert peer_text("tb line 1\n\tline 2\x1b[31m", lines=True) == "tb line 1\n\tline 2\\x1b[31m"
    assert peer_text(b"\x1b") == "b'\\x1b'"  # not a string: its repr


def test_peer_text_is_cut_to_its_limit_escapes_included() -> None:
    assert peer_text("x" * 10_000, 50) == "x" * 47 + "..."
    assert len(peer_text("\x1b" * 10_000, 50)) == 50
    assert peer_text("short", 50) == "short"


def _hello(engine_id: str) -> Hello:
    return Hello(
        engine_id=engine_id,
        service="Probe",
        fingerprint="f",
        protocol_version=1,
        host_id="h",
        pid=1,
        transports=("frames",),
        concurrency=1,
        heartbeat_ms=1000,
        methods=("add",),
        signatures=("add(a: int, b: int) -> int",),
    )


def _header(kind: MessageKind) -> Header:
    return Header(kind=kind)


@pytest.mark.parametrize("bad", ["e\n1", "e\x1b[2J", "e\u202e1", "e\x9b1", "e\x00"])
def test_ids_with_control_characters_are_refused_both_ways(bad: str) -> None:
    with pytest.raises(LocalProtocolError, match="control character"):
        encode_control(MessageKind.HELLO, _hello(bad))
    good = encode_control(MessageKind.HELLO, _hello("e1"))
    body = ormsgpack.unpackb(bytes(good[1]))
    for field, value in (("engine_id", bad), ("methods", ["add", bad]), ("service", bad)):
        forged = ormsgpack.packb({**body, field: value})
        with pytest.raises(RemoteProtocolError, match="control character"):
            decode_control(_header(MessageKind.HELLO), forged)
    welcome = ormsgpack.packb({"client_id": bad, "host_id": "h", "transports": ["frames"]})
    with pytest.raises(RemoteProtocolError, match=r"client_id has a control character"):
        decode_control(_header(MessageKind.WELCOME), welcome)
    reject = ormsgpack.packb({"reason": bad, "message": "m"})
    with pytest.raises(RemoteProtocolError, match="reason has a control character"):
        decode_control(_header(MessageKind.REJECT), reject)


def test_ids_with_markup_or_unicode_letters_still_pass() -> None:
    for engine_id in ("[bold]e1[/bold]", "moteur-é", "引擎-1"):
        frames = encode_control(MessageKind.HELLO, _hello(engine_id))
        body = decode_control(_header(MessageKind.HELLO), bytes(frames[1]))
        assert isinstance(body, Hello)
        assert body.engine_id == engine_id


def test_remote_error_texts_are_escaped_and_keep_their_lines() -> None:
    error = error_from_wire(ErrorCode.REMOTE, "ValueError", HOSTILE, "Traceback:\n  x\x1b[2J\n")
    assert isinstance(error, RemoteError)
    text = str(error)
    assert _clean(text, lines=True)
    assert "\\x1b[2J" in text
    assert "Traceback:\n  x" in text
    assert _clean(error.message, lines=True)
    for code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.DECODE, ErrorCode.OVERLOADED):
        assert _clean(str(error_from_wire(code, "", HOSTILE, "")), lines=True)


def test_refusals_kept_by_the_engine_table_are_escaped() -> None:
    table = EngineTable(max_in_flight=8)
    table.refuse("e\x1b[2J", "fingerprint", HOSTILE)
    [(key, text)] = table.rejected.items()
    assert key == "e\\x1b[2J"
    assert _clean(text)
    assert "\\nFAKE log line" in text


def test_refusal_log_lines_are_one_line_without_escapes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RefusalLog()
    with caplog.at_level(logging.WARNING, logger="tensorrpc.client"):
        log.log(EngineRefused("e1", "fingerprint", HOSTILE, by_client=False), 0.0)
        log.log(EngineRefused(HOSTILE, "fingerprint", HOSTILE, by_client=True), 0.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert all(_clean(line) for line in lines), lines
    assert all("FAKE log line" in line for line in lines)


def test_a_string_result_printed_by_the_cli_has_no_escape_sequence() -> None:
    shown = _render(HOSTILE + "\nsecond line", as_json=False, max_values=10)
    assert _clean(shown, lines=True)
    assert shown.endswith("\nsecond line")


async def test_a_hostile_welcome_is_refused_and_logged_escaped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tensorrpc")
    async with (
        open_peer(SPEC, bind=f"ipc://{tmp_path}/c") as (peer, address),
        Server(Probe(), connect=address, engine_id="e1") as server,
    ):
        msg = await peer.expect(MessageKind.HELLO)
        peer.route = msg.route
        header = struct.pack("<2sBBHHQI", b"TR", 1, int(MessageKind.WELCOME), 0, 0, 0, 0)
        welcome = encode_control(MessageKind.WELCOME, Welcome(client_id="c1", host_id="h"))
        body = {**ormsgpack.unpackb(bytes(welcome[1])), "client_id": HOSTILE}
        peer.send([header, ormsgpack.packb(body)])
        reject = (await peer.expect(MessageKind.REJECT)).body()
        assert isinstance(reject, Reject)
        assert reject.reason == "protocol"
        assert "client_id has a control character" in reject.message
        assert not [c for c in server.statistics().clients if c.state == "live"]
    records = [r.getMessage() for r in caplog.records if r.name.startswith("tensorrpc")]
    assert all(_clean(line) for line in records), records


async def test_a_hostile_reject_message_reaches_log_and_exception_escaped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tensorrpc")
    async with open_peer(SPEC, bind=f"ipc://{tmp_path}/c") as (peer, address):

        async def refuse() -> None:
            msg = await peer.expect(MessageKind.HELLO)
            peer.route = msg.route
            peer.control(MessageKind.REJECT, Reject("fingerprint", HOSTILE))

        async with anyio.create_task_group() as tg:
            tg.start_soon(refuse)
            with pytest.raises(HandshakeRejectedError) as info, anyio.fail_after(WAIT):
                await serve(Probe(), connect=address, engine_id="e9")
    assert _clean(str(info.value))
    assert "\\x1b[2J" in str(info.value)
    records = [r.getMessage() for r in caplog.records if r.name.startswith("tensorrpc")]
    assert any("FAKE log line" in line for line in records)
    assert all(_clean(line) for line in records), records


async def test_a_client_id_with_markup_is_logged_as_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tensorrpc.server")
    async with (
        open_peer(SPEC, bind=f"ipc://{tmp_path}/c") as (peer, address),
        Server(Probe(), connect=address, engine_id="e1"),
    ):
        msg = await peer.expect(MessageKind.HELLO)
        peer.route = msg.route
        peer.control(MessageKind.WELCOME, Welcome(client_id="[red]c1[/red]", host_id="h"))
        assert await peer.result(peer.call("add", 2, 3)) == 5  # in session: it was logged
    joined = [r.getMessage() for r in caplog.records if "joined client" in r.getMessage()]
    assert joined == ["engine 'e1' joined client [red]c1[/red]"]
