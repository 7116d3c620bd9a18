from __future__ import annotations

import struct

import ormsgpack
import pytest
from hypothesis import given, settings, strategies as st

from tensorrpc._exceptions import (
    ErrorCode,
    InvalidArgumentError,
    LocalProtocolError,
    MethodNotFoundError,
    RemoteError,
    RemoteProtocolError,
    path_parts,
)
from tensorrpc._protocol import (
    HEADER_SIZE,
    MAGIC,
    MAX_CALL_RELEASES,
    MAX_CONTROL_BYTES,
    MAX_LIST_ITEMS,
    MAX_METHOD_BYTES,
    MAX_NAME_CHARS,
    MAX_TEXT_CHARS,
    MAX_TRACEBACK_CHARS,
    PROTOCOL_VERSION,
    Bye,
    Credit,
    ErrorInfo,
    Flags,
    Header,
    Hello,
    MessageKind,
    Reject,
    RejectReason,
    Welcome,
    decode_control,
    encode_control,
    encode_error,
    header_version,
    pack_call_header,
    pack_reply_header,
    split_frames,
    unpack_header,
)

HELLO = Hello(
    engine_id="engine-0",
    service="Calculator",
    fingerprint="ab" * 32,
    protocol_version=PROTOCOL_VERSION,
    host_id="host-1",
    pid=4242,
    transports=("frames", "torch_shm"),
    concurrency=8,
    heartbeat_ms=500,
    methods=("add", "scale", "count"),
    streaming=("count",),
    signatures=("add(a: int, b: int) -> int", "scale(x: float) -> float", "count(n: int) -> int"),
)
WELCOME = Welcome(client_id="client-7", host_id="host-1", transports=("frames",), heartbeat_ms=250)
BODIES: list[tuple[MessageKind, object, int]] = [
    (MessageKind.HELLO, HELLO, 0),
    (MessageKind.WELCOME, WELCOME, 0),
    (MessageKind.REJECT, Reject(RejectReason.FINGERPRINT, "fingerprints differ"), 0),
    (MessageKind.BYE, Bye("shutdown"), 0),
    (MessageKind.CREDIT, Credit(16), 9),
    (MessageKind.ERROR, ErrorInfo(ErrorCode.REMOTE, "ValueError", "boom", "Traceback..."), 3),
    (MessageKind.ERROR, ErrorInfo(ErrorCode.PROTOCOL, "", "bad frames"), 0),
    (MessageKind.CANCEL, None, 5),
    (MessageKind.STREAM_END, None, 5),
    (MessageKind.PING, None, 0),
    (MessageKind.PONG, None, 77),
]


def raw_header(
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    kind: int = MessageKind.RESULT,
    flags: int = 0,
    reserved: int = 0,
    call_id: int = 1,
    timeout_ms: int = 0,
    tail: bytes = b"",
) -> bytes:
    return (
        struct.pack("<2sBBHHQI", magic, version, kind, flags, reserved, call_id, timeout_ms) + tail
    )


def packed_map(mapping: dict[str, object]) -> bytes:
    return ormsgpack.packb(mapping)


def hello_map(**overrides: object) -> dict[str, object]:
    wire: dict[str, object] = {
        "engine_id": "e",
        "service": "S",
        "fingerprint": "f",
        "protocol_version": 1,
        "host_id": "h",
        "pid": 1,
        "transports": [],
        "concurrency": 1,
        "heartbeat_ms": 1000,
        "methods": ["m"],
        "streaming": [],
        "signatures": ["m() -> None"],
        "max_message_bytes": 0,
        "epoch": 1,
        "dead_after_ms": 5000,
        "compression": [],
        "request_streaming": [],
        "stream_window": 16,
        "bulk": "",
        "bulk_token": "",
    }
    wire.update(overrides)
    return wire


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "body", "call_id"), BODIES, ids=lambda v: str(v)[:20])
def test_control_messages_round_trip(kind, body, call_id):
    frames = encode_control(kind, body, call_id)
    assert len(frames) == 2
    header, payload, buffers = split_frames(frames)
    assert header == Header(kind, call_id)
    assert buffers == ()
    assert decode_control(header, payload) == body


@pytest.mark.parametrize("kind", [MessageKind.CALL, MessageKind.RESULT, MessageKind.STREAM_ITEM])
def test_value_messages_split_into_header_payload_and_buffers(kind):
    if kind is MessageKind.CALL:
        head = pack_call_header(11, "scale", Flags.NO_WAIT, 1500)
    else:
        head = pack_reply_header(kind, 11)
    buffers: list[bytearray | memoryview] = [bytearray(b"x" * 100), memoryview(b"y" * 10)]
    header, payload, rest = split_frames([head, b"\x91\x01", *buffers])
    assert header.kind is kind
    assert header.call_id == 11
    assert bytes(payload) == b"\x91\x01"
    assert list(rest) == buffers
    assert rest[0] is buffers[0]


def test_call_header_carries_method_flags_and_deadline():
    frame = pack_call_header(2**64 - 1, "génère", Flags.STREAM | Flags.NO_WAIT, 2**32 - 1)
    assert unpack_header(frame) == Header(
        MessageKind.CALL, 2**64 - 1, Flags.STREAM | Flags.NO_WAIT, 2**32 - 1, "génère"
    )
    assert len(frame) == HEADER_SIZE + len("génère".encode())


def test_header_byte_layout_matches_the_spec():
    frame = pack_call_header(0x0102030405060708, "add", Flags.STREAM, 250)
    assert frame[:2] == b"TR"
    assert frame[2] == PROTOCOL_VERSION
    assert frame[3] == 4
    assert MessageKind.CALL.value == 4
    assert frame[4:6] == b"\x01\x00"
    assert frame[6:8] == b"\x00\x00"
    assert frame[8:16] == bytes.fromhex("0807060504030201")
    assert frame[16:20] == (250).to_bytes(4, "little")
    assert frame[20:] == b"add"


@given(
    kind=st.sampled_from(list(MessageKind)),
    call_id=st.integers(1, 2**64 - 1),
    flags=st.sampled_from([Flags(v) for v in range(4)]),
    timeout_ms=st.integers(0, 2**32 - 1),
    method=st.text(min_size=1, max_size=60).filter(
        lambda m: (
            0 < len(m.encode("utf-8", "surrogatepass")) <= MAX_METHOD_BYTES
            and not any(0xD800 <= ord(c) <= 0xDFFF for c in m)
        )
    ),
)
def test_every_valid_header_round_trips(kind, call_id, flags, timeout_ms, method):
    if kind is MessageKind.CALL:
        header = Header(kind, call_id, flags, timeout_ms, method)
        frame = pack_call_header(call_id, method, flags, timeout_ms)
    elif kind in (
        MessageKind.HELLO,
        MessageKind.WELCOME,
        MessageKind.REJECT,
        MessageKind.BYE,
        MessageKind.RELEASE,
        MessageKind.ATTACH,
    ):
        header = Header(kind)
        frame = pack_reply_header(kind)
    else:
        header = Header(kind, call_id)
        frame = pack_reply_header(kind, call_id)
    assert unpack_header(frame) == header


def test_unpack_header_accepts_any_buffer_and_does_not_need_bytes():
    frame = pack_reply_header(MessageKind.RESULT, 3)
    assert unpack_header(bytearray(frame)).call_id == 3
    assert unpack_header(memoryview(frame)).call_id == 3


def test_ping_and_error_may_be_connection_level():
    assert unpack_header(pack_reply_header(MessageKind.PING)).call_id == 0
    assert unpack_header(encode_error(0, ErrorInfo(ErrorCode.PROTOCOL))[0]).call_id == 0


def test_unknown_map_keys_are_ignored_for_forward_compatibility():
    header = Header(MessageKind.BYE)
    assert decode_control(header, packed_map({"reason": "x", "new": [1, 2]})) == Bye("x")


def test_error_info_rebuilds_the_local_exception():
    remote = ErrorInfo(ErrorCode.REMOTE, "KeyError", "'k'", "tb").to_exception()
    assert isinstance(remote, RemoteError)
    assert remote.remote_traceback == "tb"
    assert isinstance(ErrorInfo(ErrorCode.METHOD_NOT_FOUND).to_exception(), MethodNotFoundError)


def test_unknown_error_codes_are_kept_for_newer_peers():
    header, payload, _ = split_frames(encode_error(4, ErrorInfo(999, "X", "m")))
    info = decode_control(header, payload)
    assert info == ErrorInfo(999, "X", "m")
    assert isinstance(info.to_exception(), RemoteError)


def test_encode_error_truncates_long_text_instead_of_failing():
    info = ErrorInfo(
        ErrorCode.REMOTE, "E", "m" * (MAX_TEXT_CHARS + 10), "t" * MAX_TRACEBACK_CHARS * 2
    )
    header, payload, _ = split_frames(encode_error(1, info))
    decoded = decode_control(header, payload)
    assert isinstance(decoded, ErrorInfo)
    assert len(decoded.message) == MAX_TEXT_CHARS
    assert decoded.message.endswith("[truncated]")
    assert len(decoded.traceback) == MAX_TRACEBACK_CHARS


def test_header_version_reads_a_future_version_without_parsing_the_rest():
    assert header_version(raw_header(version=7, kind=200)) == 7
    assert header_version(b"XX\x01") is None
    assert header_version(b"T") is None


def test_reply_headers_without_call_id_are_cached():
    assert pack_reply_header(MessageKind.PING) is pack_reply_header(MessageKind.PING)


# -- malformed input -> RemoteProtocolError ------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "truncated header"),
        (raw_header()[:-1], "truncated header"),
        (raw_header(magic=b"ZM"), "bad magic"),
        (raw_header(version=2), "unsupported protocol version 2"),
        (raw_header(version=0), "unsupported protocol version 0"),
        (raw_header(kind=0), "unknown message kind 0"),
        (raw_header(kind=17), "unknown message kind 17"),
        (raw_header(kind=15), "unknown message kind 15"),  # unassigned
        (raw_header(kind=255), "unknown message kind 255"),
        (raw_header(reserved=1), "reserved"),
        (raw_header(flags=1), "only CALL"),
        (raw_header(timeout_ms=5), "only CALL"),
        (raw_header(tail=b"x"), "only CALL carries a method"),
        (raw_header(call_id=0), "RESULT with call_id 0"),
        (raw_header(kind=MessageKind.CANCEL, call_id=0), "CANCEL with call_id 0"),
        (raw_header(kind=MessageKind.CREDIT, call_id=0), "CREDIT with call_id 0"),
        (raw_header(kind=MessageKind.HELLO, call_id=3), "connection-level"),
        (raw_header(kind=MessageKind.ATTACH, call_id=3), "connection-level"),
        (raw_header(kind=MessageKind.CALL, tail=b""), "without a method name"),
        (raw_header(kind=MessageKind.CALL, call_id=0, tail=b"m"), "CALL with call_id 0"),
        (raw_header(kind=MessageKind.CALL, flags=512, tail=b"m"), "unknown flag bits 0x200"),
        (raw_header(kind=MessageKind.CALL, flags=32, tail=b""), "no lease count"),
        (raw_header(kind=MessageKind.CALL, flags=32, tail=b"\x00m"), "0 lease ids"),
        (raw_header(kind=MessageKind.CALL, flags=32, tail=b"\x41" + bytes(8 * 65) + b"m"), "65"),
        (raw_header(kind=MessageKind.CALL, flags=32, tail=b"\x02" + bytes(15)), "too short"),
        (raw_header(kind=MessageKind.CALL, flags=32, tail=b"\x01" + bytes(8) + b"m"), "lease id 0"),
        (
            raw_header(kind=MessageKind.CALL, flags=32, tail=b"\x01" + b"\xff" * 8 + b"m"),
            "out of range",
        ),
        (raw_header(kind=MessageKind.CALL, flags=32, tail=b"\x01" + b"\x05" + bytes(7)), "method"),
        (
            raw_header(kind=MessageKind.CALL, flags=48, tail=b"\x01\x05" + bytes(7) + bytes(26)),
            "without a method name",
        ),
        (raw_header(kind=MessageKind.CALL, flags=16, tail=b"m"), "too short for its context"),
        (
            raw_header(kind=MessageKind.CALL, flags=16, tail=b"m" + b"\x01" + bytes(25)),
            "unknown trace context version 1",
        ),
        (raw_header(kind=MessageKind.CALL, flags=16, tail=bytes(26)), "without a method name"),
        (raw_header(kind=MessageKind.CALL, tail=b"\xff\xfe"), "not valid UTF-8"),
        (raw_header(kind=MessageKind.CALL, tail=b"m" * (MAX_METHOD_BYTES + 1)), "limit"),
    ],
)
def test_malformed_headers_raise_remote_protocol_error(frame, match):
    with pytest.raises(RemoteProtocolError, match=match):
        unpack_header(frame)


def test_a_header_in_a_wider_or_strided_buffer_is_read_or_refused_cleanly():
    frame = pack_reply_header(MessageKind.RESULT, 9) + b"\x00" * 4
    assert unpack_header(memoryview(frame[:20]).cast("I")).call_id == 9
    with pytest.raises(RemoteProtocolError, match="contiguous"):
        unpack_header(memoryview(bytes(b for b in frame for _ in range(2)))[::2])


def test_a_non_buffer_header_frame_is_a_protocol_error():
    with pytest.raises(RemoteProtocolError, match="not a buffer"):
        unpack_header("TR")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "at least 2 frames"),
        ([pack_reply_header(MessageKind.RESULT, 1)], "at least 2 frames"),
        ([pack_reply_header(MessageKind.RESULT, 1), b""], "empty payload"),
        ([pack_reply_header(MessageKind.PING), b"x"], "empty payload"),
        ([pack_reply_header(MessageKind.CANCEL, 2), b"", b""], "exactly 2 frames"),
        ([pack_reply_header(MessageKind.BYE), packed_map({"reason": ""}), b"x"], "exactly 2"),
        ([pack_reply_header(MessageKind.RESULT, 1), b"\x90", *[b"b"] * 3], "limit is 2"),
    ],
)
def test_wrong_frame_layouts_raise_remote_protocol_error(frames, match):
    with pytest.raises(RemoteProtocolError, match=match):
        split_frames(frames, max_buffers=2)


@pytest.mark.parametrize(
    ("kind", "payload", "match"),
    [
        (MessageKind.BYE, b"\xc1", "must be a msgpack map"),
        (MessageKind.BYE, b"", "must be a msgpack map"),
        (MessageKind.BYE, b"\xc7\x01\x05a", "must be a msgpack map"),
        (MessageKind.BYE, b"\x81\xa6reason", "not valid msgpack"),
        (MessageKind.BYE, b"\x81\xa6reason\xc7\x01\x05a", "cannot be decoded|not valid msgpack"),
        (MessageKind.BYE, ormsgpack.packb([1, 2]), "must be a msgpack map"),
        (MessageKind.BYE, ormsgpack.packb({}), "missing the field 'reason'"),
        (MessageKind.BYE, ormsgpack.packb({"reason": 1}), "Bye.reason must be a string"),
        (MessageKind.BYE, ormsgpack.packb({"reason": "x" * (MAX_NAME_CHARS + 1)}), "limit"),
        (MessageKind.CREDIT, ormsgpack.packb({"n": 0}), "out of range 1"),
        (MessageKind.CREDIT, ormsgpack.packb({"n": 2**32}), "out of range"),
        (MessageKind.CREDIT, ormsgpack.packb({"n": True}), "must be an integer"),
        (MessageKind.CREDIT, ormsgpack.packb({"n": 1.0}), "must be an integer"),
        (MessageKind.HELLO, packed_map(hello_map(pid=-1)), "Hello.pid=-1 is out of range"),
        (MessageKind.HELLO, packed_map(hello_map(methods="add")), "list of strings"),
        (MessageKind.HELLO, packed_map(hello_map(methods=[1])), r"methods\[0\] must be"),
        (
            MessageKind.HELLO,
            packed_map(hello_map(transports=["t"] * (MAX_LIST_ITEMS + 1))),
            "entries",
        ),
        (MessageKind.HELLO, packed_map(hello_map(methods=["m" * 300])), "characters long"),
        (MessageKind.WELCOME, packed_map({"client_id": "c"}), "missing the field 'host_id'"),
        (MessageKind.REJECT, packed_map({"reason": "x", "message": None}), "must be a string"),
        (
            MessageKind.ERROR,
            packed_map({"code": "1", "type": "", "message": "", "traceback": ""}),
            "integer",
        ),
        (MessageKind.PONG, b"\x80", "empty payload"),
        (MessageKind.RESULT, b"\x80", "codec payload"),
        (MessageKind.CALL, b"\x80", "codec payload"),
        (MessageKind.BYE, b"\x80" * (MAX_CONTROL_BYTES + 1), "limit"),
    ],
)
def test_malformed_control_bodies_raise_remote_protocol_error(kind, payload, match):
    call_id = (
        0
        if kind
        in (
            MessageKind.HELLO,
            MessageKind.WELCOME,
            MessageKind.REJECT,
            MessageKind.BYE,
            MessageKind.PONG,
        )
        else 1
    )
    header = Header(kind, call_id, method="m" if kind is MessageKind.CALL else "")
    with pytest.raises(RemoteProtocolError, match=match):
        decode_control(header, payload)


def test_a_value_just_inside_each_limit_is_accepted():
    body = Hello(
        engine_id="e" * MAX_NAME_CHARS,
        service="s",
        fingerprint="f",
        protocol_version=255,
        host_id="h",
        pid=2**63 - 1,
        transports=("t",) * MAX_LIST_ITEMS,
        methods=("m" * MAX_METHOD_BYTES,),
        signatures=("s",),
    )
    header, payload, _ = split_frames(encode_control(MessageKind.HELLO, body))
    assert decode_control(header, payload) == body


def test_max_message_bytes_round_trips_and_is_checked() -> None:
    hello = Hello("e", "S", "f", 1, "h", 5, max_message_bytes=1 << 20)
    welcome = Welcome("c", "h", max_message_bytes=1 << 32)
    for kind, body in ((MessageKind.HELLO, hello), (MessageKind.WELCOME, welcome)):
        header, payload, _ = split_frames(encode_control(kind, body))
        wire = ormsgpack.unpackb(memoryview(payload))
        assert wire["max_message_bytes"] == body.max_message_bytes
        assert decode_control(header, payload) == body
        for bad, match in ((-1, "out of range"), ("1", "must be an integer")):
            with pytest.raises(RemoteProtocolError, match=match):
                decode_control(header, ormsgpack.packb({**wire, "max_message_bytes": bad}))


@pytest.mark.parametrize(
    ("kind", "body"),
    [(MessageKind.HELLO, HELLO), (MessageKind.WELCOME, WELCOME)],
    ids=["HELLO", "WELCOME"],
)
def test_every_hello_and_welcome_field_is_required(kind: MessageKind, body: object) -> None:
    header, payload, _ = split_frames(encode_control(kind, body))  # type: ignore[arg-type]
    wire = ormsgpack.unpackb(memoryview(payload))
    assert decode_control(header, payload) == body
    for name in wire:
        partial = {k: v for k, v in wire.items() if k != name}
        with pytest.raises(RemoteProtocolError, match=f"missing the field {name!r}"):
            decode_control(header, ormsgpack.packb(partial))


def test_a_hello_needs_one_signature_per_method_and_streams_only_methods() -> None:
    header = unpack_header(pack_reply_header(MessageKind.HELLO))
    for bad, match in (
        (hello_map(signatures=[]), "one per method"),
        (hello_map(streaming=["other"]), "not methods"),
    ):
        with pytest.raises(RemoteProtocolError, match=match):
            decode_control(header, packed_map(bad))
    with pytest.raises(LocalProtocolError, match="one per method"):
        encode_control(MessageKind.HELLO, Hello("e", "S", "f", 1, "h", 1, methods=("m",)))


# -- invalid local input -> LocalProtocolError ---------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: pack_call_header(0, "m"), "non-zero call_id"),
        (lambda: pack_call_header(2**64, "m"), "out of range"),
        (lambda: pack_call_header(-1, "m"), "out of range"),
        (lambda: pack_call_header(1, "m", timeout_ms=2**32), "out of range"),
        (lambda: pack_call_header(1, ""), "non-empty method"),
        (lambda: pack_call_header(1, "m" * 256), "limit"),
        (lambda: pack_call_header(1, "\ud800"), "UTF-8"),
        (lambda: pack_call_header(1, "m", flags=16), "unknown flag"),
        (lambda: pack_reply_header(MessageKind.CALL, 1), "pack_call_header"),
        (lambda: pack_reply_header(99, 1), "unknown message kind"),  # type: ignore[arg-type]
        (lambda: pack_reply_header(MessageKind.RESULT, 0), "non-zero call_id"),
        (lambda: pack_reply_header(MessageKind.HELLO, 1), "call_id must be 0"),
        (lambda: pack_reply_header(MessageKind.ATTACH, 1), "call_id must be 0"),
        (lambda: pack_reply_header(MessageKind.RESULT, 2**64), "out of range"),
        (lambda: encode_control(MessageKind.RESULT, None, 1), "codec payload"),
        (lambda: encode_control(MessageKind.HELLO, Bye()), "needs a Hello body"),
        (lambda: encode_control(MessageKind.PING, Bye()), "carries no body"),
        (lambda: encode_control(MessageKind.CREDIT, Credit(0), 1), "out of range"),
        (lambda: encode_control(MessageKind.BYE, Bye(1)), "must be a string"),  # type: ignore[arg-type]
        (lambda: encode_error(1, ErrorInfo(-1)), "out of range"),
        (lambda: encode_error(2**64, ErrorInfo(1)), "out of range"),
    ],
)
def test_invalid_local_messages_raise_local_protocol_error(call, match):
    with pytest.raises(LocalProtocolError, match=match):
        call()


# -- fuzz ----------------------------------------------------------------------------------


def check_only_protocol_errors(frames: list[bytes]) -> None:
    try:
        header, payload, _ = split_frames(frames)
        if header.kind not in (MessageKind.CALL, MessageKind.RESULT, MessageKind.STREAM_ITEM):
            decode_control(header, payload)
    except RemoteProtocolError:
        pass


@settings(max_examples=400)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_give_a_value_or_a_remote_protocol_error(frames):
    check_only_protocol_errors(frames)


@settings(max_examples=400)
@given(
    st.lists(
        st.builds(
            raw_header,
            magic=st.sampled_from([MAGIC, b"TQ"]),
            version=st.sampled_from([PROTOCOL_VERSION, 0, 2]),
            kind=st.integers(0, 15),
            flags=st.integers(0, 5),
            reserved=st.sampled_from([0, 0, 1]),
            call_id=st.sampled_from([0, 1, 2**64 - 1]),
            timeout_ms=st.sampled_from([0, 1]),
            tail=st.binary(max_size=8),
        ),
        min_size=1,
        max_size=1,
    ),
    st.one_of(
        st.binary(max_size=64),
        st.dictionaries(
            st.sampled_from(["reason", "n", "code", "type", "message", "traceback", "x"]),
            st.one_of(
                st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.booleans(), st.none()
            ),
        ).map(ormsgpack.packb),
    ),
    st.lists(st.binary(max_size=8), max_size=3),
)
def test_nearly_valid_messages_give_a_value_or_a_remote_protocol_error(head, payload, rest):
    check_only_protocol_errors([*head, payload, *rest])


@settings(max_examples=300)
@given(
    st.sampled_from(BODIES),
    st.integers(0, 10_000),
    st.integers(0, 255),
)
def test_mutated_valid_messages_give_a_value_or_a_remote_protocol_error(entry, position, byte):
    kind, body, call_id = entry
    frames = [bytearray(f) for f in encode_control(kind, body, call_id)]
    joined = frames[0] + frames[1]
    position %= max(len(joined), 1)
    joined[position] = byte
    check_only_protocol_errors([bytes(joined[: len(frames[0])]), bytes(joined[len(frames[0]) :])])


def test_a_call_header_carries_a_trace_context_after_the_method():
    trace = b"\x00" + bytes(range(1, 17)) + bytes(range(20, 28)) + b"\x01"
    frame = pack_call_header(7, "add", int(Flags.STREAM), 1500, trace)
    assert frame.endswith(b"add" + trace)
    header = unpack_header(frame)
    assert header.method == "add"
    assert header.trace == trace
    assert header.flags == Flags.STREAM | Flags.TRACE
    assert header.timeout_ms == 1500
    plain = unpack_header(pack_call_header(7, "add"))
    assert plain.trace == b""
    assert not plain.flags & Flags.TRACE


def test_a_trace_context_of_the_wrong_size_or_a_caller_set_trace_flag_is_refused():
    with pytest.raises(LocalProtocolError, match="26 bytes"):
        pack_call_header(7, "add", 0, 0, b"\x00" * 25)
    with pytest.raises(LocalProtocolError, match="unknown flag bits 0x10"):
        pack_call_header(7, "add", int(Flags.TRACE))


def test_a_call_header_carries_lease_ids_before_the_method():
    trace = b"\x00" + bytes(range(1, 17)) + bytes(range(20, 28)) + b"\x01"
    leases = (1, 2**40 + 7, 2**63 - 1)
    frame = pack_call_header(7, "add", int(Flags.NO_WAIT), 900, trace, leases)
    assert frame[20] == 3
    assert frame[21:45] == struct.pack("<3Q", *leases)
    assert frame[45:] == b"add" + trace
    header = unpack_header(frame)
    assert header.releases == leases
    assert header.method == "add"
    assert header.trace == trace
    assert header.flags == Flags.NO_WAIT | Flags.TRACE | Flags.RELEASES
    full = tuple(range(1, MAX_CALL_RELEASES + 1))
    assert unpack_header(pack_call_header(8, "m", releases=full)).releases == full
    plain = unpack_header(pack_call_header(7, "add"))
    assert plain.releases == ()
    assert not plain.flags & Flags.RELEASES


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: pack_call_header(7, "m", releases=[0]), "lease id 0"),
        (lambda: pack_call_header(7, "m", releases=[2**63]), "out of range"),
        (lambda: pack_call_header(7, "m", releases=[1.0]), "out of range"),  # type: ignore[list-item]
        (lambda: pack_call_header(7, "m", releases=[1] * 65), "at most 64"),
        (lambda: pack_call_header(7, "m", int(Flags.RELEASES)), "unknown flag bits 0x20"),
    ],
)
def test_bad_lease_ids_for_a_call_header_are_refused(call, match):
    with pytest.raises(LocalProtocolError, match=match):
        call()


def test_error_info_carries_the_refused_value_s_path_as_data() -> None:
    info = ErrorInfo(ErrorCode.INVALID_ARGUMENT, "", "req.items[3]: bad", "", ("req", "items", 3))
    header, payload, _ = split_frames(encode_error(7, info))
    wire = ormsgpack.unpackb(memoryview(payload))
    assert wire["path"] == ["req", "items", 3]
    decoded = decode_control(header, payload)
    assert decoded == info
    assert isinstance(decoded, ErrorInfo)
    error = decoded.to_exception()
    assert isinstance(error, InvalidArgumentError)
    assert error.path == ("req", "items", 3)
    for bad, match in (
        ({**wire, "path": "req"}, "must be a list"),
        ({**wire, "path": [1.5]}, "string or an integer"),
        ({**wire, "path": [True]}, "string or an integer"),
        ({**wire, "path": [-1]}, "out of range"),
        ({k: v for k, v in wire.items() if k != "path"}, "missing the field 'path'"),
    ):
        with pytest.raises(RemoteProtocolError, match=match):
            decode_control(header, ormsgpack.packb(bad))
    # a key an ERROR cannot carry (a control character) leaves the path out, not the ERROR
    odd = ErrorInfo(ErrorCode.INVALID_ARGUMENT, "", "m", "", ("req", "a\x1b"))
    assert decode_control(*split_frames(encode_error(7, odd))[:2]) == ErrorInfo(
        ErrorCode.INVALID_ARGUMENT, "", "m", "", ()
    )


def test_path_parts_reads_a_validation_path() -> None:
    assert path_parts("req.items[3].tags['k.x']") == ("req", "items", 3, "tags", "k.x")
    assert path_parts("result") == ("result",)


def test_session_fields_round_trip_and_name_a_session_and_a_bound() -> None:
    hello = Hello("e", "S", "f", 1, "h", 5, epoch=2**64 - 1, dead_after_ms=5000)
    welcome = Welcome("c", "h", epoch=1, dead_after_ms=2**32 - 1, fingerprint="ab" * 32)
    for kind, body in ((MessageKind.HELLO, hello), (MessageKind.WELCOME, welcome)):
        header, payload, _ = split_frames(encode_control(kind, body))
        wire = ormsgpack.unpackb(memoryview(payload))
        assert decode_control(header, payload) == body
        for key, bad, match in (
            ("epoch", 0, "out of range 1.."),  # epoch 0 names no session
            ("dead_after_ms", 0, "out of range 1.."),  # nor 0 a bound
            ("epoch", -1, "out of range"),
            ("dead_after_ms", 2**32, "out of range"),
            ("epoch", True, "must be an integer"),
        ):
            with pytest.raises(RemoteProtocolError, match=match):
                decode_control(header, ormsgpack.packb({**wire, key: bad}))
    header, payload, _ = split_frames(encode_control(MessageKind.WELCOME, welcome))
    wire = ormsgpack.unpackb(memoryview(payload))
    with pytest.raises(RemoteProtocolError, match="must be a string"):
        decode_control(header, ormsgpack.packb({**wire, "fingerprint": 7}))
