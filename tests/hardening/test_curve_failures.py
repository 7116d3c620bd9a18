"""CURVE failures are logged on both sides with libzmq's reason, and the wait says so.

Before, a key not on the allow-list, a wrong server key and a plaintext client all ended
as "0 of 1 engines live after 3 s" with nothing logged at any level. Each socket now reads
libzmq's handshake-failure events (a socket monitor: the ZAP status code for a refused
key, the protocol error for a mechanism mismatch or a cryptographic failure) and logs
them at WARNING on ``tensorrpc.security``; ``wait_for_engines`` names them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import pytest

from tensorrpc._client import Client
from tensorrpc._engines import unavailable_message
from tensorrpc._exceptions import EnginesUnavailableError
from tensorrpc._security import (
    CurveClientConfig,
    CurveKeyPair,
    CurveServerConfig,
    describe_handshake_failure,
    generate_keypair,
)
from tensorrpc._server import Server
from tests.integration.services import Calculator

WAIT = 30.0

#: case -> (what the client's socket reports, what the engine's socket reports)
CASES = {
    "key-not-allowed": (
        "authentication failed (ZAP status 400: the CURVE server refused this client key",
        "authentication failed (ZAP status 400",
    ),
    "wrong-server-key": ("failed without detail", "CURVE cryptographic error"),
    "plaintext-client": ("security mechanism mismatch", "security mechanism mismatch"),
}


class Warnings(logging.Handler):
    """Collects WARNINGs of tensorrpc.security; ``seen`` fires once both texts appeared."""

    def __init__(self, client_text: str, engine_text: str) -> None:
        super().__init__(logging.WARNING)
        self.wanted = {
            "CURVE client" if "mismatch" not in client_text else "plaintext": client_text,
            "CURVE server": engine_text,
        }
        self.messages: list[str] = []
        self.seen = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if all(
            any(text in m and role in m for m in self.messages)
            for role, text in self.wanted.items()
        ):
            self.seen.set()


@pytest.fixture
def security_log() -> Iterator[logging.Logger]:
    logger = logging.getLogger("tensorrpc.security")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield logger
    logger.setLevel(level)


@pytest.fixture
def keys() -> dict[str, CurveKeyPair]:
    return {name: generate_keypair() for name in ("engine", "allowed", "stranger")}


@pytest.mark.parametrize("case", list(CASES))
async def test_curve_failures_are_logged_on_both_sides_and_named_by_the_wait(
    case: str, keys: dict[str, CurveKeyPair], security_log: logging.Logger
) -> None:
    client_text, engine_text = CASES[case]
    server_curve = CurveServerConfig(keys["engine"], allowed_clients=[keys["allowed"].public_key])
    curve: CurveClientConfig | None = {
        "key-not-allowed": CurveClientConfig(keys["stranger"], keys["engine"].public_key),
        "wrong-server-key": CurveClientConfig(keys["allowed"], keys["stranger"].public_key),
        "plaintext-client": None,
    }[case]
    handler = Warnings(client_text, engine_text)
    security_log.addHandler(handler)
    try:
        async with Server(
            Calculator("e"),
            bind="tcp://127.0.0.1:0",
            engine_id="e",
            curve=server_curve,
            heartbeat_interval=0.05,
        ) as server:
            assert server.endpoint is not None
            async with Client(
                Calculator, connect=server.endpoint, curve=curve, heartbeat_interval=0.05
            ) as client:
                with anyio.fail_after(WAIT):
                    await handler.seen.wait()
                with pytest.raises(EnginesUnavailableError) as info:
                    await client.wait_for_engines(1, timeout=0.05)
    finally:
        security_log.removeHandler(handler)
    assert "handshakes failed (CURVE)" in str(info.value)
    assert client_text in str(info.value)


def test_handshake_failures_are_described_in_words() -> None:
    import zmq

    auth = describe_handshake_failure(int(zmq.EVENT_HANDSHAKE_FAILED_AUTH), 400, "tcp://h:1")
    assert auth.startswith("handshake on tcp://h:1: authentication failed (ZAP status 400")
    mismatch = describe_handshake_failure(
        int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
        int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH),
        "tcp://h:1",
    )
    assert "mechanism mismatch" in mismatch
    assert "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH" in mismatch
    odd = describe_handshake_failure(int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL), 7, "x")
    assert "protocol error" in odd
    bare = describe_handshake_failure(int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL), 32, "x")
    assert "errno 32" in bare


def test_the_wait_names_at_most_three_distinct_failures() -> None:
    failures = ("a", "b", "a", "c", "d", "d")
    text = unavailable_message(0, 1, 1.0, {}, failures)
    assert text.endswith("handshakes failed (CURVE): a; c; d")
