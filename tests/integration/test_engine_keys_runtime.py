"""Engine ids bound to CURVE keys while the client runs (``Client.bind_engine_keys``).

What ``tensorrpc.ray.launch`` does for the engines it starts (issue 21 item 5): a client
whose CURVE allow-list starts empty admits only the keys bound at run time, each id only
with its own key, and a key unbound again is refused at its next handshake.
"""

from __future__ import annotations

import anyio
import pytest

from tensorrpc._client import Client
from tensorrpc._exceptions import HandshakeRejectedError
from tensorrpc._security import (
    CurveClientConfig,
    CurveServerConfig,
    auth_statistics,
    generate_keypair,
)
from tensorrpc._server import Server, serve

from .services import Calculator


def _keys(client: Client[Calculator]) -> object:
    return client.engine_keys


async def _denied_more_than(client: Client[Calculator], before: int) -> None:
    """Wait (bounded) until the client's CURVE server refused another handshake."""
    sock = client._io.sock
    assert sock is not None
    with anyio.fail_after(30):
        while auth_statistics(sock.socket).denied <= before:  # noqa: ASYNC110 - ZAP thread
            await anyio.sleep(0.02)


async def _refused_key(
    client: Client[Calculator], curve: CurveClientConfig, engine_id: str
) -> None:
    """An engine dialling with ``curve`` is refused by the allow-list and never joins."""
    sock = client._io.sock
    assert sock is not None
    before = auth_statistics(sock.socket).denied
    (address,) = client.addresses
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: serve(Calculator("x"), connect=address, engine_id=engine_id, curve=curve)
        )
        await _denied_more_than(client, before)
        tg.cancel_scope.cancel()
    assert engine_id not in client.engines


async def test_only_keys_bound_at_run_time_join_each_with_its_own_id() -> None:
    client_keys, real, stranger = (generate_keypair() for _ in range(3))
    curve = CurveServerConfig(client_keys, allowed_clients=frozenset())  # nobody, at first
    async with Client(Calculator, bind="tcp://127.0.0.1:0", curve=curve) as client:
        (address,) = client.addresses
        assert _keys(client) is None
        client.bind_engine_keys({"e1": real.public_key})
        assert client.engine_keys == {"e1": real.public_key.decode()}
        with pytest.raises(ValueError, match="already bound to another key: e1"):
            client.bind_engine_keys({"e1": stranger.public_key})

        # A key that is not bound is refused by the allow-list, whatever id it claims.
        await _refused_key(client, CurveClientConfig(stranger, client_keys.public_key), "e1")
        mine = CurveClientConfig(real, client_keys.public_key)
        with anyio.fail_after(30):
            # The bound key passes the allow-list, but only under its own id.
            with pytest.raises(HandshakeRejectedError, match="not bound to a key"):
                await serve(Calculator("other"), connect=address, engine_id="e2", curve=mine)
            async with Server(Calculator("real"), connect=address, engine_id="e1", curve=mine):
                await client.wait_for_engines(1, timeout=30)  # e2 was just refused
                assert await client.stub().whoami() == "real"

                # Unbound: the live engine stays; the key's next handshake is refused.
                client.unbind_engine_keys(["e1", "never-bound"])
                assert _keys(client) is None
                assert "e1" in client.engines
                await _refused_key(client, mine, "e3")


async def test_keys_given_at_build_time_stay_bound() -> None:
    client_keys, built, added = (generate_keypair() for _ in range(3))
    curve = CurveServerConfig(client_keys, allowed_clients=[built.public_key])
    async with Client(
        Calculator,
        bind="tcp://127.0.0.1:0",
        curve=curve,
        engine_keys={"e1": built.public_key},
    ) as client:
        client.bind_engine_keys({"e1": built.public_key, "e2": added.public_key})
        assert dict(client.engine_keys or {}) == {
            "e1": built.public_key.decode(),
            "e2": added.public_key.decode(),
        }
        client.unbind_engine_keys(["e1", "e2"])  # e1 came with the client: it stays
        assert dict(client.engine_keys or {}) == {"e1": built.public_key.decode()}
        (address,) = client.addresses
        mine = CurveClientConfig(built, client_keys.public_key)
        with anyio.fail_after(30):
            async with Server(Calculator("built"), connect=address, engine_id="e1", curve=mine):
                await client.wait_for_engines(1)


async def test_binding_needs_an_open_curve_server_client() -> None:
    key = generate_keypair().public_key
    async with Client(Calculator, bind="tcp://127.0.0.1:0") as client:
        with pytest.raises(ValueError, match="needs curve=CurveServerConfig"):
            client.bind_engine_keys({"e1": key})
    closed = Client(
        Calculator,
        bind="tcp://127.0.0.1:0",
        curve=CurveServerConfig(generate_keypair(), allowed_clients=frozenset()),
    )
    with pytest.raises(Exception, match="not open"):
        closed.bind_engine_keys({"e1": key})
