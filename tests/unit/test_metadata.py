"""Call metadata on the wire, sans-I/O: the header block, its bounds, hostile blocks,
and request/response metadata between the real protocol machines (`ProtocolPair`)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, strategies as st

from tensorrpc._exceptions import MetadataError, RemoteProtocolError
from tensorrpc._metadata import (
    KEY_PATTERN,
    MAX_KEY_CHARS,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_VALUE_BYTES,
    check_metadata,
    decode_block,
    encode_block,
    merge_metadata,
)
from tensorrpc._protocol import (
    HEADER_SIZE,
    Flags,
    Header,
    MessageKind,
    pack_call_header,
    pack_metadata_reply_header,
    pack_reply_header,
    split_frames,
    unpack_header,
)
from tensorrpc._text import CONTROL

from .. import pair_work as work
from ..helpers import ProtocolPair

K = MessageKind


def block(entries: list[tuple[bytes, bytes]], size: int | None = None) -> bytes:
    """A metadata block written by hand (a peer may write anything)."""
    body = b"".join(bytes((len(k),)) + k + struct.pack("<H", len(v)) + v for k, v in entries)
    return struct.pack("<H", len(body) if size is None else size) + body


def call_header(raw_block: bytes, method: bytes = b"add") -> bytes:
    head = bytearray(pack_call_header(7, "add"))
    head[4:6] = int(Flags.METADATA).to_bytes(2, "little")
    return bytes(head[:HEADER_SIZE]) + raw_block + method


# -- local checks -------------------------------------------------------------------------


def test_valid_metadata_round_trips_through_a_call_and_both_reply_kinds() -> None:
    metadata = {"authorization": "Bearer t0k", "x-request-id": "42", "lang": "né", "e": ""}
    raw = encode_block(check_metadata(metadata))
    header = unpack_header(pack_call_header(9, "add", 0, 5, releases=[3], metadata=raw))
    assert header.flags & Flags.METADATA
    assert (header.method, header.releases, dict(header.metadata)) == ("add", (3,), metadata)
    for kind in (K.RESULT, K.STREAM_END):
        reply = unpack_header(pack_metadata_reply_header(kind, 9, raw))
        assert (reply.kind, reply.call_id, dict(reply.metadata)) == (kind, 9, metadata)


def test_no_metadata_sends_no_flag_and_no_block() -> None:
    assert encode_block(check_metadata(None)) == b""
    assert pack_call_header(1, "add", metadata=b"") == pack_call_header(1, "add")
    assert pack_metadata_reply_header(K.RESULT, 1, b"") == pack_reply_header(K.RESULT, 1)
    assert not unpack_header(pack_call_header(1, "add")).metadata


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"Authorization": "x"}, "is not 1..64 characters"),
        ({"a b": "x"}, "is not"),
        ({"-lead": "x"}, "is not"),
        ({"": "x"}, "is not"),
        ({"k" * (MAX_KEY_CHARS + 1): "x"}, "is not"),
        ({"tensorrpc-deadline": "1"}, "reserved"),
        ({"k": 1}, "must be a str"),
        ({b"k": "v"}, "must be a str"),
        ({"k": "line\nbreak"}, "control character"),
        ({"k": "\x1b[31mred"}, "control character"),
        ({"k": "bidi\u202eoverride"}, "control character"),
        ({"k": "\ud800"}, "not valid UTF-8"),
        ({"k": "x" * (MAX_VALUE_BYTES + 1)}, f"at most {MAX_VALUE_BYTES}"),
        ({f"k{i}": "" for i in range(MAX_METADATA_ENTRIES + 1)}, "keys; at most"),
        ({f"k{i}": "v" * 1000 for i in range(9)}, f"at most {MAX_METADATA_BYTES}"),
    ],
)
def test_metadata_we_would_send_is_checked_with_a_clear_error(
    metadata: dict[object, object], match: str
) -> None:
    with pytest.raises(MetadataError, match=match):
        check_metadata(metadata)  # type: ignore[arg-type]


def test_a_metadata_error_is_a_value_error_and_a_local_protocol_error() -> None:
    with pytest.raises(ValueError, match="reserved"):
        check_metadata({"tensorrpc-x": ""})


def test_merging_checks_the_whole_against_the_bounds() -> None:
    base = check_metadata({f"k{i}": "" for i in range(MAX_METADATA_ENTRIES)})
    assert merge_metadata(base, {"k0": "new"})["k0"] == "new"
    with pytest.raises(MetadataError, match="keys; at most"):
        merge_metadata(base, {"one-more": ""})


def test_metadata_at_its_bounds_is_accepted_both_ways() -> None:
    metadata = {f"k{i:02}": "v" * 120 for i in range(MAX_METADATA_ENTRIES)}
    raw = encode_block(check_metadata(metadata))
    assert len(raw) - 2 <= MAX_METADATA_BYTES
    assert dict(unpack_header(pack_metadata_reply_header(K.RESULT, 1, raw)).metadata) == metadata


# -- hostile blocks -----------------------------------------------------------------------


HOSTILE = [
    pytest.param(block([(b"Auth", b"x")]), "is not", id="uppercase-key"),
    pytest.param(block([(b"k\x1b[2J", b"x")]), "is not", id="escape-in-key"),
    pytest.param(block([(b"k\xff", b"x")]), "not ASCII", id="non-ascii-key"),
    pytest.param(block([(b"", b"x")]), "is not", id="empty-key"),
    pytest.param(block([(b"tensorrpc-x", b"")]), "reserved", id="reserved-key"),
    pytest.param(block([(b"k", b"a\x1b]0;owned\x07")]), "control character", id="osc-value"),
    pytest.param(block([(b"k", b"forged\nINFO ok")]), "control character", id="newline-value"),
    pytest.param(block([(b"k", b"\xc3")]), "not valid UTF-8", id="bad-utf8-value"),
    pytest.param(block([(b"k", b"1"), (b"k", b"2")]), "twice", id="duplicate-key"),
    pytest.param(block([(b"k", b"v")], size=0), "does not fit", id="empty-block"),
    pytest.param(block([(b"k", b"v")], size=200), "does not fit", id="size-past-frame"),
    pytest.param(block([(b"k", b"v")])[:-1], "does not fit", id="truncated"),
    pytest.param(
        struct.pack("<H", 5) + b"\x01k\xff\xffv", "inside its block", id="value-past-block"
    ),
    pytest.param(struct.pack("<H", 3) + b"\x05kk", "runs past", id="key-past-block"),
    pytest.param(
        block([(f"k{i}".encode(), b"") for i in range(MAX_METADATA_ENTRIES + 1)]),
        "more than",
        id="too-many-keys",
    ),
    pytest.param(
        block([(f"k{i}".encode(), b"v" * 2000) for i in range(5)]), "does not fit", id="too-big"
    ),
    pytest.param(b"\x01", "no block", id="no-size"),
]


@pytest.mark.parametrize(("raw", "match"), HOSTILE)
def test_a_hostile_block_in_a_call_is_refused_at_decode(raw: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match) as info:
        unpack_header(call_header(raw, method=b""))
    assert CONTROL.search(str(info.value)) is None  # the peer's strings are escaped


@pytest.mark.parametrize(("raw", "match"), HOSTILE)
def test_a_hostile_block_in_a_reply_is_refused_at_decode(raw: bytes, match: str) -> None:
    head = bytearray(pack_reply_header(K.RESULT, 3))
    head[4:6] = int(Flags.METADATA).to_bytes(2, "little")
    with pytest.raises(RemoteProtocolError, match=match) as info:
        unpack_header(bytes(head) + raw)
    assert CONTROL.search(str(info.value)) is None


def test_a_call_whose_block_leaves_no_method_name_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="without a method name"):
        unpack_header(call_header(block([(b"k", b"v")]), method=b""))


@pytest.mark.parametrize("kind", [K.ERROR, K.STREAM_ITEM, K.CANCEL, K.CREDIT, K.PONG])
def test_only_result_and_stream_end_replies_may_carry_metadata(kind: MessageKind) -> None:
    head = bytearray(pack_reply_header(kind, 3))
    head[4:6] = int(Flags.METADATA).to_bytes(2, "little")
    with pytest.raises(RemoteProtocolError, match="only CALL"):
        unpack_header(bytes(head) + block([(b"k", b"v")]))
    with pytest.raises(Exception, match="metadata"):
        pack_metadata_reply_header(kind, 3, encode_block({"k": "v"}))


def test_a_reply_with_bytes_after_its_block_is_refused() -> None:
    raw = pack_metadata_reply_header(K.STREAM_END, 3, encode_block({"k": "v"}))
    with pytest.raises(RemoteProtocolError, match="after its metadata"):
        unpack_header(raw + b"x")
    with pytest.raises(RemoteProtocolError, match="only CALL"):  # METADATA with another flag
        split_frames([pack_reply_header(K.RESULT, 3)[:4] + b"\x41\x00" + raw[6:], b"\x01"])


def test_decode_block_reports_where_the_block_ends() -> None:
    raw = encode_block({"a": "1"}) + b"rest"
    metadata, end = decode_block(memoryview(raw), 0, len(raw))
    assert (dict(metadata), raw[end:]) == ({"a": "1"}, b"rest")
    assert Header(K.RESULT).metadata == {}


# -- between the machines -------------------------------------------------------------------


def test_request_metadata_reaches_the_engine_call_and_response_metadata_the_caller() -> None:
    pair = ProtocolPair().connect()
    call = work.call(pair, "add", 1, 2, metadata=encode_block({"authorization": "Bearer t"}))
    pair.flush()
    server_call = pair["e1"].proto.next_call()
    assert server_call is not None
    assert dict(server_call.metadata) == {"authorization": "Bearer t"}
    server_call.reply_metadata = {"x-served-by": "e1"}
    work.reply(pair["e1"], server_call, 3)
    pair.flush()
    assert work.outcome(call) == 3
    assert dict(call.reply_metadata or {}) == {"x-served-by": "e1"}


def test_a_call_without_metadata_gets_a_plain_reply() -> None:
    pair = ProtocolPair().connect()
    call = work.call(pair, "add", 1, 2)
    pair.flush()
    server_call = pair["e1"].proto.next_call()
    assert server_call is not None
    assert not server_call.metadata
    work.reply(pair["e1"], server_call, 3)
    sent = pair["e1"].sent[-1].frames
    assert len(sent[0]) == HEADER_SIZE
    pair.flush()
    assert work.outcome(call) == 3
    assert call.reply_metadata is None


def test_stream_end_carries_the_response_metadata() -> None:
    pair = ProtocolPair().connect()
    call = work.call(pair, "count", 2, metadata=encode_block({"k": "v"}))
    pair.flush()
    server_call = pair["e1"].proto.next_call()
    assert server_call is not None
    assert dict(server_call.metadata) == {"k": "v"}
    work.item(pair["e1"], server_call, 0)
    server_call.reply_metadata = {"tokens": "2"}
    work.end_stream(pair["e1"], server_call)
    pair.flush()
    assert work.items(pair, call) == [0]
    assert call.ended
    assert dict(call.reply_metadata or {}) == {"tokens": "2"}


def test_a_hostile_call_metadata_block_is_answered_protocol_error_and_runs_nothing() -> None:
    pair = ProtocolPair().connect()
    call = work.call(pair, "add", 1, 2, metadata=block([(b"k", b"\x1b[2Jx")]))
    pair.flush()
    assert pair["e1"].proto.next_call() is None
    with pytest.raises(RemoteProtocolError, match="control character") as info:
        work.outcome(call)
    assert "\x1b" not in str(info.value)


# -- properties ---------------------------------------------------------------------------

_KEYS = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True).filter(
    lambda k: not k.startswith("tensorrpc-")
)
_VALUES = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=40).filter(
    lambda v: CONTROL.search(v) is None
)


@given(st.dictionaries(_KEYS, _VALUES, max_size=20))
def test_any_valid_metadata_round_trips(metadata: dict[str, str]) -> None:
    raw = encode_block(check_metadata(metadata))
    if not metadata:
        assert raw == b""
        return
    header = unpack_header(pack_call_header(1, "m", metadata=raw))
    assert dict(header.metadata) == metadata
    assert header.method == "m"


@given(st.binary(max_size=300))
def test_any_bytes_as_a_block_decode_or_fail_as_a_protocol_error(raw: bytes) -> None:
    try:
        metadata, end = decode_block(memoryview(raw), 0, len(raw))
    except RemoteProtocolError as exc:
        error = str(exc)
    else:
        error = ""
        assert end <= len(raw)
    assert CONTROL.search(error) is None
    if error:
        return
    assert all(key_ok(k) and CONTROL.search(v) is None for k, v in metadata.items())


def key_ok(key: str) -> bool:
    return KEY_PATTERN.fullmatch(key) is not None and len(key) <= MAX_KEY_CHARS
