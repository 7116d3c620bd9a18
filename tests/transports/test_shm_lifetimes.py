"""torch_shm lifetimes through the runtime: nothing leaks, whatever happens to either side.

The engine is its own program (``tests/engine_proc.py --service tensor``), forked by
``tests/_forkserver.py``; the client is the test process, or another program
(``_client_proc.py``) when the client is the one killed. Leaks are looked for in both
processes' ``/proc/<pid>/fd`` and among their files in ``/dev/shm``. A process's pool
segments are memfds it keeps for reuse: they must be exactly the segments its pool reports.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import zmq

import tensorrpc
from bench._measure import shm_files_of
from tensorrpc import _client_protocol, _release
from tensorrpc._client import Client
from tensorrpc._codec import encode
from tensorrpc._exceptions import EngineDeadError
from tensorrpc._hostinfo import host_id
from tensorrpc._machine import release_frames
from tensorrpc._protocol import (
    ErrorInfo,
    Header,
    MessageKind,
    Welcome,
    decode_control,
    encode_control,
    pack_call_header,
    split_frames,
)
from tensorrpc.transports._shm_handle import Handle, pack
from tensorrpc.transports.torch_shm import HandleKind, TorchShmStatistics
from tests import _forkserver
from tests.engine_proc import ROOT, EngineProcess
from tests.transports._engine import TensorService

pytestmark = pytest.mark.anyio

POOL_FD = (
    "/memfd:tensorrpc-1",
    "/memfd:tensorrpc-2",
    "/memfd:tensorrpc-3",
    "/memfd:tensorrpc-4",
    "/memfd:tensorrpc-5",
    "/memfd:tensorrpc-6",
    "/memfd:tensorrpc-7",
    "/memfd:tensorrpc-8",
    "/memfd:tensorrpc-9",
)  # pool segments, not the probe


def fds(pid: int | str = "self") -> list[str]:
    """What each open descriptor of a process points to."""
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
    return sorted(out)


PIDFD = "anon_inode:[pidfd]"


def non_pool(targets: list[str]) -> list[str]:
    """Descriptors but pool segments and pidfds (one per attested session, counted apart)."""
    return [t for t in targets if not t.startswith(POOL_FD) and t != PIDFD]


def pool_fds(targets: list[str]) -> int:
    return sum(t.startswith(POOL_FD) for t in targets)


def shm_fds(targets: list[str]) -> list[str]:
    """Descriptors of shared memory (memfds and /dev/shm files)."""
    return [t for t in targets if t.startswith(("/memfd:", "/dev/shm/"))]


def dev_shm(*pids: int) -> set[str]:
    """The ``/dev/shm`` entries of this process and ``pids`` (not of tests running beside)."""
    return shm_files_of([os.getpid(), *pids])


@contextlib.asynccontextmanager
async def connected(address: str, **kw: object) -> AsyncIterator[Client[TensorService]]:
    async with Client(TensorService, connect=address, heartbeat_interval=0.2, **kw) as client:  # type: ignore[arg-type]
        await client.wait_for_engines(1, timeout=60)
        yield client


async def eventually(check, what: str, within: float = 30.0) -> None:
    """Poll a condition that lives in another process (each probe is an RPC), bounded."""
    with anyio.move_on_after(within):
        while not await check():  # noqa: ASYNC110 - the state lives in another process
            await anyio.sleep(0.05)
        return
    raise AssertionError(f"never happened within {within} s: {what}")


async def bulk_bound(client: Client[TensorService]) -> bool:
    """Whether every bulk connection the client dialed is bound (ATTACH answered)."""
    dialed = client._io.bulk._dialed.values()
    return bool(dialed) and all(d.bound for d in dialed)


def settle() -> None:
    """Let earlier releases finish before a descriptor baseline is taken."""
    gc.collect()
    assert _release.drained(10.0)


@pytest.fixture
def engine(tmp_path: Path):
    with EngineProcess(
        "tensor-engine", workdir=tmp_path, bind=f"ipc://{tmp_path}/engine.sock", service="tensor"
    ) as proc:
        yield proc


async def run_calls(client: Client[TensorService], n: int, concurrency: int) -> None:
    stub = client.with_options(transport="torch_shm").stub()
    x = torch.arange(20_000, dtype=torch.float32)  # 80 KiB, over the auto threshold too
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            y = await stub.echo(x)
            assert y[-1] == 19_999

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)


async def test_2000_calls_leave_no_descriptor_or_shm_file(
    anyio_backend: str, engine: EngineProcess
):
    """2,000 calls after warm-up: each one like the last.

    The checks are exact (not thresholds), so a descriptor, lease or segment leaked per
    call fails at once; 10,000 calls took 5 times as long for nothing more.
    """
    shm_before = dev_shm(engine.pid)
    async with connected(engine.address()) as client:
        stub = client.stub()
        await run_calls(client, 500, 32)  # warm up: pools and caches reach their size
        own, theirs = fds(), fds(engine.pid)
        with anyio.fail_after(300):
            await run_calls(client, 2_000, 32)
        state = await stub.shm_state()
        stats = client.statistics().transports
        assert stats.torch_shm.tensors_sent >= 2_500
        assert stats.torch_shm.tensors_received >= 2_500
        assert stats.frames.tensors_sent == 0
        assert stats.torch_shm_detail is not None
        assert stats.torch_shm_detail.leases_active == 0
        assert state[0] == 0, "engine still holds result leases"
        own_after, theirs_after = fds(), fds(engine.pid)
        assert non_pool(own_after) == non_pool(own)
        assert non_pool(theirs_after) == non_pool(theirs)
        assert pool_fds(own_after) == stats.torch_shm_detail.pool_segments
        assert pool_fds(theirs_after) == state[4]
    assert dev_shm(engine.pid) == shm_before


async def test_a_client_holds_one_pidfd_per_engine_and_none_after_close(
    anyio_backend: str, engine: EngineProcess
):
    """The client's shell gathers a HELLO's kernel facts (a pidfd) for the machine; the
    engine's link keeps that one pidfd, and it is closed with the client."""
    before = fds().count(PIDFD)
    async with connected(engine.address()) as client:
        assert await client.stub().shm_state() != [-1] * 7
        assert fds().count(PIDFD) == before + 1
    assert fds().count(PIDFD) == before


async def test_normal_shutdown_leaves_nothing(anyio_backend: str, tmp_path: Path):
    settle()  # what earlier tests in this process left to the release thread or to gc
    shm_before = dev_shm()
    own_before = fds()
    with EngineProcess(
        "tensor-engine", workdir=tmp_path, bind=f"ipc://{tmp_path}/e.sock", service="tensor"
    ) as engine:
        async with connected(engine.address()) as client:
            stub = client.with_options(transport="torch_shm").stub()
            shared = torch.zeros(1 << 16)
            shared.share_memory_()  # type: ignore[no-untyped-call]
            assert await stub.fill(shared, 2.0) == 2.0 * (1 << 16)
            await stub.echo(torch.ones(1 << 16))
            board = await stub.shared_board()
            assert board.shape == (1 << 16,)
            del shared
        assert engine.stop() == 0
        del board
    gc.collect()  # a reference cycle (a finished task's frame) may still hold the board
    # Mappings and the descriptors behind them are dropped on tensorrpc's release thread.
    assert _release.drained(10.0)
    assert shm_fds(fds()) == shm_fds(own_before)
    assert dev_shm(engine.pid) == shm_before


async def test_engine_killed_mid_transfer(anyio_backend: str, tmp_path: Path):
    settle()  # what earlier tests in this process left to the release thread or to gc
    shm_before = dev_shm()
    own_before = fds()
    with EngineProcess(
        "tensor-engine", workdir=tmp_path, bind=f"ipc://{tmp_path}/e.sock", service="tensor"
    ) as engine:
        async with connected(engine.address(), dead_after=2.0) as client:
            stub = client.with_options(transport="torch_shm").stub()
            failures: list[BaseException] = []

            async def one(i: int) -> None:
                try:
                    await stub.hold(torch.full((1 << 18,), float(i)), 60.0)
                except EngineDeadError as exc:
                    failures.append(exc)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(8):
                        tg.start_soon(one, i)

                    async def engine_has_them() -> bool:
                        return (await stub.shm_state())[3] >= 8

                    await eventually(engine_has_them, "engine attached to 8 arguments")
                    detail = client.statistics().transports.torch_shm_detail
                    assert detail is not None
                    assert detail.leases_active == 8  # held until the engine replies
                    engine.kill()
            assert len(failures) == 8
            detail = client.statistics().transports.torch_shm_detail
            assert detail is not None
            assert detail.leases_active == 0
            assert detail.pool_bytes_in_use == 0
    assert _release.drained(10.0)  # segments are closed on the release thread
    assert shm_fds(fds()) == shm_fds(own_before)
    assert dev_shm(engine.pid) == shm_before


async def test_an_engine_killed_is_unmapped_and_the_results_it_sent_stay_valid(
    anyio_backend: str, tmp_path: Path
):
    # The client keeps the engine's segments mapped while the engine lives (no per-call
    # mapping), drops them when the engine is gone, and the tensors it holds, by alias or
    # on the engine's pool region, keep their memory: their own mappings outlive the
    # engine's memfds.
    with EngineProcess(
        "tensor-engine", workdir=tmp_path, bind=f"ipc://{tmp_path}/e.sock", service="tensor"
    ) as engine:
        async with connected(engine.address(), dead_after=1.0) as client:
            stub = client.with_options(transport="torch_shm").stub()
            board = await stub.shared_board()  # by alias
            made = await stub.make("float32", [1 << 18], 7)  # on the engine's pool region
            expected = made.clone()
            await stub.bump_board(2.0)
            assert float(board[-1]) == 2.0  # an alias sees the engine's later write

            def detail() -> TorchShmStatistics:
                got = client.statistics().transports.torch_shm_detail
                assert got is not None
                return got

            assert detail().mapped_segments == 2  # the board's segment and the pool's
            assert detail().tensors_received_aliased == 1  # the board
            assert detail().leases_held == 1  # ``made`` holds its region until freed
            engine.kill()

            async def forgotten() -> bool:
                # (its mappings may go first, at the client's sweep: the engine's files
                # are gone; its leases go when the client declares it dead)
                return detail().mapped_segments == 0 and detail().leases_held == 0

            # unmapped, and nothing is owed to a dead engine
            await eventually(forgotten, "the client dropped the dead engine's mappings")
            assert torch.equal(made.view(torch.int32), expected.view(torch.int32))  # (NaN bits)
            assert float(board.sum()) == 2.0 * board.numel()
            board.fill_(5.0)  # still writable memory of our own mapping
            assert float(board[0]) == 5.0
            del board, made
            gc.collect()
            assert detail().leases_held == 0
            assert detail().releases_refused == 0


async def test_one_shared_tensor_in_many_calls_in_flight_goes_by_alias_in_each(
    anyio_backend: str, engine: EngineProcess
):
    # 32 calls in flight carrying the same 64 MiB shared tensor pin 64 MiB of the client,
    # not 2 GiB (twice the per-peer cap): each goes by alias. Before, the cap counted the
    # storage once per call and calls 17 to 32 were sent as 64 MiB frames.
    async with connected(engine.address()) as client:
        stub = client.with_options(transport="torch_shm").stub()
        x = tensorrpc.shared_empty(16 << 20)
        x.fill_(1.0)
        sums: list[float] = []

        def detail() -> TorchShmStatistics:
            got = client.statistics().transports.torch_shm_detail
            assert got is not None
            return got

        async def one() -> None:
            sums.append(await stub.gated_sum(x))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(32):
                    tg.start_soon(one)

                async def all_sent() -> bool:
                    return detail().tensors_sent + detail().fallbacks >= 32

                await eventually(all_sent, "32 calls sent before any answer")
                await stub.wait_gated()
                await stub.open_gate()
        assert sums == [float(16 << 20)] * 32
        assert (detail().fallbacks, detail().peer_limited) == (0, 0)
        assert detail().tensors_aliased == 32


async def test_client_killed_mid_transfer(anyio_backend: str, engine: EngineProcess):
    shm_before = dev_shm(engine.pid)
    address = engine.address()
    async with connected(address) as client:
        stub = client.stub()
        # A round trip first: `wait_for_engines` returns once we took the engine's HELLO,
        # while the engine may still be attesting our WELCOME (a dup of the connection's
        # socket, /proc reads). A baseline taken then holds a descriptor that is gone a
        # moment later, and the engine never "gets back" to it.
        await stub.shm_state()
        # And our own bulk connection (a DEALER the client dials to the engine's bulk
        # endpoint, libzmq connecting it in the background) bound first: one that the
        # engine accepts after the baseline is a descriptor it never "gives back".
        await eventually(lambda: bulk_bound(client), "our bulk connection bound")
        baseline = non_pool(fds(engine.pid))
        proc = _forkserver.popen(
            [sys.executable, "-m", "tests.transports._client_proc", address],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            # In a thread: our own client must keep answering the engine's heartbeats.
            with anyio.fail_after(60):
                line = await anyio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
            assert line.strip() == b"running"
            proc.send_signal(signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()

        last: list[object] = []

        async def released() -> bool:
            state = await stub.shm_state()
            now = non_pool(fds(engine.pid))
            last[:] = [state, sorted(set(now) ^ set(baseline)), len(now) - len(baseline)]
            return state[0] == 0 and now == baseline

        # The engine forgets the dead client after its dead_after (2 s) and drops its leases.
        try:
            await eventually(released, "the engine released the dead client's leases")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; [state, fds differing, count]: {last}") from None
        state = await stub.shm_state()
        assert pool_fds(fds(engine.pid)) == state[4]
        # The dead client's pidfd is closed with its session: ours is the one left.
        assert fds(engine.pid).count(PIDFD) == 1
    assert dev_shm(engine.pid, proc.pid) == shm_before


@pytest.mark.parametrize("transport", ["torch_shm", "auto", "frames"])
async def test_independent_processes_alias_shared_tensors(
    anyio_backend: str, engine: EngineProcess, transport: str
):
    async with connected(engine.address()) as client:
        stub = client.with_options(transport=transport).stub()  # type: ignore[arg-type]
        shared = tensorrpc.shared_empty(1 << 16)
        shared.zero_()
        fresh = torch.zeros(1 << 16)
        assert await stub.fill(shared, 3.0) == 3.0 * (1 << 16)
        assert await stub.fill(fresh, 5.0) == 5.0 * (1 << 16)
        # A fresh tensor is copied: the engine's write stays there.
        assert torch.count_nonzero(fresh) == 0
        board = await stub.shared_board()
        before = float(board[0])
        await stub.bump_board(1.0)
        if transport == "frames":
            assert torch.count_nonzero(shared) == 0
            assert float(board[0]) == before
        else:
            # Tensors in tensorrpc shared memory travel by alias both ways: the engine
            # wrote into our tensor, and its later write shows in the result we hold.
            assert bool(torch.all(shared == 3.0))
            assert float(board[0]) == before + 1.0
            detail = client.statistics().transports.torch_shm_detail
            assert detail is not None
            assert detail.tensors_aliased >= 1
            assert (await stub.shm_state())[5] >= 1


def test_forged_handle_gets_a_clear_error_and_the_engine_keeps_serving(engine: EngineProcess):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.address())

    def reply() -> tuple[Header, bytes]:
        """The next message that is not a heartbeat (those are answered)."""
        while True:
            assert sock.poll(30_000), "no answer from the engine"
            header, payload, _ = split_frames(sock.recv_multipart())
            if header.kind is not MessageKind.PING:
                return header, bytes(payload)
            sock.send_multipart(encode_control(MessageKind.PONG, None, header.call_id))

    def forged(**fields: int) -> bytes:
        h: dict[str, int] = {"kind": HandleKind.POOL, "pid": os.getpid(), "fd": 0, "dev": 0}
        h.update(ino=0, lease=1, tag=1, base=64, span=4096, elem_offset=0)
        h.update(fields)
        return pack(Handle(strides=(1,), tail=b"", **h))  # type: ignore[arg-type]

    class Forger:
        def __init__(self, handle: bytes) -> None:
            self.handle = handle

        def place(self, tensor: torch.Tensor) -> tuple[str, bytes]:
            return "torch_shm", self.handle

    try:
        sock.send_multipart(encode_control(MessageKind.PING, None, 0))
        header, _payload = reply()
        assert header.kind is MessageKind.HELLO
        welcome = Welcome(
            client_id="forger",
            host_id=host_id(),
            transports=("frames", "torch_shm"),
            pid=os.getpid(),
        )
        sock.send_multipart(encode_control(MessageKind.WELCOME, welcome))
        with open(__file__, "rb") as victim:  # a regular file we own: must not be read
            cases = [
                forged(fd=victim.fileno()),  # our own fd, not a tensorrpc segment
                forged(pid=engine.pid, fd=0),  # someone else's pid
                forged(kind=HandleKind.TORCH_FD, fd=victim.fileno(), span=1 << 40),
                b"TRSH" + b"\x00" * 20,  # truncated
            ]
            for call_id, handle in enumerate(cases, 1):
                enc = encode([torch.zeros(1024, dtype=torch.uint8)], placer=Forger(handle))
                sock.send_multipart(
                    [pack_call_header(call_id, "digest"), enc.payload, *enc.buffers]
                )
                header, payload = reply()
                assert header.kind is MessageKind.ERROR
                assert header.call_id == call_id
                info = decode_control(header, payload)
                assert isinstance(info, ErrorInfo)
                assert "torch_shm" in info.message
        # The engine is still serving: a normal call with the tensor inline works.
        enc = encode([torch.arange(8, dtype=torch.uint8)])
        sock.send_multipart([pack_call_header(99, "digest"), enc.payload, *enc.buffers])
        header, payload = reply()
        assert header.kind is MessageKind.RESULT
        assert header.call_id == 99
        assert engine.proc.poll() is None
    finally:
        sock.close(0)
        ctx.term()


async def test_unread_results_are_released_without_waiting_for_the_sweep(
    anyio_backend: str, engine: EngineProcess
):
    async with connected(engine.address()) as client:
        view = client.with_options(transport="torch_shm")
        stub = client.stub()
        for _ in range(3):
            stream = view.stream(TensorService.items, 1000, 40_000)
            async with stream:
                first = await stream.__anext__()
                assert float(first[0]) == 0.0
                del first  # a decoded item holds its region until it is freed
            # Buffered and late items were never decoded; their leases go back at once.
            with anyio.fail_after(60):
                with anyio.CancelScope() as scope:
                    scope.deadline = anyio.current_time() + 0.001
                    await view.call(TensorService.make, "float32", [1 << 18], 0)

        async def released() -> bool:
            return (await stub.shm_state())[0] == 0

        await eventually(released, "the engine got RELEASE for every unread result")


class _Releases:
    """Counts the RELEASE messages and the lease ids in CALL headers a client's protocol
    machine builds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.messages = 0
        self.carried = 0
        frames = release_frames
        pack = pack_call_header

        def counting_frames(leases: Any) -> list[list[bytes]]:
            out = frames(leases)
            self.messages += len(out)
            return out

        def counting_pack(*args: Any, **kwargs: Any) -> bytes:
            self.carried += len(kwargs.get("releases", ()))
            return pack(*args, **kwargs)

        monkeypatch.setattr(_client_protocol, "release_frames", counting_frames)
        monkeypatch.setattr(_client_protocol, "pack_call_header", counting_pack)


async def test_result_leases_ride_the_next_call_and_none_is_left(
    anyio_backend: str, engine: EngineProcess, monkeypatch: pytest.MonkeyPatch
):
    counts = _Releases(monkeypatch)
    async with connected(engine.address()) as client:
        view = client.with_options(transport="torch_shm").stub()
        for _ in range(20):
            board = await view.shared_board()  # by alias: its lease ends once decoded
            del board
        # Each result's lease went back in the header of the next CALL: no RELEASE.
        assert counts.carried == 19
        assert counts.messages == 0
        # ... and the engine ended it before running that call.
        assert (await view.shm_state())[0] == 0
        assert counts.carried == 20
        assert counts.messages == 0


async def test_a_decoded_lease_goes_back_by_release_when_no_call_follows(
    anyio_backend: str, engine: EngineProcess, monkeypatch: pytest.MonkeyPatch
):
    counts = _Releases(monkeypatch)
    async with connected(engine.address()) as client, connected(engine.address()) as watcher:
        board = await client.with_options(transport="torch_shm").stub().shared_board()
        assert counts.messages == 0  # not yet: a CALL may follow at once

        async def released() -> bool:  # asked by another client: its CALLs carry nothing
            return (await watcher.stub().shm_state())[0] == 0

        # The caller yields (here, waiting for the watcher): a RELEASE goes instead.
        await eventually(released, "the engine got the RELEASE")
        assert counts.messages == 1
        assert counts.carried == 0
        del board
