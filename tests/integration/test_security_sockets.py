"""CURVE, ZAP and the exposure warning on real ZMQ sockets (loopback tcp and inproc).

The key, allow-list and endpoint rules without sockets: tests/unit/test_security.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.abc
import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from tensorrpc._exceptions import ConnectError
from tensorrpc._security import (
    ZAP_ENDPOINT,
    CurveClientConfig,
    CurveKeyPair,
    CurveServerConfig,
    ZapAuthenticator,
    auth_statistics,
    generate_keypair,
    warn_if_exposed,
)
from tensorrpc._zmq import AsyncSocket, create_socket

SocketFactory = Callable[..., AsyncSocket]

#: Bound on every wait for something that must happen.
WAIT_S = 10.0
#: How long we watch for a message that must not arrive (after the refusal was observed).
QUIET_S = 0.5
LOOPBACK = "tcp://127.0.0.1:0"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@pytest.fixture(autouse=True)
def _no_zap_handler_left() -> Iterator[None]:
    """Torn down after ``make_socket`` (autouse fixtures are set up first): once every
    socket is closed, no ZAP handler is left on the process-wide context."""
    yield
    assert ZapAuthenticator.for_context(zmq.Context.instance()) is None


@pytest.fixture
def server_keys() -> CurveKeyPair:
    return generate_keypair()


@pytest.fixture
def client_keys() -> CurveKeyPair:
    return generate_keypair()


@contextlib.contextmanager
def monitored(sock: AsyncSocket, events: int) -> Iterator[AsyncSocket]:
    """A socket monitor for ``events`` of ``sock``, wrapped for anyio; closed on exit."""
    monitor = AsyncSocket(sock.socket.get_monitor_socket(events))
    try:
        yield monitor
    finally:
        sock.socket.disable_monitor()
        monitor.close()


async def next_event(monitor: AsyncSocket, events: int) -> int:
    """Wait (bounded) for the next monitor event in ``events`` and return it."""
    with anyio.fail_after(WAIT_S):
        while True:
            frames = await monitor.recv()
            event = int(parse_monitor_message([f.bytes for f in frames])["event"])
            if event & events:
                return event


def offer(sock: AsyncSocket, frames: list[bytes]) -> None:
    """Queue ``frames`` if the socket takes them (a refused connection may leave no pipe)."""
    with contextlib.suppress(anyio.WouldBlock):
        sock.send_nowait(frames)


async def assert_nothing_arrives(sock: AsyncSocket) -> None:
    with anyio.move_on_after(QUIET_S):
        frames = await sock.recv()
        pytest.fail(f"a message got through: {[f.bytes for f in frames]!r}")


def curve_pair(
    make_socket: SocketFactory,
    server_keys: CurveKeyPair,
    client_keys: CurveKeyPair,
    *,
    allowed: list[bytes] | None,
    server_binds: bool = True,
) -> tuple[AsyncSocket, AsyncSocket]:
    """A CURVE-server ROUTER and a CURVE-client DEALER, connected either way round."""
    router = make_socket(zmq.ROUTER, curve=CurveServerConfig(server_keys, allowed))
    dealer = make_socket(
        zmq.DEALER,
        routing_id=b"dealer-1",
        curve=CurveClientConfig(client_keys, server_keys.public_key),
    )
    if server_binds:
        dealer.connect(router.bind(LOOPBACK))
    else:
        router.connect(dealer.bind(LOOPBACK))
    return router, dealer


@pytest.mark.parametrize("server_binds", [True, False], ids=["server-binds", "server-connects"])
async def test_allowed_client_exchanges_messages_and_is_identified(
    anyio_backend, make_socket, server_keys, client_keys, server_binds
):
    router, dealer = curve_pair(
        make_socket,
        server_keys,
        client_keys,
        allowed=[generate_keypair().public_key, client_keys.public_key],
        server_binds=server_binds,
    )
    with anyio.fail_after(WAIT_S):
        await dealer.send([b"ping"])
        frames = await router.recv()
        assert [f.bytes for f in frames] == [b"dealer-1", b"ping"]
        assert frames[1].get("User-Id") == client_keys.public_key.decode()
        await router.send([frames[0], b"pong"])
        assert [f.bytes for f in await dealer.recv()] == [b"pong"]
    stats = auth_statistics(router.socket)
    assert stats.accepted >= 1
    assert stats.denied == 0


async def test_server_without_allow_list_accepts_any_client_knowing_its_key(
    anyio_backend, make_socket, server_keys, client_keys
):
    router, dealer = curve_pair(make_socket, server_keys, client_keys, allowed=None)
    with anyio.fail_after(WAIT_S):
        await dealer.send([b"ping"])
        frames = await router.recv()
    assert frames[1].bytes == b"ping"
    assert frames[1].get("User-Id") == client_keys.public_key.decode()


async def refused(
    make_socket: SocketFactory,
    server: CurveServerConfig | None,
    client: CurveClientConfig | None,
) -> tuple[int, AsyncSocket]:
    """A DEALER (``client``) offers a message to a ROUTER (``server``) that must refuse its
    handshake: the failure event, and the ROUTER, once nothing got through."""
    router = make_socket(zmq.ROUTER, curve=server)
    with monitored(router, HANDSHAKE_FAILED) as monitor:
        dealer = make_socket(zmq.DEALER, curve=client)
        dealer.connect(router.bind(LOOPBACK))
        offer(dealer, [b"let me in"])
        event = await next_event(monitor, HANDSHAKE_FAILED)
    await assert_nothing_arrives(router)
    return event, router


async def test_unlisted_client_is_refused_and_its_message_never_arrives(
    anyio_backend, make_socket, server_keys, client_keys
):
    server = CurveServerConfig(server_keys, [generate_keypair().public_key])
    client = CurveClientConfig(client_keys, server_keys.public_key)
    event, router = await refused(make_socket, server, client)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert auth_statistics(router.socket).denied >= 1
    assert auth_statistics(router.socket).accepted == 0


async def test_empty_allow_list_refuses_everyone(
    anyio_backend, make_socket, server_keys, client_keys
):
    server = CurveServerConfig(server_keys, [])
    client = CurveClientConfig(client_keys, server_keys.public_key)
    event, _ = await refused(make_socket, server, client)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH


async def test_client_with_the_wrong_server_key_cannot_talk(
    anyio_backend, make_socket, server_keys, client_keys
):
    impostor_target = generate_keypair().public_key
    server = CurveServerConfig(server_keys, None)
    await refused(make_socket, server, CurveClientConfig(client_keys, impostor_target))


async def test_plaintext_client_cannot_talk_to_a_curve_server(
    anyio_backend, make_socket, server_keys
):
    event, _ = await refused(make_socket, CurveServerConfig(server_keys, None), None)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


async def test_curve_client_does_not_talk_to_a_plaintext_server(
    anyio_backend, make_socket, server_keys, client_keys
):
    client = CurveClientConfig(client_keys, server_keys.public_key)
    event, _ = await refused(make_socket, None, client)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


async def test_servers_in_one_process_keep_separate_allow_lists(anyio_backend, make_socket):
    keys_a, keys_b, alice, bob = (generate_keypair() for _ in range(4))
    server_a = make_socket(zmq.ROUTER, curve=CurveServerConfig(keys_a, [alice.public_key]))
    server_b = make_socket(zmq.ROUTER, curve=CurveServerConfig(keys_b, [bob.public_key]))
    alice_to_a = make_socket(zmq.DEALER, curve=CurveClientConfig(alice, keys_a.public_key))
    alice_to_a.connect(server_a.bind(LOOPBACK))
    with monitored(server_b, HANDSHAKE_FAILED) as monitor:
        alice_to_b = make_socket(zmq.DEALER, curve=CurveClientConfig(alice, keys_b.public_key))
        alice_to_b.connect(server_b.bind(LOOPBACK))
        offer(alice_to_b, [b"to b"])
        assert await next_event(monitor, HANDSHAKE_FAILED) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    with anyio.fail_after(WAIT_S):
        await alice_to_a.send([b"to a"])
        assert (await server_a.recv())[1].bytes == b"to a"
    await assert_nothing_arrives(server_b)
    assert auth_statistics(server_a.socket).denied == 0
    assert auth_statistics(server_b.socket).accepted == 0


async def test_zap_handler_lives_exactly_as_long_as_its_servers(
    anyio_backend, server_keys, client_keys
):
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    assert ZapAuthenticator.for_context(ctx) is None
    first = create_socket(zmq.ROUTER, curve=CurveServerConfig(server_keys, None))
    second = create_socket(zmq.ROUTER, curve=CurveServerConfig(server_keys, None))
    auth = ZapAuthenticator.for_context(ctx)
    assert auth is not None
    running = auth.running
    assert running
    await first.aclose()
    assert ZapAuthenticator.for_context(ctx) is auth
    await second.aclose()
    assert ZapAuthenticator.for_context(ctx) is None
    running = auth.running
    assert not running
    # The endpoint is free again: a new server starts a new handler and works.
    router = create_socket(
        zmq.ROUTER, curve=CurveServerConfig(server_keys, [client_keys.public_key])
    )
    dealer = create_socket(zmq.DEALER, curve=CurveClientConfig(client_keys, server_keys.public_key))
    async with router, dealer:
        dealer.connect(router.bind(LOOPBACK))
        with anyio.fail_after(WAIT_S):
            await dealer.send([b"again"])
            assert (await router.recv())[1].bytes == b"again"
    assert ZapAuthenticator.for_context(ctx) is None


def test_a_foreign_zap_handler_on_the_context_is_reported(server_keys):
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    foreign = ctx.socket(zmq.REP)
    try:
        foreign.bind(ZAP_ENDPOINT)
        with pytest.raises(ConnectError, match="another ZAP handler"):
            create_socket(zmq.ROUTER, context=ctx, curve=CurveServerConfig(server_keys, None))
        assert ZapAuthenticator.for_context(ctx) is None
    finally:
        foreign.close(linger=0)
        ctx.term()


def test_socket_options_name_the_curve_role(make_socket, server_keys, client_keys):
    server = make_socket(zmq.DEALER, curve=CurveServerConfig(server_keys, None))
    client = make_socket(zmq.DEALER, curve=CurveClientConfig(client_keys, server_keys.public_key))
    plain = make_socket(zmq.DEALER)
    assert server.socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
    assert server.socket.getsockopt(zmq.CURVE_SERVER) == 1
    assert server.socket.getsockopt_string(zmq.ZAP_DOMAIN).startswith("tensorrpc.")
    assert client.socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
    assert client.socket.getsockopt(zmq.CURVE_SERVER) == 0
    assert plain.socket.getsockopt(zmq.MECHANISM) == zmq.NULL
    with pytest.raises(ValueError, match="not a tensorrpc CURVE server"):
        auth_statistics(client.socket)


def test_create_socket_refuses_a_non_curve_config():
    with pytest.raises(TypeError, match="CurveServerConfig or CurveClientConfig"):
        create_socket(zmq.DEALER, curve=object())  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def tcp_relay(target_port: int) -> AsyncIterator[tuple[int, bytearray]]:
    """Forward 127.0.0.1:PORT to ``target_port`` and record every byte on the wire."""
    captured = bytearray()

    async def pump(src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in src:
                captured.extend(chunk)
                await dst.send(chunk)

    async def handle(downstream: anyio.abc.SocketStream) -> None:
        async with (
            downstream,
            await anyio.connect_tcp("127.0.0.1", target_port) as upstream,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(pump, downstream, upstream)
            tg.start_soon(pump, upstream, downstream)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        try:
            yield port, captured
        finally:
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
async def test_traffic_on_the_wire_is_encrypted_only_with_curve(
    anyio_backend, make_socket, server_keys, client_keys, curve
):
    request = b"tensorrpc-request-marker-" + os.urandom(8).hex().encode()
    reply = b"tensorrpc-reply-marker-" + os.urandom(8).hex().encode()
    server_cfg = CurveServerConfig(server_keys, [client_keys.public_key]) if curve else None
    client_cfg = CurveClientConfig(client_keys, server_keys.public_key) if curve else None
    router = make_socket(zmq.ROUTER, curve=server_cfg)
    dealer = make_socket(zmq.DEALER, curve=client_cfg)
    port = int(router.bind(LOOPBACK).rsplit(":", 1)[1])
    async with tcp_relay(port) as (relay_port, captured):
        dealer.connect(f"tcp://127.0.0.1:{relay_port}")
        with anyio.fail_after(WAIT_S):
            await dealer.send([request * 4])
            frames = await router.recv()
            assert frames[1].bytes == request * 4
            await router.send([frames[0], reply])
            assert (await dealer.recv())[0].bytes == reply
        dealer.close()
        router.close()
    wire = bytes(captured)
    assert len(wire) > len(request) * 4 + len(reply)  # the traffic did pass the relay
    if curve:
        assert request not in wire
        assert reply not in wire
    else:
        assert request in wire
        assert reply in wire


def security_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tensorrpc.security" and r.levelno == logging.WARNING
    ]


def test_loopback_bind_does_not_warn(make_socket, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="tensorrpc.security")
    make_socket(zmq.ROUTER).bind(LOOPBACK)
    assert security_warnings(caplog) == []


def test_binding_all_interfaces_without_curve_warns(make_socket, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="tensorrpc.security")
    make_socket(zmq.ROUTER).bind("tcp://0.0.0.0:0")
    (message,) = security_warnings(caplog)
    assert "tcp://0.0.0.0:0 without CURVE" in message
    assert "CVE-2025-30202" in message


def test_a_non_loopback_address_without_curve_gets_one_warning(
    caplog: pytest.LogCaptureFixture,
):
    # Checked before a bind, without binding: tests use loopback only.
    caplog.set_level(logging.WARNING, logger="tensorrpc.security")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with context.socket(zmq.ROUTER) as plain, context.socket(zmq.ROUTER) as curve:
        assert warn_if_exposed("tcp://192.0.2.7:5555", plain)
        assert warn_if_exposed("tcp://host.example:5555", plain)
        assert not warn_if_exposed("tcp://127.0.0.1:5555", plain)
        assert not warn_if_exposed("ipc:///tmp/x", plain)
        curve.curve_server = True
        curve.curve_secretkey = generate_keypair().secret_key
        assert not warn_if_exposed("tcp://192.0.2.7:5555", curve)
    first, second = security_warnings(caplog)
    assert "tcp://192.0.2.7:5555 without CURVE" in first
    assert "tcp://host.example:5555 without CURVE" in second


def test_binding_all_interfaces_with_curve_does_not_warn(
    make_socket, server_keys, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, logger="tensorrpc.security")
    make_socket(zmq.ROUTER, curve=CurveServerConfig(server_keys, [])).bind("tcp://0.0.0.0:0")
    assert security_warnings(caplog) == []
