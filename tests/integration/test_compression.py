"""Compression end to end: negotiated in the handshake, over tcp and ipc, bombs refused."""

from __future__ import annotations

from pathlib import Path

import anyio
import ormsgpack
import pytest
import torch

from tensorrpc import _codec
from tensorrpc._client import Client
from tensorrpc._codec import ExtCode, Location
from tensorrpc._compression import Compression
from tensorrpc._exceptions import DecodeError
from tensorrpc._server import Server
from tensorrpc._service import describe
from tests.engine_proc import EngineProcess

from .services import Calculator

zstandard = pytest.importorskip("zstandard")

TCP = "tcp://127.0.0.1:0"


def activations() -> torch.Tensor:
    return torch.relu(torch.randn(128, 1024, generator=torch.Generator().manual_seed(3)))


async def test_compressed_calls_over_tcp_send_fewer_bytes_both_ways() -> None:
    x = activations()
    async with (
        Server(Calculator("e1"), bind=TCP, engine_id="e1") as server,
        Client(Calculator, connect=server.endpoint) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            assert client.engines["e1"].compression == ("zstd",)
            before = client.statistics().engines["e1"]
            plain = await client.stub().scale(x, 2.0)
            middle = client.statistics().engines["e1"]
            packed = await client.with_options(compression="zstd").stub().scale(x, 2.0)
            after = client.statistics().engines["e1"]
    assert torch.equal(plain, x * 2)
    assert torch.equal(packed, x * 2)
    sent_plain = middle.bytes_sent - before.bytes_sent
    sent_packed = after.bytes_sent - middle.bytes_sent
    got_plain = middle.bytes_received - before.bytes_received
    got_packed = after.bytes_received - middle.bytes_received
    assert sent_plain > x.nbytes
    assert sent_packed < x.nbytes * 0.9
    assert got_plain > x.nbytes
    assert got_packed < x.nbytes * 0.9


async def test_an_engine_that_does_not_compress_results_still_decodes_arguments() -> None:
    x = activations()
    async with (
        Server(Calculator("e1"), bind=TCP, engine_id="e1", compression=None) as server,
        Client(Calculator, connect=server.endpoint) as client,
    ):
        with anyio.fail_after(20):
            await client.wait_for_engines(1)
            view = client.with_options(compression=Compression(level=3, min_bytes=1024))
            before = client.statistics().engines["e1"]
            assert torch.equal(await view.call(Calculator.scale, x, 3.0), x * 3)
            after = client.statistics().engines["e1"]
    assert after.bytes_sent - before.bytes_sent < x.nbytes * 0.9
    assert after.bytes_received - before.bytes_received > x.nbytes


async def test_nothing_is_compressed_with_an_engine_that_shares_memory(tmp_path: Path) -> None:
    x = activations()
    address = f"ipc://{tmp_path}/c.sock"
    async with Client(Calculator, bind=address) as client:
        # Another process (forked from the suite's zygote): same host, so torch_shm.
        with EngineProcess("engine-0", workdir=tmp_path, connect=(address,)):
            with anyio.fail_after(60):
                await client.wait_for_engines(1)
                assert client.engines["engine-0"].compression == ("zstd",)
                packed = client.with_options(compression="zstd").stub()
                out = await packed.scale(x, 2.0)  # by torch_shm both ways
                small = torch.zeros(4096)  # under the torch_shm threshold: a frame
                before = client.statistics()
                assert torch.equal(await packed.scale(small, 1.0), small)
                after = client.statistics()
    assert torch.equal(out, x * 2)
    shm = before.transports.torch_shm
    assert (shm.tensors_sent, shm.bytes_sent, shm.tensors_received) == (1, x.nbytes, 1)
    sent = after.engines["engine-0"].bytes_sent - before.engines["engine-0"].bytes_sent
    assert sent > small.nbytes  # zeros, and still not compressed: same host


async def test_a_decompression_bomb_is_refused_and_the_engine_keeps_serving() -> None:
    spec = describe(Calculator).methods["scale"]
    # A tensor of 4 KiB whose frame claims 4 KiB but expands to 64 MiB, and one whose
    # frame says it expands to 64 MiB: both refused before anything that large exists.
    big = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
    fhd = big[4]
    at = 5 if (fhd >> 5) & 1 else 6
    liar = big[:at] + (4096).to_bytes(4, "little") + big[at + 4 :]
    async with Server(Calculator("e1"), bind=TCP, engine_id="e1") as server:
        async with Client(Calculator, connect=server.endpoint) as client:
            with anyio.fail_after(20):
                await client.wait_for_engines(1)
                for frame in (liar, big):
                    desc = ormsgpack.packb(["uint8", [4096], int(Location.ZSTD_FRAME), 0])
                    payload = ormsgpack.packb([ormsgpack.Ext(int(ExtCode.TORCH), desc), 1.0])
                    bomb = _codec.Encoded(payload, [memoryview(frame)])
                    with pytest.raises(DecodeError, match="compressed frame"):
                        await client._call(spec, (), {}, client.options, bomb)
                x = activations()
                assert torch.equal(
                    await client.with_options(compression="zstd").stub().scale(x, 1.0), x
                )
                assert await client.stub().add(1, 2) == 3
        assert server.statistics().errors == 2


async def test_an_engine_compresses_results_only_for_a_client_that_decodes_zstd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = activations()
    async with Server(Calculator("e1"), bind=TCP, engine_id="e1") as server:
        with monkeypatch.context() as patch:  # this client says it decodes nothing
            patch.setattr("tensorrpc._compression.available", lambda: ())
            client = Client(Calculator, connect=server.endpoint)
        async with client:
            with anyio.fail_after(20):
                await client.wait_for_engines(1)
                before = client.statistics().engines["e1"]
                # It still compresses its arguments (the engine decodes zstd) and sets
                # COMPRESS: the engine goes by what the WELCOME said.
                assert torch.equal(
                    await client.with_options(compression="zstd").stub().scale(x, 1.0), x
                )
                after = client.statistics().engines["e1"]
    assert after.bytes_sent - before.bytes_sent < x.nbytes * 0.9
    assert after.bytes_received - before.bytes_received > x.nbytes
