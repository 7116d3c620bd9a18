"""A handle is resolved only against the process the kernel attested, while it lives.

* pid reuse: the attested process exits and its pid is taken by another process that
  holds a genuine file at the handle's descriptor (simulated here: the pid is ours, the
  pidfd is of a child that exited). The open must fail with the one fixed error, on a
  fresh open and on a mapping kept from before.
* a message that did not come on the attested connection (another ``Peer-Address``: a
  ROUTER handover, another connection under the same routing id) gets no resolver.
* per-peer caps count a process, not a connection: N connections of one process share
  one ``peer_max_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import tensorrpc
from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports._peer import KernelPeer, parse_peer_address
from tensorrpc.transports._policy import TransportPolicy
from tensorrpc.transports.torch_shm import TRANSPORT_NAME, TorchShmTransport

pytestmark = pytest.mark.skipif(not TorchShmTransport.available(), reason="torch_shm needs Linux")

NO_ATTACH = "cannot attach to the handle"


@contextlib.contextmanager
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.kill()
        proc.wait(30)


def pinned(pid: int, address: str = "") -> KernelPeer:
    pidfd = os.pidfd_open(pid)
    return KernelPeer(pid, 0, 0, address or f"localhost:0:0:{pid}", pidfd, os.fstat(pidfd).st_ino)


def dead_peer_under(pid: int) -> KernelPeer:
    """A peer attested as ``pid`` whose pinned process has exited (its pid reused)."""
    with child() as proc:
        gone = pinned(proc.pid)
        proc.kill()
        proc.wait(30)
    assert not gone.alive()
    return KernelPeer(pid, 0, 0, gone.address, gone.pidfd, gone.ino)


@pytest.mark.parametrize("kind", ["pool", "shared"])
def test_a_handle_of_an_exited_process_never_reaches_the_process_that_reused_its_pid(
    kind: str,
) -> None:
    src = torch.arange(4096, dtype=torch.uint8)
    if kind == "shared":
        src = tensorrpc.share(src)
    with TorchShmTransport() as sender, TorchShmTransport() as receiver:
        placed = sender.placer("p").place(src)
        assert placed is not None
        dead = dead_peer_under(os.getpid())
        try:
            with pytest.raises(TensorTransportError, match=NO_ATTACH) as info:
                receiver.resolver(os.getpid(), peer=dead).resolve(
                    TRANSPORT_NAME, placed[1], torch.uint8, (4096,)
                )
            assert "/proc" not in str(info.value)
            assert receiver.statistics().mapped_segments == 0
        finally:
            dead.close()
        # The same handle resolves while the attested process lives (a mapping is kept),
        # and then fails again once it is gone: the kept mapping is no way around it.
        with child() as proc:
            live = KernelPeer(os.getpid(), 0, 0, "a", *_pidfd(proc.pid))
            got = receiver.resolver(os.getpid(), peer=live).resolve(
                TRANSPORT_NAME, placed[1], torch.uint8, (4096,)
            )
            assert torch.equal(got, src)
            proc.kill()
            proc.wait(30)
            with pytest.raises(TensorTransportError, match=NO_ATTACH):
                receiver.resolver(os.getpid(), peer=live).resolve(
                    TRANSPORT_NAME, placed[1], torch.uint8, (4096,)
                )
            live.close()


def test_descriptors_are_looked_up_only_in_the_directory_of_the_pinned_process() -> None:
    """The ``/proc/<pid>/fd`` directory is taken when the peer is pinned: once that
    process has exited, no lookup there reaches whoever has its pid now (here: the
    number is ours, the directory a dead child's), even while a pidfd says alive."""
    src = tensorrpc.share(torch.arange(4096, dtype=torch.uint8))
    with TorchShmTransport() as sender, TorchShmTransport() as receiver:
        placed = sender.placer("p").place(src)
        assert placed is not None
        with child() as proc:
            gone = KernelPeer.pinned(f"localhost:0:0:{proc.pid}", os.pidfd_open(proc.pid))
            assert gone is not None
            assert gone.fd_dir >= 0
            proc.kill()
            proc.wait(30)
        with child() as other:
            # Alive by its pidfd (another child's), the pid ours: only the directory
            # stands between the handle and this process's own descriptors.
            reused = KernelPeer(
                os.getpid(), 0, 0, "a", *_pidfd(other.pid), fd_dir=os.dup(gone.fd_dir)
            )
            gone.close()
            assert reused.alive()
            with pytest.raises(TensorTransportError, match=NO_ATTACH):
                receiver.resolver(os.getpid(), peer=reused).resolve(
                    TRANSPORT_NAME, placed[1], torch.uint8, (4096,)
                )
            assert receiver.statistics().mapped_segments == 0
            reused.close()
        # Pinned while it lives, the same handle resolves (our own directory).
        own = KernelPeer.pinned(f"localhost:0:0:{os.getpid()}", os.pidfd_open(os.getpid()))
        assert own is not None
        assert own.fd_dir >= 0
        got = receiver.resolver(os.getpid(), peer=own).resolve(
            TRANSPORT_NAME, placed[1], torch.uint8, (4096,)
        )
        assert torch.equal(got, src)
        dir_fd = own.fd_dir
        own.close()
        assert not own.alive()
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(dir_fd)


def _pidfd(pid: int) -> tuple[int, int]:
    fd = os.pidfd_open(pid)
    return fd, os.fstat(fd).st_ino


class _Frame:
    def __init__(self, address: str) -> None:
        self.address = address


def _address(frame: object) -> str:
    return frame.address if isinstance(frame, _Frame) else ""


def test_only_messages_on_the_attested_connection_get_a_resolver() -> None:
    policy = TransportPolicy(message_address=_address)
    try:
        with child() as proc:
            address = f"localhost:0:0:{proc.pid}"
            state = policy.peers.attest(
                "c", pinned(proc.pid, address), offers=("frames", TRANSPORT_NAME)
            )
            assert state == (proc.pid, True, True)
            ok = policy.peers.resolver("c", frame=_Frame(address))
            assert ok is not None
            # Another connection under the same routing id (a handover), or no frame.
            for frame in (_Frame(f"localhost:0:0:{proc.pid + 1}"), _Frame(""), None):
                refusing = policy.peers.resolver("c", frame=frame)
                assert refusing is not None
                with pytest.raises(TensorTransportError, match="not in use with this peer"):
                    refusing.resolve(TRANSPORT_NAME, b"x" * 64, torch.uint8, (4,))
            # A peer the kernel did not attest (tcp) is off, whatever it claims ...
            assert policy.peers.attest(
                "t", None, offers=("frames", TRANSPORT_NAME), claimed_pid=proc.pid, same_host=True
            ) == (0, False, False)
        # ... unless this end is configured to trust unattested peers.
        trusting = TransportPolicy(trust_unattested=True)
        try:
            assert trusting.peers.attest(
                "t", None, offers=("frames", TRANSPORT_NAME), claimed_pid=1, same_host=True
            ) == (1, True, True)
            assert trusting.peers.attest(
                "u", None, offers=("frames", TRANSPORT_NAME), claimed_pid=1, same_host=False
            ) == (0, False, False)
        finally:
            trusting.close()
    finally:
        policy.close()


def test_the_pidfd_of_a_peer_is_closed_when_it_goes() -> None:
    policy = TransportPolicy()
    try:
        with child() as proc:
            peer = pinned(proc.pid)
            fd = peer.pidfd
            policy.peers.attest("c", peer, offers=("frames", TRANSPORT_NAME))
            os.fstat(fd)  # held while the session lives
            policy.memory.peer_gone("c", policy.peers.drop("c"))
            assert peer.pidfd == -1
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.fstat(fd)
    finally:
        policy.close()


def test_peer_address_parsing() -> None:
    assert parse_peer_address("localhost:1000:100:4242") == (4242, 1000, 100)
    for bad in ("127.0.0.1", "", "localhost:a:b:c", "x:0:0:0", "x:-1:0:5"):
        assert parse_peer_address(bad) is None


def test_per_peer_caps_count_a_process_not_a_connection() -> None:
    mib = torch.zeros(1 << 20, dtype=torch.uint8)
    policy = TransportPolicy(shm_threshold=0)
    shm = policy.shm
    assert shm is not None
    shm._budget.max_bytes = (2 << 20) + 8192  # two 1 MiB regions and their headers
    try:
        with child() as one, child() as other:
            offers = ("frames", TRANSPORT_NAME)
            # Three connections of one process, one of another.
            for conn in ("a1", "a2", "a3"):
                policy.peers.attest(conn, pinned(one.pid), offers=offers)
            policy.peers.attest("b1", pinned(other.pid), offers=offers)
            placed = []
            for conn in ("a1", "a2"):
                placer = policy.placer("torch_shm", conn, peer_receives=True)
                assert placer is not None
                assert placer.place(mib) is not None
                placed.append(placer)
            # The process has its cap's worth leased: a third connection gets frames.
            third = policy.placer("torch_shm", "a3", peer_receives=True)
            assert third is not None
            assert third.place(mib) is None
            assert shm.statistics().peer_limited == 1
            # Another process has a cap of its own.
            other_placer = policy.placer("torch_shm", "b1", peer_receives=True)
            assert other_placer is not None
            assert other_placer.place(mib) is not None
            # A release by one connection makes room for its process's others.
            lease = placed[0].lease
            assert lease is not None
            policy.memory.release([lease], "a1")
            again = policy.placer("torch_shm", "a3", peer_receives=True)
            assert again is not None
            assert again.place(mib) is not None
    finally:
        policy.close()
