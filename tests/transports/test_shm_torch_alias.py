"""torch.multiprocessing shared memory goes by alias again, under the unsealed-alias gate.

A tensor already in torch's shared memory (``share_memory_()``, either sharing strategy)
travels as a handle naming torch's own file when the receiver's gate holds for the
connection's kernel identity (here: another process of ours, same uid, same
capabilities, same namespaces), so the engine's writes show in the caller's tensor. With
``shm_alias_unsealed="never"`` on either end it is copied through the sealed pool, as are
tensors to a peer whose gate fails (`alias_gate` refuses a process with fewer
capabilities or another uid: checked against real processes made with ``setpriv``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp

from tensorrpc._client import Client
from tensorrpc._zmq import peer_credentials
from tensorrpc.transports._peer import KernelPeer, alias_gate
from tensorrpc.transports.torch_shm import TorchShmTransport
from tests.engine_proc import ROOT, EngineProcess
from tests.transports._engine import TensorService

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not TorchShmTransport.available(), reason="torch_shm needs Linux"),
]

N = 1 << 16


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[EngineProcess]:
    with EngineProcess(
        "tensor-engine", workdir=tmp_path, bind=f"ipc://{tmp_path}/engine.sock", service="tensor"
    ) as proc:
        yield proc


@contextlib.contextmanager
def sharing(strategy: str) -> Iterator[None]:
    before = tmp.get_sharing_strategy()  # type: ignore[no-untyped-call]
    tmp.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)  # type: ignore[no-untyped-call]


def shared_zeros(strategy: str) -> torch.Tensor:
    """``N`` zeros in torch's shared memory, made before any session is open.

    The first use of ``file_system`` in a process starts torch's shm manager (a program
    that loads libtorch) and blocks until it is up: 0.3 to 3 s here, more under load.
    Made inside a session, that blocks the client's event loop past the engine's 2 s
    bound: the engine forgets the silent client (and its next call fails, "replaced by
    a new session").
    """
    with sharing(strategy):
        return torch.zeros(N).share_memory_()  # type: ignore[no-untyped-call,no-any-return]


@contextlib.asynccontextmanager
async def connected(address: str, **kw: object) -> AsyncIterator[Client[TensorService]]:
    async with Client(TensorService, connect=address, heartbeat_interval=0.2, **kw) as client:  # type: ignore[arg-type]
        await client.wait_for_engines(1, timeout=60)
        yield client


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
async def test_share_memory_tensors_go_by_alias_when_the_gate_holds(
    anyio_backend: str, engine: EngineProcess, strategy: str
) -> None:
    x = shared_zeros(strategy)
    async with connected(engine.address()) as client:
        stub = client.with_options(transport="torch_shm").stub()
        assert await stub.fill(x, 3.0) == 3.0 * N
        # The engine wrote into the very memory we hold: it mapped torch's file.
        assert bool(torch.all(x == 3.0))
        detail = client.statistics().transports.torch_shm_detail
        assert detail is not None
        assert detail.tensors_aliased == 1
        assert (await stub.shm_state())[0] == 0  # the lease ended with the reply
        # The argument's storage is pinned by the lease only: nothing is left in the pool.
        assert detail.pool_bytes_in_use == 0


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
async def test_with_never_share_memory_tensors_are_copied(
    anyio_backend: str, engine: EngineProcess, strategy: str
) -> None:
    x = shared_zeros(strategy)
    async with connected(engine.address(), shm_alias_unsealed="never") as client:
        stub = client.with_options(transport="torch_shm").stub()
        assert await stub.fill(x, 3.0) == 3.0 * N
        assert torch.count_nonzero(x) == 0  # a copy went: the engine's write stayed there
        detail = client.statistics().transports.torch_shm_detail
        assert detail is not None
        assert (detail.tensors_sent, detail.tensors_aliased) == (1, 0)


def test_shm_alias_unsealed_takes_two_values() -> None:
    with pytest.raises(ValueError, match="shm_alias_unsealed"):
        Client(TensorService, connect="ipc:///nonexistent", shm_alias_unsealed="always")  # type: ignore[arg-type]


# -- the gate, against real processes ----------------------------------------------------

SETPRIV = shutil.which("setpriv")


@contextlib.contextmanager
def process(*prefix: str) -> Iterator[KernelPeer]:
    """A process started under ``prefix`` (setpriv ...), pinned by a pidfd, then reaped."""
    proc = subprocess.Popen([*prefix, "sh", "-c", "echo up; exec sleep 60"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"up\n"  # (setpriv has run: what we read is its work)
    proc.stdout.close()
    pidfd = os.pidfd_open(proc.pid)
    peer = KernelPeer(proc.pid, -1, -1, "", pidfd, os.fstat(pidfd).st_ino)
    try:
        yield peer
    finally:
        proc.kill()
        proc.wait(30)
        peer.close()


def _caps() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


def test_the_gate_holds_for_our_user_with_our_capabilities() -> None:
    with process() as peer:
        assert alias_gate(peer) == (True, True)


@pytest.mark.skipif(SETPRIV is None or os.geteuid() != 0, reason="needs root and setpriv")
def test_the_gate_fails_for_another_user() -> None:
    assert SETPRIV is not None
    with process(SETPRIV, "--reuid", "65534", "--regid", "65534", "--clear-groups") as peer:
        assert alias_gate(peer) == (False, False)


@pytest.mark.skipif(SETPRIV is None or not _caps() & (1 << 5), reason="needs setpriv and CAP_KILL")
def test_the_gate_is_one_way_with_a_peer_that_holds_fewer_capabilities() -> None:
    assert SETPRIV is not None
    with process(SETPRIV, "--bounding-set", "-kill", "--inh-caps", "-kill") as peer:
        # It lacks CAP_KILL, we hold it: we may not map its files (it could not hurt us
        # otherwise), it may map ours (we could kill it anyway).
        assert alias_gate(peer) == (False, True)


def test_the_gate_fails_once_the_pinned_process_exited() -> None:
    with process() as peer:
        os.kill(peer.pid, 9)
        os.waitid(os.P_PIDFD, peer.pidfd, os.WEXITED | os.WNOWAIT)
        assert not peer.alive()
        assert alias_gate(peer) == (False, False)


def test_an_unattested_peer_never_passes_the_gate() -> None:
    assert alias_gate(KernelPeer(os.getppid(), -1, -1, "")) == (False, False)
    assert peer_credentials(b"not a frame") is None


@pytest.mark.skipif(SETPRIV is None or not _caps() & (1 << 5), reason="needs setpriv and CAP_KILL")
def test_an_engine_that_fails_the_gate_gets_share_memory_tensors_by_copy(
    engine: EngineProcess,
) -> None:
    """End to end: our client runs without CAP_KILL, the engine holds it, so the engine
    fails the client's gate (it could map our files and hurt us in ways we cannot hurt
    it): torch's shared files go by copy through the sealed pool, never mapped."""
    assert SETPRIV is not None
    proc = subprocess.Popen(
        [SETPRIV, "--bounding-set", "-kill", "--inh-caps", "-kill",
         sys.executable, "-m", "tests.transports._gate_client", engine.address()],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    got = json.loads(out.splitlines()[-1])
    assert got["sums"] == [3.0 * N, 3.0 * N]
    # The engine wrote into a copy: our tensors are untouched.
    assert got["untouched"] == [True, True]
    # Both went by torch_shm handle (the pool), none by alias, none as frames.
    assert (got["sent"], got["aliased"], got["fallbacks"], got["frames_sent"]) == (2, 0, 0, 0)
    # The engine mapped none of our files: it received two tensors, neither by alias.
    assert got["engine"][3] == 2
    assert got["engine"][6] == 0
