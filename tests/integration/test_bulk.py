"""The bulk connection per peer (issue 26, docs/design.md): wired, bound, not hijackable.

Large CALLs and unary RESULTs travel on a second connection of the session, so that the
small calls behind them do not wait for their bytes on the control connection. These
tests check that they really go there in both topologies, that a third process cannot
attach to a session's bulk connection even with the session's token, and that nothing
is left open once either side has gone. Nothing here times anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import zmq

from tensorrpc._bulk_io import BulkLinks
from tensorrpc._client import Client
from tensorrpc._exceptions import EngineDeadError
from tensorrpc._protocol import Attach, MessageKind, encode_control
from tensorrpc._security import CurveClientConfig, CurveServerConfig, generate_keypair
from tensorrpc._server import Server
from tensorrpc._service import rpc, service
from tests.engine_proc import EngineProcess
from tests.transports._engine import TensorService

LARGE = 4 << 20  # above the bulk threshold (1 MiB)
SMALL = 64 << 10  # out of band, below the bulk threshold
WAIT = 30.0
TOPOLOGIES = ["dialin", "listen"]


@service(name="Bulky")
class Bulky:
    @rpc
    async def echo(self, t: torch.Tensor) -> torch.Tensor:
        """Send the tensor back."""
        return t

    @rpc
    async def add(self, a: int, b: int) -> int:
        """A small call."""
        return a + b


async def until(predicate: Callable[[], object]) -> None:
    """Wait until ``predicate()`` holds, at most `WAIT` seconds."""
    with anyio.fail_after(WAIT):
        while not predicate():  # noqa: ASYNC110 - bounded; other tasks or processes change it
            await anyio.sleep(0.01)


class Seen:
    """The sizes of the messages each side's bulk connections delivered."""

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {"client": [], "engine": []}

    def watch(self, links: BulkLinks, side: str) -> None:
        deliver = links._deliver

        def watching(key: Hashable, frames: list[zmq.Frame], size: int) -> None:
            self.sizes[side].append(size)
            deliver(key, frames, size)

        links._deliver = watching


@asynccontextmanager
async def pair(
    tmp_path: Path, topology: str, seen: Seen | None = None
) -> AsyncIterator[tuple[Client[Bulky], Server]]:
    address = f"ipc://{tmp_path}/b.sock"
    if topology == "dialin":
        client = Client(Bulky, bind=address, heartbeat_interval=0.1)
        server = Server(Bulky(), engine_id="e1", connect=address, heartbeat_interval=0.1)
    else:
        server = Server(Bulky(), engine_id="e1", bind=address, heartbeat_interval=0.1)
        client = Client(Bulky, connect=address, heartbeat_interval=0.1)
    if seen is not None:  # before the readers start (they read ``_deliver`` once)
        seen.watch(client._io.bulk, "client")
        seen.watch(server._bulk, "engine")
    first, second = (client, server) if topology == "dialin" else (server, client)
    async with first, second:
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
        yield client, server


async def bulk_bound(client: Client[Any], server: Server) -> None:
    """Wait (bounded) until the session's bulk connection is bound on both sides."""

    def bound(links: BulkLinks) -> bool:
        return bool(links.binder._pipes) or any(d.bound for d in links._dialed.values())

    await until(lambda: bound(client._io.bulk) and bound(server._bulk))


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_large_calls_and_results_go_on_the_bulk_connection(
    tmp_path: Path, topology: str
) -> None:
    seen = Seen()
    async with pair(tmp_path, topology, seen) as (client, server):
        await bulk_bound(client, server)
        stub = client.with_options(transport="frames").stub()
        t = torch.arange(LARGE // 4, dtype=torch.int32)
        back = await stub.echo(t)
        assert torch.equal(back, t)
        # Small messages stay on the control connection.
        assert await stub.add(1, 2) == 3
        small = torch.ones(SMALL, dtype=torch.uint8)
        assert torch.equal(await stub.echo(small), small)
    # Exactly the large CALL (engine side) and the large RESULT (client side); besides,
    # an engine that leaves first may say BYE there too (rule 4: a small message).
    assert [s >= LARGE for s in seen.sizes["engine"]] == [True]
    assert [s >= LARGE for s in seen.sizes["client"]][:1] == [True]
    assert all(s < SMALL for s in seen.sizes["client"][1:])


_ATTACKER = """
import sys, zmq
endpoint, epoch, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(endpoint)
s.send_multipart(FRAMES)
print("answered" if s.poll(int(sys.argv[4])) else "silent", flush=True)
s.close()
ctx.term()
"""


async def attach_from_another_process(endpoint: str, epoch: int, token: str, wait_ms: int) -> str:
    frames = encode_control(MessageKind.ATTACH, Attach(epoch, token))
    code = _ATTACKER.replace("FRAMES", repr(frames))
    with anyio.fail_after(WAIT):
        done = await anyio.run_process(
            [sys.executable, "-c", code, endpoint, str(epoch), token, str(wait_ms)],
            check=False,
            stderr=subprocess.STDOUT,
        )
    return done.stdout.decode().strip()


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_another_process_with_the_token_cannot_attach(
    tmp_path: Path, topology: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The dialer's own bulk connection is held back; a third process that learnt the
    # session's endpoint, epoch and token (a relay) tries to attach in its place.
    held: list[tuple[Any, ...]] = []
    monkeypatch.setattr(BulkLinks, "dial", lambda self, *args: held.append(args))
    seen = Seen()
    async with pair(tmp_path, topology, seen) as (client, server):
        listener = client._io.bulk if topology == "dialin" else server._bulk
        await until(lambda: held)
        [(_peer, announced, _control, epoch, token)] = held
        assert announced == listener.address
        got = await attach_from_another_process(announced, epoch, token, wait_ms=1000)
        assert got == "silent"  # no answer: not bound
        assert listener.refused == 1
        assert not listener.binder._pipes
        # The session goes on, control only, large calls included.
        stub = client.with_options(transport="frames").stub()
        t = torch.ones(LARGE, dtype=torch.uint8)
        assert torch.equal(await stub.echo(t), t)
    assert seen.sizes == {"client": [], "engine": []}  # nothing came on a bulk connection


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_the_session_process_with_the_token_attaches(
    tmp_path: Path, topology: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same ATTACH from the process of the session's control connection binds: what
    # refused the other process is the kernel's word, not the message.
    held: list[tuple[Any, ...]] = []
    monkeypatch.setattr(BulkLinks, "dial", lambda self, *args: held.append(args))
    async with pair(tmp_path, topology) as (client, server):
        listener = client._io.bulk if topology == "dialin" else server._bulk
        await until(lambda: held)
        [(_peer, announced, _control, epoch, token)] = held
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(announced)
            sock.send_multipart(encode_control(MessageKind.ATTACH, Attach(epoch, token)))
            await until(lambda: sock.poll(0))
            header, _ = sock.recv_multipart()
            assert header[3] == MessageKind.ATTACH
            assert listener.refused == 0
            assert len(listener.binder._pipes) == 1
        finally:
            sock.close()


def open_fds() -> set[str]:
    """The process's descriptors with what each is open on, less the one the listing
    itself used (gone by the time it is read; its number would hide another's)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        with suppress(FileNotFoundError):
            fds.add(f"{fd} {os.readlink(f'/proc/self/fd/{fd}')}")
    return fds


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_nothing_is_left_open_after_close(tmp_path: Path, topology: str) -> None:
    async def echo_large(client: Any) -> None:
        stub = client.with_options(transport="frames").stub()
        assert (await stub.echo(torch.ones(LARGE, dtype=torch.uint8))).numel() == LARGE

    # Warm up with the same work: zmq's context and the process's lazily made helpers (the
    # release thread, the loop's thread pool) keep their descriptors for the process.
    async with pair(tmp_path, topology) as (c, s):
        await bulk_bound(c, s)
        await echo_large(c)
    before = open_fds()
    async with pair(tmp_path, topology) as (client, server):
        await bulk_bound(client, server)
        await echo_large(client)
        bulk = client._io.bulk if topology == "dialin" else server._bulk
        assert bulk.router is not None
    for links in (client._io.bulk, server._bulk):
        assert links.router is None
        assert not links._dialed
    try:
        await until(lambda: not open_fds() - before)
    except TimeoutError:
        raise AssertionError(f"left open: {sorted(open_fds() - before)}") from None
    assert not list(tmp_path.glob("*.bulk"))  # noqa: ASYNC240 - a tiny directory


async def test_a_killed_engine_leaves_no_bulk_connection(tmp_path: Path) -> None:
    # The client dialed the engine's bulk endpoint; the engine is killed: the client's
    # bulk connection to it goes with the session.
    address = f"ipc://{tmp_path}/e.sock"
    with EngineProcess("e1", workdir=tmp_path, bind=address, service="tensor") as engine:
        async with Client(
            TensorService, connect=engine.address(), heartbeat_interval=0.1
        ) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
            await until(lambda: any(d.bound for d in client._io.bulk._dialed.values()))
            engine.kill()
            await until(lambda: not client.engines and not client._io.bulk._dialed)


async def test_the_bulk_sockets_take_the_control_sockets_options(tmp_path: Path) -> None:
    """A bulk socket with smaller buffers, queues or another copy threshold than its
    control socket would make large calls slower than before the bulk connection."""
    from tensorrpc._zmq import SocketOptions

    options = SocketOptions(sndhwm=321, rcvhwm=123, linger_ms=7, copy_threshold=4096)
    names = (zmq.SNDHWM, zmq.RCVHWM, zmq.MAXMSGSIZE, zmq.LINGER, zmq.SNDBUF, zmq.RCVBUF)

    def same(bulk: Any, control: Any) -> None:
        for name in names:
            assert bulk.socket.getsockopt(name) == control.socket.getsockopt(name), name
        assert bulk.socket.copy_threshold == control.socket.copy_threshold == 4096

    address = f"ipc://{tmp_path}/bulk-options.sock"
    async with (
        Server(Bulky(), bind=address, engine_id="e1", socket_options=options) as server,
        Client(Bulky, connect=address, socket_options=options) as client,
    ):
        await client.wait_for_engines(1, timeout=WAIT)
        assert server._bulk.router is not None
        assert server._router is not None
        same(server._bulk.router, server._router)
        await until(lambda: any(d.bound for d in client._io.bulk._dialed.values()))
        assert client._io.sock is not None
        for dialed in client._io.bulk._dialed.values():
            same(dialed.sock, client._io.sock)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("what", ["file", "symlink", "directory"])
async def test_a_path_taken_at_dot_bulk_is_left_alone(
    tmp_path: Path, topology: str, what: str
) -> None:
    # ZMQ removes whatever is at an ipc:// path before it binds there: the derived
    # PATH.bulk must not cost anyone a file, nor follow a symlink; the bulk path is
    # off instead and the session works over control.
    taken = tmp_path / "b.sock.bulk"
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    if what == "file":
        taken.write_bytes(b"keep me too")
    elif what == "symlink":
        taken.symlink_to(target)
    else:
        taken.mkdir()
    async with pair(tmp_path, topology) as (client, server):
        stub = client.with_options(transport="frames").stub()
        assert (await stub.echo(torch.ones(LARGE, dtype=torch.uint8))).numel() == LARGE
        assert await stub.add(a=1, b=2) == 3
        bulk = client._io.bulk if topology == "dialin" else server._bulk
        assert bulk.router is None
        assert not bulk.address
    assert taken.is_symlink() if what == "symlink" else taken.exists()
    if what == "file":
        assert taken.read_bytes() == b"keep me too"
    assert target.read_bytes() == b"keep me"


def holds_bulk(links: BulkLinks) -> bool:
    """Whether ``links`` still holds a session's bulk connection or an offer for one."""
    binder = links.binder
    return bool(links._dialed or binder._pipes or binder._bound or binder._offers)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("leaves", ["client", "engine"])
async def test_a_session_that_ends_takes_its_bulk_connection(
    tmp_path: Path, topology: str, leaves: str
) -> None:
    # One side closes (the engine drains, or the client says BYE) while the other lives
    # on: the one left holds neither the session's bulk connection nor its offer.
    address = f"ipc://{tmp_path}/b.sock"
    if topology == "dialin":
        client = Client(Bulky, bind=address, heartbeat_interval=0.1)
        server = Server(Bulky(), engine_id="e1", connect=address, heartbeat_interval=0.1)
    else:
        server = Server(Bulky(), engine_id="e1", bind=address, heartbeat_interval=0.1)
        client = Client(Bulky, connect=address, heartbeat_interval=0.1)
    stays, goes = (server, client) if leaves == "client" else (client, server)
    links = server._bulk if leaves == "client" else client._io.bulk
    async with stays:
        async with goes:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
            await bulk_bound(client, server)
            stub = client.with_options(transport="frames").stub()
            assert (await stub.echo(torch.ones(LARGE, dtype=torch.uint8))).numel() == LARGE
            assert holds_bulk(links)
        await until(lambda: not holds_bulk(links))


@service(name="Holding")
class Holding:
    def __init__(self) -> None:
        self.started = anyio.Event()
        self.release = anyio.Event()

    @rpc
    async def hold(self, t: torch.Tensor) -> torch.Tensor:
        """Send the tensor back once released."""
        self.started.set()
        await self.release.wait()
        return t


async def _fails_when_the_bulk_connection_breaks(
    client: Client[Any], holding: Holding, break_it: Callable[[], None]
) -> BaseException:
    """Start a large call (its CALL on the bulk connection), break that connection with
    ``break_it`` while the handler holds the call, and return the call's error."""
    stub = client.with_options(transport="frames").stub()
    t = torch.ones(LARGE, dtype=torch.uint8)
    failed: list[BaseException] = []

    async def call() -> None:
        try:
            await stub.hold(t)
        except EngineDeadError as exc:
            failed.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            with anyio.fail_after(WAIT):  # generous: not a timing assertion
                await holding.started.wait()  # its CALL came on the bulk connection
                break_it()  # the bulk connection breaks; control lives on
                await until(lambda: failed)
    finally:
        holding.release.set()
    return failed[0]


async def test_a_broken_bulk_connection_fails_its_calls_at_once() -> None:
    """Rule 5 over tcp+CURVE: the bulk connection breaks while control lives (here the
    engine's bulk socket closes); the large call whose CALL it carried ends with
    EngineDeadError at once instead of waiting for a reply that cannot come."""
    holding = Holding()
    async with curve_session("listen", holding) as (client, server):
        router = server._bulk.router
        assert router is not None
        error = await _fails_when_the_bulk_connection_breaks(client, holding, router.close)
        assert "lost its bulk connection" in str(error)
        # The session starts anew over control (without a bulk connection now).
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
            assert await client.stub().hold(torch.ones(4)) is not None


@asynccontextmanager
async def curve_session(
    topology: str, service: object, **server_kw: Any
) -> AsyncIterator[tuple[Client[Any], Server]]:
    """A tcp+CURVE session whose bulk connection is bound on both sides."""
    keys = {name: generate_keypair() for name in ("engine", "client")}
    engine_curve = CurveClientConfig(keys["engine"], keys["client"].public_key)
    client_curve = CurveClientConfig(keys["client"], keys["engine"].public_key)
    common: dict[str, Any] = {"heartbeat_interval": 0.1}
    if topology == "listen":
        server = Server(
            service,
            engine_id="e1",
            bind="tcp://127.0.0.1:0",
            curve=CurveServerConfig(keys["engine"], allowed_clients=[keys["client"].public_key]),
            **common,
            **server_kw,
        )
        async with server:
            assert server.endpoint is not None
            async with Client(
                type(service), connect=server.endpoint, curve=client_curve, **common
            ) as client:
                with anyio.fail_after(WAIT):
                    await client.wait_for_engines(1)
                await bulk_bound(client, server)
                yield client, server
        return
    async with Client(
        type(service),
        bind="tcp://127.0.0.1:0",
        curve=CurveServerConfig(keys["client"], allowed_clients=[keys["engine"].public_key]),
        **common,
    ) as client:
        (address,) = client.addresses
        server = Server(
            service, engine_id="e1", connect=address, curve=engine_curve, **common, **server_kw
        )
        async with server:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
            await bulk_bound(client, server)
            yield client, server


async def test_a_broken_bulk_connection_to_the_client_fails_its_calls_at_once() -> None:
    """Rule 5 in the dial-in layout over tcp+CURVE: the engine dialed the client's bulk
    endpoint and that connection breaks while control lives (here the engine's bulk
    socket closes). The client's bulk ROUTER cannot tell one peer's routing id gone, but
    its monitor reports the connection's end: the call whose RESULT would have come on
    it fails with EngineDeadError at once, and a new session starts."""
    holding = Holding()
    async with curve_session("dialin", holding) as (client, server):
        [dialed] = server._bulk._dialed.values()
        error = await _fails_when_the_bulk_connection_breaks(client, holding, dialed.sock.close)
        assert "lost its bulk connection" in str(error)
        # A new session over the living control connection, with a new bulk connection.
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
        await bulk_bound(client, server)
        t = torch.ones(LARGE, dtype=torch.uint8)
        assert torch.equal(await client.with_options(transport="frames").stub().hold(t), t)


@pytest.mark.parametrize("topology", TOPOLOGIES)
async def test_a_draining_engines_large_result_arrives(topology: str) -> None:
    """Rule 4 over tcp+CURVE: the engine drains while a large call runs; its RESULT goes
    on the bulk connection and its BYE right behind on both connections. The control BYE
    (a few bytes) overtakes the RESULT (32 MiB, encrypted); the client ends the session
    only once the bulk BYE came too, so the RESULT arrives."""
    draining = Holding()
    async with curve_session(topology, draining, grace_period=WAIT) as (client, server):
        stub = client.with_options(transport="frames").stub()
        t = torch.arange((32 << 20) // 4, dtype=torch.int32)
        got: list[torch.Tensor] = []

        async def call() -> None:
            got.append(await stub.hold(t))

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await draining.started.wait()
                tg.start_soon(server.aclose)  # drains: the running call may finish
                await until(lambda: server._proto.draining)
                draining.release.set()
        assert torch.equal(got[0], t)
        await until(lambda: not client.engines)  # both BYEs came: the session is over


async def test_a_bulk_pipe_that_sends_anything_but_attach_is_cut_off(tmp_path: Path) -> None:
    """A pipe's first message on the listening bulk socket must be a (small) ATTACH; one
    that sends a large message instead is refused and its connection closed, so it does
    not get to send more (each up to ``maxmsgsize``) at the cost of the listener."""
    async with pair(tmp_path, "listen") as (client, server):
        await bulk_bound(client, server)
        listener = server._bulk
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 60_000)  # no reconnection within the test
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(listener.address)
            big = bytes(2 << 20)
            for _ in range(3):
                sock.send_multipart([big])
            await until(lambda: monitor.poll(0))  # the listener closed the connection
            assert listener.shut >= 1
            assert listener.refused >= 1
            # The session's own bulk connection goes on.
            stub = client.with_options(transport="frames").stub()
            t = torch.ones(LARGE, dtype=torch.uint8)
            assert torch.equal(await stub.echo(t), t)
            assert len(listener.binder.bound()) == 1
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()
