"""An oversize tensor over frames is refused before it is transferred, not after.

An engine whose codec takes tensors of at most 1 MiB used to announce (and enforce in
ZMQ) only its ``maxmsgsize`` of 4 GiB: a client sent a 1 GiB tensor in full, the engine
buffered all of it and only then refused it (``DECODE``). Now an engine lowers its
``maxmsgsize`` to the largest frame its codec accepts, ZMQ drops a bigger frame at its
header, and HELLO announces the limit, so that the client refuses the call before sending.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
import zmq

from tensorrpc import _codec
from tensorrpc._client import Client
from tensorrpc._codec import CodecConfig
from tensorrpc._exceptions import EncodeError
from tensorrpc._protocol import pack_call_header
from tensorrpc._server import Server
from tensorrpc._zmq import DEFAULT_OPTIONS, SocketOptions, create_socket
from tests.integration.server_services import Probe

from ._live import live_engine

WAIT = 20.0
MiB = 1 << 20
TIGHT = CodecConfig(max_tensor_bytes=MiB, max_payload_bytes=MiB)


def test_socket_options_are_capped_at_the_codec_s_largest_frame() -> None:
    assert _codec.frame_limit(TIGHT) == MiB
    assert _codec.frame_limit(_codec.DEFAULT) == 1 << 34  # 16 GiB tensors
    assert DEFAULT_OPTIONS.capped(MiB).maxmsgsize == MiB
    assert DEFAULT_OPTIONS.capped(1 << 34) is DEFAULT_OPTIONS  # 4 GiB is already smaller
    assert SocketOptions(maxmsgsize=-1).capped(MiB).maxmsgsize == MiB
    assert SocketOptions(maxmsgsize=1024).capped(MiB).maxmsgsize == 1024


async def test_engine_announces_and_enforces_its_codec_limit(tmp_path: Path) -> None:
    async with Server(Probe(), bind=f"ipc://{tmp_path}/e.sock", codec=TIGHT) as server:
        assert server.endpoint is not None
        async with Client(Probe, connect=server.endpoint) as client:  # default (16 GiB) codec
            with anyio.fail_after(WAIT):
                engines = await client.wait_for_engines(1)
            assert [e.max_message_bytes for e in engines.values()] == [MiB]
            big = torch.ones(2 * MiB // 4)
            with pytest.raises(EncodeError, match="maxmsgsize=1048576"):
                await client.with_options(transport="frames").stub().scale(big, 2.0)
            assert server.statistics().calls == 0  # refused before anything was sent
            small = torch.ones(1024)
            with anyio.fail_after(WAIT):
                assert torch.equal(await client.stub().scale(small, 2.0), small * 2)


async def test_a_raw_peer_s_oversize_frame_is_dropped_by_zmq(tmp_path: Path) -> None:
    # A peer that ignores the announced limit is disconnected by ZMQ at the frame's header
    # (nothing buffered, no reply); the engine goes on serving its real client.
    async with live_engine(tmp_path, listen=True, codec=TIGHT) as (server, peer, _):
        assert server.endpoint is not None
        assert peer.hello is not None
        assert peer.hello.max_message_bytes == MiB
        async with create_socket(zmq.DEALER) as rogue:
            rogue.connect(server.endpoint)
            rogue.send_nowait([pack_call_header(1, "scale"), b"\x92\x00\x00", bytes(2 * MiB)])
            for i in range(5):
                assert await peer.result(peer.call("add", i, 1)) == i + 1
        assert server.statistics().calls == 5
