"""CURVE end to end: an allowed client calls, a wrong key or plaintext cannot, bytes are sealed.

The engine binds ``tcp://127.0.0.1`` as the CURVE server with an allow-list; clients dial it
through a small TCP relay that records every byte in both directions, so the test can show
that a marker sent in a call (and echoed back) never appears on the wire with CURVE, and
does without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from tensorrpc._client import Client
from tensorrpc._exceptions import EnginesUnavailableError
from tensorrpc._security import (
    CurveClientConfig,
    CurveKeyPair,
    CurveServerConfig,
    auth_statistics,
    generate_keypair,
)
from tensorrpc._server import Server

from .services import Calculator

WAIT = 20.0
#: How long a refused client waits for engines before it gives up.
REFUSED_WAIT = 1.0
MARKER = "sealed-marker-7f3a9c"


class Relay:
    """A TCP relay on 127.0.0.1 that forwards to ``target`` and records all traffic."""

    def __init__(self) -> None:
        self.upstream = bytearray()  # client -> engine
        self.downstream = bytearray()  # engine -> client

    @property
    def traffic(self) -> bytes:
        return bytes(self.upstream) + bytes(self.downstream)


async def _pump(src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream, record: bytearray) -> None:
    with contextlib.suppress(
        anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError
    ):
        async for chunk in src:
            record += chunk
            await dst.send(chunk)
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await dst.aclose()


@contextlib.asynccontextmanager
async def relay_to(target: str) -> AsyncIterator[tuple[str, Relay]]:
    host, _, port = target.removeprefix("tcp://").rpartition(":")
    relay = Relay()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def handle(client: anyio.abc.SocketStream) -> None:
        async with client:
            try:
                server = await anyio.connect_tcp(host, int(port))
            except OSError:
                return
            async with server, anyio.create_task_group() as tg:
                tg.start_soon(_pump, client, server, relay.upstream)
                tg.start_soon(_pump, server, client, relay.downstream)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        port_number = listener.extra(anyio.abc.SocketAttribute.local_port)
        yield f"tcp://127.0.0.1:{port_number}", relay
        tg.cancel_scope.cancel()


def _client(address: str, curve: CurveClientConfig | None) -> Client[Calculator]:
    return Client(Calculator, connect=address, curve=curve, heartbeat_interval=0.1, dead_after=1.0)


@pytest.fixture
def keys() -> dict[str, CurveKeyPair]:
    return {name: generate_keypair() for name in ("engine", "allowed", "stranger")}


async def test_allowed_key_calls_and_traffic_is_encrypted(keys: dict[str, CurveKeyPair]) -> None:
    server_curve = CurveServerConfig(keys["engine"], allowed_clients=[keys["allowed"].public_key])
    client_curve = CurveClientConfig(keys["allowed"], keys["engine"].public_key)
    async with Server(
        Calculator("c1"), bind="tcp://127.0.0.1:0", engine_id="c1", curve=server_curve
    ) as server:
        assert server.endpoint is not None
        async with relay_to(server.endpoint) as (address, relay):
            async with _client(address, client_curve) as client:
                with anyio.fail_after(WAIT):
                    await client.wait_for_engines(1)
                    assert await client.stub().echo(MARKER) == f"c1:{MARKER}"
            assert relay.upstream
            assert relay.downstream
            assert MARKER.encode() not in relay.traffic
            assert b"Calculator" not in relay.traffic  # not even the HELLO is readable
        stats = auth_statistics(server._sockets[0].socket)
        assert stats.accepted >= 1
        assert stats.denied == 0


async def test_plaintext_through_the_relay_is_readable() -> None:
    """The control for the test above: without CURVE the relay sees the marker."""
    async with Server(Calculator("p1"), bind="tcp://127.0.0.1:0", engine_id="p1") as server:
        assert server.endpoint is not None
        async with relay_to(server.endpoint) as (address, relay):
            async with _client(address, None) as client:
                with anyio.fail_after(WAIT):
                    await client.wait_for_engines(1)
                    assert await client.stub().echo(MARKER) == f"p1:{MARKER}"
            assert MARKER.encode() in relay.traffic


@pytest.mark.parametrize("who", ["stranger", "plaintext", "wrong-server-key"])
async def test_client_without_the_right_key_cannot_call(
    keys: dict[str, CurveKeyPair], who: str
) -> None:
    server_curve = CurveServerConfig(keys["engine"], allowed_clients=[keys["allowed"].public_key])
    curve: CurveClientConfig | None
    if who == "stranger":
        curve = CurveClientConfig(keys["stranger"], keys["engine"].public_key)
    elif who == "wrong-server-key":
        curve = CurveClientConfig(keys["allowed"], keys["stranger"].public_key)
    else:
        curve = None
    async with Server(
        Calculator("c2"), bind="tcp://127.0.0.1:0", engine_id="c2", curve=server_curve
    ) as server:
        assert server.endpoint is not None
        async with _client(server.endpoint, curve) as refused:
            with anyio.fail_after(REFUSED_WAIT + WAIT), pytest.raises(EnginesUnavailableError):
                await refused.wait_for_engines(1, timeout=REFUSED_WAIT)
            assert refused.engines == {}
        if who == "stranger":
            assert auth_statistics(server._sockets[0].socket).denied >= 1
        # the engine still serves the allowed client
        allowed = CurveClientConfig(keys["allowed"], keys["engine"].public_key)
        async with _client(server.endpoint, allowed) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
                assert await client.stub().add(2, 3) == 5
        assert server.statistics().calls >= 1


async def test_engines_dial_in_to_a_curve_client(
    tmp_path: Path, keys: dict[str, CurveKeyPair]
) -> None:
    """The binding side is the CURVE server: here the client, with an allow-list of engines."""
    client_curve = CurveServerConfig(keys["allowed"], allowed_clients=[keys["engine"].public_key])
    async with Client(
        Calculator,
        bind="tcp://127.0.0.1:0",
        curve=client_curve,
        heartbeat_interval=0.1,
        dead_after=1.0,
    ) as client:
        (address,) = client.addresses
        good = CurveClientConfig(keys["engine"], keys["allowed"].public_key)
        bad = CurveClientConfig(keys["stranger"], keys["allowed"].public_key)
        async with (
            Server(Calculator("good"), connect=address, engine_id="good", curve=good),
            Server(Calculator("bad"), connect=address, engine_id="bad", curve=bad),
        ):
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
                assert await client.with_options(engine="good").stub().whoami() == "good"
            with pytest.raises(EnginesUnavailableError):
                await client.wait_for_engines(2, timeout=REFUSED_WAIT)
            assert set(client.engines) == {"good"}
