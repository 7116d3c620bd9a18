"""Size limits: MAXMSGSIZE (per frame, enforced by ZMQ) and the codec's per-tensor maximum.

What is ours to send and too big for our limit or the peer's (each side announces its
limit in the handshake) is refused on the sending side with a clear error before anything
leaves; what arrives too big is dropped by ZMQ, which disconnects that peer, and neither
side crashes: the engine keeps serving the others.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
import zmq

from tensorrpc._client import Client
from tensorrpc._codec import CodecConfig
from tensorrpc._exceptions import (
    EncodeError,
    EngineDeadError,
    RemoteError,
)
from tensorrpc._protocol import MessageKind, pack_call_header, pack_reply_header
from tensorrpc._server import Server
from tensorrpc._zmq import SocketOptions, create_socket
from tests.integration.fake_engine import FakeEngine
from tests.integration.server_services import Probe
from tests.integration.services import Calculator

from ._live import live_engine

WAIT = 20.0
LIMIT = 1 << 20  # 1 MiB
SMALL = SocketOptions(maxmsgsize=LIMIT)


def _big(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32)


async def test_too_big_argument_is_an_encode_error_before_sending(tmp_path: Path) -> None:
    async with Server(Probe(), bind=f"ipc://{tmp_path}/e.sock", socket_options=SMALL) as server:
        assert server.endpoint is not None
        async with Client(Probe, connect=server.endpoint, socket_options=SMALL) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
            probe = client.with_options(
                transport="frames"
            ).stub()  # torch_shm would not use a frame
            with pytest.raises(EncodeError, match="maxmsgsize"):
                await probe.scale(_big(2 * LIMIT), 2.0)
            assert client.statistics().calls_in_flight == 0
            assert server.statistics().calls == 0  # nothing was sent
            x = _big(LIMIT // 2)
            with anyio.fail_after(WAIT):
                assert torch.equal(await probe.scale(x, 2.0), x * 2)


async def test_per_tensor_limit_is_an_encode_error_on_either_side(tmp_path: Path) -> None:
    codec = CodecConfig(max_tensor_bytes=16 * 1024)
    async with Server(Probe(), bind=f"ipc://{tmp_path}/e.sock", codec=codec) as server:
        assert server.endpoint is not None
        async with Client(Probe, connect=server.endpoint, codec=codec) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
            with pytest.raises(EncodeError, match="max_tensor_bytes"):
                await client.with_options(transport="frames").stub().scale(_big(32 * 1024), 1.0)
            # results over the engine's limit (two 24 KiB tensors): it refuses to send them
            loose = CodecConfig(max_tensor_bytes=1 << 30)
            async with Client(Probe, connect=server.endpoint, codec=loose) as other:
                with anyio.fail_after(WAIT):
                    await other.wait_for_engines(1)
                    with pytest.raises(RemoteError, match="max_tensor_bytes"):
                        await other.with_options(transport="frames").stub().tensors(1, 2)
            with anyio.fail_after(WAIT):
                assert await client.stub().add(1, 2) == 3


async def test_too_big_result_is_refused_by_the_engine(tmp_path: Path) -> None:
    async with live_engine(tmp_path, socket_options=SocketOptions(maxmsgsize=16 * 1024)) as (
        server,
        peer,
        _,
    ):
        call_id = peer.call("tensors", 1, 2)  # two 24 KiB tensors: each over 16 KiB
        msg = await peer.expect(MessageKind.ERROR, call_id)
        assert "maxmsgsize" in msg.error().message
        assert await peer.result(peer.call("add", 1, 1)) == 2
        assert server.statistics().errors == 1


async def test_engine_drops_an_oversize_peer_and_serves_the_others(tmp_path: Path) -> None:
    """A raw peer sends one frame over the engine's MAXMSGSIZE: ZMQ disconnects it."""
    async with live_engine(tmp_path, listen=True, socket_options=SMALL) as (server, peer, _):
        assert server.endpoint is not None
        async with create_socket(zmq.DEALER) as rogue:
            rogue.connect(server.endpoint)
            rogue.send_nowait([pack_call_header(1, "scale"), b"\x92\x00\x00", bytes(2 * LIMIT)])
            # the engine still answers its real client, several times over
            for i in range(20):
                assert await peer.result(peer.call("add", i, 1)) == i + 1
        assert server.statistics().calls == 20


async def test_a_call_over_the_engine_s_smaller_limit_fails_at_once(tmp_path: Path) -> None:
    """The client's limit is larger than the engine's. The engine announced its limit in
    HELLO, so the client refuses the call before sending it: no deadline is needed, and
    the engine never sees it (its ZMQ would drop the call and the connection)."""
    async with Server(
        Probe(), bind="tcp://127.0.0.1:0", engine_id="small", socket_options=SMALL
    ) as server:
        assert server.endpoint is not None
        async with Client(Probe, connect=server.endpoint) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
            assert client.engines["small"].max_message_bytes == LIMIT
            probe = client.with_options(
                transport="frames"
            ).stub()  # no timeout: it must not need one
            with anyio.fail_after(WAIT):
                with pytest.raises(EncodeError, match=rf"'small'.*maxmsgsize={LIMIT}\)"):
                    await probe.scale(_big(2 * LIMIT), 1.0)
                x = _big(LIMIT // 2)
                assert torch.equal(await probe.scale(x, 2.0), x * 2)
            assert client.statistics().calls_in_flight == 0
            assert server.statistics().calls == 1  # only the call that fits was sent
        # arguments encoded before an engine is chosen (by name) are checked the same way
        async with Client.dynamic(connect=server.endpoint) as dynamic:
            with anyio.fail_after(WAIT):
                await dynamic.wait_for_engines(1)
                with pytest.raises(EncodeError, match=rf"maxmsgsize={LIMIT}\)"):
                    await dynamic.call_by_name("scale", {"x": _big(2 * LIMIT), "factor": 1.0})
                assert await dynamic.call_by_name("add", {"a": 2, "b": 2}) == 4
        assert server.statistics().calls == 2


async def test_a_result_over_the_client_s_smaller_limit_is_refused_by_the_engine(
    tmp_path: Path,
) -> None:
    """The engine's limit is larger than the client's: the client announced its limit in
    WELCOME, so the engine answers BAD_RESULT naming it instead of sending the result."""
    small = SocketOptions(maxmsgsize=16 * 1024)
    async with Server(Probe(), bind=f"ipc://{tmp_path}/e.sock") as server:
        assert server.endpoint is not None
        async with Client(Probe, connect=server.endpoint, socket_options=small) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
                # two 24 KiB tensors: each over the client's 16 KiB
                with pytest.raises(RemoteError, match=r"client .*maxmsgsize=16384\)"):
                    await client.with_options(transport="frames").stub().tensors(1, 2)
                assert await client.stub().add(2, 2) == 4
            assert client.statistics().calls_in_flight == 0
        assert server.statistics().errors == 1


async def test_client_drops_an_oversize_engine_and_its_calls_fail(tmp_path: Path) -> None:
    """A hostile engine replies with a frame over the client's MAXMSGSIZE: ZMQ drops the
    connection, the engine is declared dead and its call fails with EngineDeadError."""
    client = Client(
        Calculator,
        bind=f"ipc://{tmp_path}/c.sock",
        socket_options=SMALL,
        heartbeat_interval=0.05,
        dead_after=0.6,
    )
    async with client, FakeEngine(client.addresses[0], "huge") as engine:
        await engine.join()
        with anyio.fail_after(WAIT):
            await client.wait_for_engines(1)
        outcome: list[BaseException] = []

        async def caller() -> None:
            try:
                await client.stub().add(1, 2)
            except EngineDeadError as exc:
                outcome.append(exc)

        engine.answer_pings = False
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(caller)
                call = await engine.next(MessageKind.CALL)
                await engine.send(
                    [pack_reply_header(MessageKind.RESULT, call.call_id), bytes(2 * LIMIT)]
                )
        assert len(outcome) == 1
        assert client.statistics().calls_in_flight == 0
        assert "huge" not in client.engines
