"""One conformance suite, run over every tensor transport (frames, torch_shm, auto).

A real :class:`~tensorrpc.Client` in the test process calls a real engine program in a
subprocess (``tests/engine_proc.py --service tensor``). Every case runs for each transport, and the
client's per-transport statistics show the transport really carried the tensors.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch

from tensorrpc._client import Client
from tensorrpc.transports import TransportStatistics
from tests.engine_proc import EngineProcess
from tests.transports._engine import Batch, TensorService, digest, pattern

pytestmark = pytest.mark.anyio

TRANSPORTS = ["frames", "torch_shm", "auto"]
BIG = 1 << 17  # bytes; above the auto threshold (64 KiB)


@pytest.fixture(scope="module")
def engine_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir: Path = tmp_path_factory.mktemp("conformance")
    with EngineProcess(
        "tensor-engine", workdir=workdir, bind=f"ipc://{workdir}/engine.sock", service="tensor"
    ) as engine:
        yield engine.address()


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.asynccontextmanager
async def connected(address: str) -> AsyncIterator[Client[TensorService]]:
    async with Client(TensorService, connect=address, heartbeat_interval=0.2) as client:
        await client.wait_for_engines(1, timeout=60)
        yield client


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and digest(a) == digest(b)


def check_carried(
    stats: TransportStatistics, transport: str, *, big: bool, sent: bool = True
) -> None:
    """The transport the call asked for is the one that moved the out-of-band tensors."""
    shm, frames = stats.torch_shm, stats.frames
    assert shm.fallbacks == 0
    if transport == "frames":
        assert shm.tensors_sent == shm.tensors_received == 0
    elif transport == "torch_shm":
        assert frames.tensors_sent == frames.tensors_received == 0
    elif big:
        assert shm.tensors_sent > 0 or not sent
        assert shm.tensors_received > 0


DTYPES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
]


@pytest.mark.parametrize("dtype", DTYPES)
async def test_dtypes_round_trip(anyio_backend: str, engine_address: str, transport: str, dtype):
    async with connected(engine_address) as client:
        stub = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        for shape in ([3], [BIG]):
            x = pattern(dtype, shape, seed=len(shape))
            assert same(await stub.echo(x), x)
            assert await stub.digest(x) == digest(x)
        check_carried(client.statistics().transports, transport, big=True)


@pytest.mark.parametrize(
    "shape", [[], [0], [3, 0, 2], [1], [7, 1, 3], [300, 257], [2, 3, 4, 5, 6, 7]], ids=str
)
async def test_shapes_round_trip(anyio_backend: str, engine_address: str, transport: str, shape):
    async with connected(engine_address) as client:
        stub = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        x = pattern("float32", shape, seed=7)
        y = await stub.echo(x)
        assert same(y, x)
        assert y.is_contiguous()
        made = await stub.make("int16", shape, 3)
        assert same(made, pattern("int16", shape, 3))


async def test_non_contiguous_tensors(anyio_backend: str, engine_address: str, transport: str):
    base = pattern("float32", [512, 300], seed=1)
    views = [
        base.t(),  # transposed
        base[:, ::2],  # strided
        base[100:400, 7:250],  # offset
        pattern("float32", [1, 300], seed=2).expand(400, 300),  # stride 0
        base[::3, ::5].t(),
    ]
    async with connected(engine_address) as client:
        stub = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        for view in views:
            assert not view.is_contiguous()
            got = await stub.echo(view)
            assert same(got, view)
            assert got.is_contiguous()
        check_carried(client.statistics().transports, transport, big=True)


async def test_many_tensors_per_call(anyio_backend: str, engine_address: str, transport: str):
    xs = [pattern("float32", [n * 997 % 40_000 + 1], seed=n) for n in range(120)]
    async with connected(engine_address) as client:
        stub = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        got = await stub.echo_many(xs)
        assert len(got) == len(xs)
        assert all(same(a, b) for a, b in zip(got, xs, strict=True))
        check_carried(client.statistics().transports, transport, big=True)


async def test_tensors_nested_in_dataclasses(
    anyio_backend: str, engine_address: str, transport: str
):
    batch = Batch(
        name="b",
        first=pattern("bfloat16", [256, 300], seed=4),
        rest=[pattern("int64", [n, 100], seed=n) for n in (0, 1, 90, 200)],
    )
    async with connected(engine_address) as client:
        stub = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        got = await stub.echo_batch(batch)
        assert isinstance(got, Batch)
        assert got.name == "b"
        assert same(got.first, batch.first)
        assert all(same(a, b) for a, b in zip(got.rest, batch.rest, strict=True))


async def test_tensors_in_results_and_streams(
    anyio_backend: str, engine_address: str, transport: str
):
    async with connected(engine_address) as client:
        view = client.with_options(transport=transport)  # type: ignore[arg-type]
        made = await view.call(TensorService.make, "float32", [400, 400], 11)
        assert same(made, pattern("float32", [400, 400], 11))
        items = [t async for t in view.stream(TensorService.items, 20, 40_000)]
        assert [float(t[0]) for t in items] == [float(i) for i in range(20)]
        assert all(t.shape == (40_000,) for t in items)
        check_carried(client.statistics().transports, transport, big=True, sent=False)
        # Result tensors are built on the engine's regions and hold them while they
        # live; once they are freed the client RELEASEs them (before its next CALL).
        # The finished stream object may still sit in a reference cycle (a frame of the
        # comprehension, the backend's async-generator bookkeeping): collect it first,
        # and give the backend a bounded number of calls to finalize it.
        del made, items
        leases = -1
        with anyio.fail_after(20):
            for _ in range(20):
                gc.collect()
                await anyio.lowlevel.checkpoint()
                leases = (await view.call(TensorService.shm_state))[0]
                if leases == 0:
                    break
        assert leases == 0


async def test_received_tensors_outlive_the_sender_reference(
    anyio_backend: str, engine_address: str, transport: str
):
    async with connected(engine_address) as client:
        stub = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        kept = [await stub.make("float32", [70_000], seed) for seed in range(8)]
        x = pattern("float32", [70_000], 99)
        echoed = await stub.echo(x)
        del x
        # Later calls reuse the sender's pool regions; the received tensors are unaffected.
        for seed in range(8):
            await stub.make("float32", [70_000], 100 + seed)
        assert all(same(t, pattern("float32", [70_000], s)) for s, t in enumerate(kept))
        assert same(echoed, pattern("float32", [70_000], 99))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
async def test_cuda_tensors_go_by_cuda_ipc_or_need_allow_cuda_copy(
    anyio_backend: str, engine_address: str
):
    from tensorrpc._codec import CodecConfig
    from tensorrpc._exceptions import EncodeError

    x = pattern("float32", [1 << 16], seed=5)
    gpu = x.cuda()
    async with connected(engine_address) as client:
        # torch_shm: CUDA IPC, no copy to the host; the engine sees the same values.
        assert await client.with_options(transport="torch_shm").stub().digest(gpu) == digest(x)
        detail = client.statistics().transports.torch_shm_detail
        assert detail is not None
        assert detail.tensors_aliased >= 1
        # frames: refused unless the client allows a copy to the host.
        with pytest.raises(EncodeError, match="allow_cuda_copy"):
            await client.with_options(transport="frames").stub().digest(gpu)
    async with Client(
        TensorService,
        connect=engine_address,
        codec=CodecConfig(allow_cuda_copy=True),
    ) as copying:
        await copying.wait_for_engines(1, timeout=60)
        assert await copying.with_options(transport="frames").stub().digest(gpu) == digest(x)
