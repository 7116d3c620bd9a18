"""torch's shared files are taken from an attested peer by ``pidfd_getfd``, not ``/proc``.

A handle of kind ``TORCH_FD`` or ``TORCH_FILE`` from a peer pinned by a pidfd is resolved
with one ``pidfd_getfd(2)`` on that pidfd (no path walk through ``/proc``, no ``open`` of
the file), then checked with ``fstat``: a regular file on ``/dev/shm``'s device with the
handle's inode. What it names must still be refused the same way: another file, a pipe,
a process that exited. Where the kernel refuses the call (Yama, seccomp), the receiver
falls back to ``/proc/<pid>/fd`` for good. In one process (it sends and receives through
its own pidfd), no sockets.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports import _shm_recv
from tensorrpc.transports._peer import KernelPeer
from tensorrpc.transports._shm_handle import pack, unpack
from tensorrpc.transports.torch_shm import TRANSPORT_NAME, TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

N = 4096
NO_ATTACH = "cannot attach to the handle"


@pytest.fixture
def own() -> Iterator[KernelPeer]:
    peer = KernelPeer.pinned(f"localhost:0:0:{os.getpid()}", os.pidfd_open(os.getpid()))
    assert peer is not None
    assert peer.fd_dir >= 0
    yield peer
    peer.close()


@pytest.fixture
def pair() -> Iterator[tuple[TorchShmTransport, TorchShmTransport]]:
    with TorchShmTransport() as client, TorchShmTransport() as engine:
        client.set_peer("engine", process="engine", alias_unsealed=True)
        yield client, engine


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The descriptors `_shm_recv._getfd` was asked for."""
    asked: list[int] = []
    real = _shm_recv._getfd

    def spy(pidfd: int, fd: int) -> int:
        asked.append(fd)
        return real(pidfd, fd)

    monkeypatch.setattr(_shm_recv, "_getfd", spy)
    monkeypatch.setattr(_shm_recv, "_getfd_usable", True)
    return asked


def _handle(client: TorchShmTransport, t: torch.Tensor) -> bytes:
    placed = client.placer("engine").place(t)
    assert placed is not None
    return placed[1]


def _resolve(engine: TorchShmTransport, peer: KernelPeer, handle: bytes) -> torch.Tensor:
    return engine.resolver(os.getpid(), peer=peer, unsealed=True).resolve(
        TRANSPORT_NAME, handle, torch.float32, (N,)
    )


def test_a_torch_file_is_taken_by_pidfd_getfd(
    pair: tuple[TorchShmTransport, TorchShmTransport], own: KernelPeer, calls: list[int]
) -> None:
    client, engine = pair
    t = torch.arange(N, dtype=torch.float32).share_memory_()  # type: ignore[no-untyped-call]
    handle = _handle(client, t)

    def no_proc(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("looked up through /proc")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "readlink", no_proc)
        got = _resolve(engine, own, handle)
    assert calls == [unpack(handle).fd]
    assert torch.equal(got, t)
    got[0] = -1.0  # the sender's memory, by alias
    assert float(t[0]) == -1.0


def test_a_descriptor_that_is_not_the_handles_file_is_refused(
    pair: tuple[TorchShmTransport, TorchShmTransport], own: KernelPeer, calls: list[int]
) -> None:
    client, engine = pair
    t = torch.arange(N, dtype=torch.float32).share_memory_()  # type: ignore[no-untyped-call]
    h = unpack(_handle(client, t))
    other = torch.arange(N, dtype=torch.float32).share_memory_()  # type: ignore[no-untyped-call]
    other_fd = other.untyped_storage()._get_shared_fd()
    read, write = os.pipe()
    try:
        for fd in (other_fd, read, 4_000):  # another file, a pipe, no file
            forged = pack(dataclasses.replace(h, fd=fd))
            with pytest.raises(TensorTransportError, match=NO_ATTACH) as info:
                _resolve(engine, own, forged)
            assert "/proc" not in str(info.value)
    finally:
        os.close(read)
        os.close(write)
    assert calls == [other_fd, read, 4_000]
    assert engine.statistics().mapped_segments == 0


def test_a_process_that_exited_fails_even_with_a_live_directory(
    pair: tuple[TorchShmTransport, TorchShmTransport], own: KernelPeer, calls: list[int]
) -> None:
    """The pidfd is the authority: once its process has exited, no descriptor of
    whoever has the pid now (here: ours, through our own live directory) is taken."""
    client, engine = pair
    t = torch.arange(N, dtype=torch.float32).share_memory_()  # type: ignore[no-untyped-call]
    handle = _handle(client, t)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = os.pidfd_open(proc.pid)
    proc.wait(30)
    reused = KernelPeer(
        os.getpid(), 0, 0, own.address, gone, os.fstat(gone).st_ino, fd_dir=os.dup(own.fd_dir)
    )
    try:
        with pytest.raises(TensorTransportError, match=NO_ATTACH):
            engine.resolver(os.getpid(), peer=reused, unsealed=True).resolve(
                TRANSPORT_NAME, handle, torch.float32, (N,)
            )
    finally:
        reused.close()
    assert engine.statistics().mapped_segments == 0


def test_where_the_kernel_refuses_it_proc_is_used_from_then_on(
    pair: tuple[TorchShmTransport, TorchShmTransport],
    own: KernelPeer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, engine = pair

    class Refusing:
        def __init__(self) -> None:
            self.calls = 0

        def syscall(self, *args: int) -> int:
            self.calls += 1
            ctypes.set_errno(errno.EPERM)  # (what Yama's ptrace_scope answers)
            return -1

    refusing = Refusing()
    monkeypatch.setattr(_shm_recv, "_libc", refusing)
    monkeypatch.setattr(_shm_recv, "_getfd_usable", True)
    for _ in range(2):
        t = torch.arange(N, dtype=torch.float32).share_memory_()  # type: ignore[no-untyped-call]
        assert torch.equal(_resolve(engine, own, _handle(client, t)), t)
    assert refusing.calls == 1
    assert _shm_recv._getfd_usable is False


def test_getfd_answers_only_what_the_process_has() -> None:
    pidfd = os.pidfd_open(os.getpid())
    read, write = os.pipe()
    try:
        got = _shm_recv._getfd(pidfd, read)
        assert got >= 0
        assert os.path.sameopenfile(got, read)
        assert os.get_inheritable(got) is False  # close-on-exec
        os.close(got)
        os.close(read)
        with pytest.raises(OSError, match="Bad file descriptor") as info:
            _shm_recv._getfd(pidfd, read)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(write)
        os.close(pidfd)
