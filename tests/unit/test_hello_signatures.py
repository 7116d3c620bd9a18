"""HELLO's ``streaming`` and ``signatures`` fields: required, one signature per method."""

from __future__ import annotations

import ormsgpack
import pytest

from tensorrpc._exceptions import RemoteProtocolError
from tensorrpc._protocol import Hello, MessageKind, decode_control, encode_control, unpack_header


def _hello(**extra: object) -> Hello:
    fields: dict[str, object] = {"signatures": ("add() -> int", "count() -> int"), **extra}
    return Hello(
        engine_id="e1",
        service="Calculator",
        fingerprint="ab" * 32,
        protocol_version=1,
        host_id="h",
        pid=1,
        methods=("add", "count"),
        **fields,  # type: ignore[arg-type]
    )


def test_streaming_and_signatures_round_trip() -> None:
    hello = _hello(streaming=("count",), signatures=("add(a: int) -> int", "count(n: int) -> x"))
    header, payload = encode_control(MessageKind.HELLO, hello)
    assert decode_control(unpack_header(header), payload) == hello


def test_a_hello_without_them_is_refused() -> None:
    header, payload = encode_control(MessageKind.HELLO, _hello())
    wire = ormsgpack.unpackb(payload)
    for key in ("streaming", "signatures"):
        partial = {k: v for k, v in wire.items() if k != key}
        with pytest.raises(RemoteProtocolError, match=f"missing the field {key!r}"):
            decode_control(unpack_header(header), ormsgpack.packb(partial))
