"""torch_shm attacks from issue 9 (items 1-4, 8, 13 stride-0): each must be impossible.

A hostile peer speaks the wire protocol by hand (``tests/integration/server_peer.py``) to a
live engine in this process, on an ``ipc://`` path in a temp directory. It copies what the
engine's HELLO says (pid, host id) into its WELCOME, as the original attacks did; the
engine goes by what the kernel says about the connection instead (the attacker's pid,
here the engine's own process), so it gets no resolver (every handle refused with one
fixed message) and no result by handle. Attacks on the receiver's checks themselves
(SIGBUS by ``ftruncate``, sparse segments, stride-0 views) run against the transport
directly, and the SIGBUS one against an engine in its own process, with a client whose
``shm_alias_unsealed`` is ``"never"`` (torch's unsealed files then go through the pool).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import tensorrpc
from tensorrpc import _codec
from tensorrpc._client import Client
from tensorrpc._exceptions import TensorTransportError
from tensorrpc._protocol import Flags, Hello, MessageKind, Welcome, pack_call_header
from tensorrpc._server import Server
from tensorrpc.transports._shm_handle import Handle, pack, unpack
from tensorrpc.transports.torch_shm import TRANSPORT_NAME, HandleKind, TorchShmTransport
from tests.engine_proc import EngineProcess
from tests.integration.server_peer import Msg, Peer, open_peer
from tests.integration.server_services import Probe
from tests.transports._engine import TensorService

from ._live import SPEC

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not TorchShmTransport.available(), reason="torch_shm needs Linux"),
]

WAIT = 30.0


class _ForgedPlacer:
    """Makes the codec send a tensor as the given (forged) torch_shm handle."""

    def __init__(self, handle: bytes) -> None:
        self.handle = handle

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        del tensor
        return TRANSPORT_NAME, self.handle


def _forge(**fields: Any) -> bytes:
    values: dict[str, Any] = {
        "kind": HandleKind.POOL,
        "pid": os.getpid(),
        "fd": 3,
        "dev": 0,
        "ino": 0,
        "lease": 1,
        "tag": 0,
        "base": 64,
        "span": 4096,
        "elem_offset": 0,
        "strides": (1,),
        "tail": b"",
    }
    values.update(fields)
    return pack(Handle(**values))


def _call_with_handle(peer: Peer, call_id: int, handle: bytes, n: int, flags: int = 0) -> None:
    """CALL ``scale(x, 1.0)`` where ``x`` (``n`` uint8) travels as ``handle``."""
    wire = SPEC.methods["scale"].encode_args((torch.zeros(n, dtype=torch.uint8), 1.0), {})
    encoded = _codec.encode(wire, placer=_ForgedPlacer(handle))
    peer.send([pack_call_header(call_id, "scale", flags), encoded.payload, *encoded.buffers])


async def _spoofed_handshake(peer: Peer) -> Hello:
    """HELLO, then a WELCOME that claims everything HELLO said: pid, host."""
    peer.route = b"engine"
    with anyio.fail_after(WAIT):
        while True:  # the connection may not be up yet: ask until HELLO comes
            with contextlib.suppress(Exception):
                peer.control(MessageKind.PING, None, 0)
            with anyio.move_on_after(0.05):
                msg = await peer.recv(hello=True)
                break
    hello = msg.body()
    assert isinstance(hello, Hello)
    peer.hello = hello
    welcome: dict[str, Any] = {
        "client_id": "attacker",
        "host_id": hello.host_id,
        "transports": ("frames", TRANSPORT_NAME),
        "pid": hello.pid,
    }
    peer.control(MessageKind.WELCOME, Welcome(**welcome))
    return hello


async def _reply(peer: Peer, call_id: int) -> Msg:
    while True:
        msg = await peer.recv()
        assert msg.call_id == call_id, (msg.kind, msg.call_id)
        return msg


@contextlib.asynccontextmanager
async def _engine_and_attacker(tmp_path: Path) -> AsyncIterator[tuple[Server, Peer, Hello]]:
    async with Server(Probe(), bind=f"ipc://{tmp_path}/engine.sock", engine_id="victim") as server:
        assert server.endpoint is not None
        async with open_peer(SPEC, connect=server.endpoint) as (peer, _):
            hello = await _spoofed_handshake(peer)
            yield server, peer, hello


async def test_item1_a_peer_cannot_read_another_clients_released_tensor(tmp_path: Path) -> None:
    async with _engine_and_attacker(tmp_path) as (server, peer, hello):
        shm = server._policy.shm
        assert shm is not None
        # Another client received a tensor from the engine's pool and released it.
        secret = torch.full((4096,), 42, dtype=torch.uint8)
        placer = shm.placer("another client")
        placed = placer.place(secret)
        assert placed is not None
        assert placer.lease is not None
        h = unpack(placed[1])
        assert shm.release(placer.lease)
        # The attacker names that region with the freed tag (0), the live tag and a
        # guessed one, under the engine's own pid as its WELCOME claimed.
        replies = []
        for call_id, tag in enumerate((0, h.tag, 1), start=1):
            forged = _forge(pid=hello.pid, fd=h.fd, dev=h.dev, ino=h.ino, tag=tag, base=h.base)
            _call_with_handle(peer, call_id, forged, 4096)
            replies.append(await _reply(peer, call_id))
        for msg in replies:
            assert msg.kind is MessageKind.ERROR, "the engine resolved a forged handle"
            assert "not in use with this peer" in msg.error().message
        # The engine is fine and still serves (by frames).
        peer.call("add", 1, 2, call_id=10)
        assert await _reply(peer, 10) is not None


HOST_FILE = "/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd"


async def test_item2_errors_leak_no_file_names_and_no_fd_oracle(tmp_path: Path) -> None:
    fd_file = os.open(HOST_FILE, os.O_RDONLY | os.O_CLOEXEC)
    sock_a, sock_b = socket.socketpair()
    try:
        async with _engine_and_attacker(tmp_path) as (_server, peer, hello):
            messages = set()
            fds = (fd_file, sock_a.fileno(), 99_999, 0, 1)
            for call_id, fd in enumerate(fds, start=1):
                for kind in (HandleKind.POOL, HandleKind.TORCH_FD):
                    base = 64 if kind == HandleKind.POOL else 0
                    forged = _forge(kind=kind, pid=hello.pid, fd=fd, base=base)
                    cid = call_id * 10 + int(kind)
                    _call_with_handle(peer, cid, forged, 4096)
                    msg = await _reply(peer, cid)
                    assert msg.kind is MessageKind.ERROR
                    messages.add(msg.error().message)
            assert len(messages) == 1, messages  # no oracle: every fd gets the same answer
            text = messages.pop()
            for leak in ("/etc", "hostname", "passwd", "socket", "memfd", "no fd", "/proc"):
                assert leak not in text
    finally:
        os.close(fd_file)
        sock_a.close()
        sock_b.close()


async def test_item8_an_unproven_peer_gets_no_result_by_handle(tmp_path: Path) -> None:
    async with _engine_and_attacker(tmp_path) as (server, peer, _hello):
        x = torch.ones(2 << 20, dtype=torch.uint8)
        flags = int(Flags.SHM_RESULTS_ALL)
        for call_id in range(1, 9):
            peer.call("scale", x, 1.0, call_id=call_id, flags=flags)
            msg = await _reply(peer, call_id)
            assert msg.kind is MessageKind.RESULT
            assert len(msg.buffers) == 1  # a frame, not a handle into the engine's pool
        detail = server.statistics().transports.torch_shm_detail
        assert detail is not None
        assert (detail.leases_active, detail.pool_bytes_in_use, detail.tensors_sent) == (0, 0, 0)


def test_item8_unreleased_bytes_per_peer_are_capped_then_frames() -> None:
    with TorchShmTransport(peer_max_bytes=(4 << 20) + 4096) as shm:  # 4 regions of 1 MiB
        leases: list[int] = []
        for _ in range(4):
            placer = shm.placer("greedy")
            assert placer.place(torch.zeros(1 << 20, dtype=torch.uint8)) is not None
            assert placer.lease is not None
            leases.append(placer.lease)
        assert shm.placer("greedy").place(torch.zeros(1 << 20, dtype=torch.uint8)) is None
        assert shm.placer("polite").place(torch.zeros(1 << 20, dtype=torch.uint8)) is not None
        stats = shm.statistics()
        assert (stats.peer_limited, stats.fallbacks) == (1, 1)
        assert stats.pool_bytes_in_use <= 6 << 20
        assert shm.release(leases[0], peer="greedy")
        assert shm.placer("greedy").place(torch.zeros(1 << 20, dtype=torch.uint8)) is not None
        assert not shm.release(leases[1], peer="polite")  # not its lease
        assert not shm.release(leases[0], peer="greedy")  # twice
        assert not shm.release(10**9, peer="greedy")  # never made
        assert shm.statistics().releases_refused == 3


def _sealed_sparse_memfd(name: str, size: int, *, seal: bool = True) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def test_item4_a_sparse_segment_costs_only_the_pages_a_handle_reads() -> None:
    size = 512 << 20
    fd = _sealed_sparse_memfd(f"tensorrpc-{os.getpid()}-999", size)
    try:
        os.pwrite(fd, struct.pack("<Q", 7), 0)  # the region's tag
        st = os.fstat(fd)
        forged = _forge(fd=fd, dev=st.st_dev, ino=st.st_ino, tag=7, base=64, span=64)
        with TorchShmTransport() as shm:
            t = shm.resolver(os.getpid()).resolve(TRANSPORT_NAME, forged, torch.uint8, (64,))
            assert t.numel() == 64
            # Only the page the handle needs was faulted in: the 512 MiB stay unallocated.
            assert os.fstat(fd).st_blocks * 512 <= 1 << 20
        with (
            TorchShmTransport(max_segment_bytes=64 << 20) as small,
            pytest.raises(TensorTransportError, match="larger than"),
        ):
            small.resolver(os.getpid()).resolve(TRANSPORT_NAME, forged, torch.uint8, (64,))
    finally:
        os.close(fd)


def test_item4_an_unsealed_segment_is_never_mapped() -> None:
    for name in (f"tensorrpc-{os.getpid()}-998", f"tensorrpc-shared-{os.getpid()}-998"):
        fd = _sealed_sparse_memfd(name, 1 << 20, seal=False)
        try:
            os.pwrite(fd, struct.pack("<Q", 7), 0)
            st = os.fstat(fd)
            pool = "shared" not in name
            forged = _forge(
                kind=HandleKind.POOL if pool else HandleKind.SHARED,
                fd=fd,
                dev=st.st_dev,
                ino=st.st_ino,
                tag=7 if pool else 0,
                base=64 if pool else 0,
                span=64,
            )
            with TorchShmTransport() as shm, pytest.raises(TensorTransportError, match="sealed"):
                shm.resolver(os.getpid()).resolve(TRANSPORT_NAME, forged, torch.uint8, (64,))
        finally:
            os.close(fd)


def test_item13_a_stride_0_view_cannot_stand_for_a_huge_tensor() -> None:
    shape = (1 << 27,)  # 512 MiB of float32 over 4 KiB of memory
    with TorchShmTransport() as shm:
        for source in (
            torch.zeros(1024).share_memory_(),  # type: ignore[no-untyped-call]
            tensorrpc.share(torch.zeros(1024)),
        ):
            placed = shm.placer("p").place(source)
            assert placed is not None
            fields = {n: getattr(unpack(placed[1]), n) for n in Handle.__slots__}
            fields["strides"] = (0,)
            forged = pack(Handle(**fields))
            with pytest.raises(TensorTransportError):
                shm.resolver(os.getpid()).resolve(TRANSPORT_NAME, forged, torch.float32, shape)
        # The sender never aliases an overlapping view either: it copies it.
        expanded = tensorrpc.share(torch.arange(4.0))[:1].expand(1 << 10)
        placed = shm.placer("p").place(expanded)
        assert placed is not None
        assert unpack(placed[1]).kind == HandleKind.POOL


def test_item3_sealed_shared_memory_cannot_shrink() -> None:
    t = tensorrpc.shared_empty(1024)
    with TorchShmTransport() as shm:
        placed = shm.placer("p").place(t)
        assert placed is not None
        h = unpack(placed[1])
        assert h.kind == HandleKind.SHARED
        with pytest.raises(PermissionError):
            os.ftruncate(h.fd, 0)


async def test_item3_truncating_a_torch_shared_file_during_a_call_cannot_crash_the_engine(
    anyio_backend: str, tmp_path: Path
) -> None:
    # With "never" torch's unsealed files are copied through the sealed pool; with the
    # default the engine would map them (the gate holds: same user, same caps), which is
    # the documented residual risk between processes that may kill each other anyway.
    with EngineProcess(
        "tensor-engine", workdir=tmp_path, bind=f"ipc://{tmp_path}/engine.sock", service="tensor"
    ) as engine:
        async with Client(
            TensorService,
            connect=engine.address(),
            heartbeat_interval=0.2,
            shm_alias_unsealed="never",
        ) as client:
            with anyio.fail_after(WAIT):
                await client.wait_for_engines(1)
                stub = client.with_options(transport="torch_shm").stub()
                x = torch.ones(1 << 20)
                x.share_memory_()  # type: ignore[no-untyped-call]
                fd = x.untyped_storage()._get_shared_fd()  # type: ignore[attr-defined]
                async with anyio.create_task_group() as tg:
                    result: list[float] = []

                    async def call() -> None:
                        result.append(await stub.gated_sum(x))

                    tg.start_soon(call)
                    await stub.wait_gated()  # the engine holds the argument tensor now
                    os.ftruncate(fd, 0)  # what a careless or hostile client may do
                    await stub.open_gate()
                assert result == [float(1 << 20)]
                assert await stub.digest(torch.zeros(4)) is not None  # still serving
        assert engine.stop() == 0
