"""HELLO's optional ``streaming`` and ``signatures`` fields: sent by new engines, absent in old."""

from __future__ import annotations

import ormsgpack

from tensorrpc._protocol import Hello, MessageKind, decode_control, encode_control, unpack_header


def _hello(**extra: object) -> Hello:
    return Hello(
        engine_id="e1",
        service="Calculator",
        fingerprint="ab" * 32,
        protocol_version=1,
        host_id="h",
        pid=1,
        methods=("add", "count"),
        **extra,  # type: ignore[arg-type]
    )


def test_streaming_and_signatures_round_trip() -> None:
    hello = _hello(streaming=("count",), signatures=("add(a: int) -> int", "count(n: int) -> x"))
    header, payload = encode_control(MessageKind.HELLO, hello)
    assert decode_control(unpack_header(header), payload) == hello


def test_a_hello_without_them_still_parses() -> None:
    header, payload = encode_control(MessageKind.HELLO, _hello())
    wire = ormsgpack.unpackb(payload)
    for key in ("streaming", "signatures", "probe"):
        wire.pop(key, None)
    decoded = decode_control(unpack_header(header), ormsgpack.packb(wire))
    assert isinstance(decoded, Hello)
    assert decoded.methods == ("add", "count")
    assert decoded.streaming == ()
    assert decoded.signatures == ()
