"""A repeated alias handle skips the parse and the checks it passed before (issue 20).

The receiver remembers an alias handle resolved on a kept mapping by its bytes less the
lease id (`Receiver.known`); the same bytes come back each time a tensor in shared memory
is sent again. Remembering must never widen what a handle may reach: the mapping it was
checked against must still be the one kept, the resolver must be for the same pid, a
torch file still needs the unsealed gate, and another dtype or shape is checked afresh.
In one process (it sends and receives through ``/proc/self/fd``), no sockets.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

from tensorrpc import _release
from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports import _shm_recv
from tensorrpc.transports._shared import share
from tensorrpc.transports.torch_shm import TRANSPORT_NAME, TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

N = 4096


@pytest.fixture(autouse=True)
def inline_release() -> Iterator[None]:
    threshold, queued = _release.threshold(), _release.max_queued()
    _release.set_release_threshold(sys.maxsize)
    yield
    _release.set_release_threshold(threshold, max_queued=queued)


@pytest.fixture
def pair() -> Iterator[tuple[TorchShmTransport, TorchShmTransport]]:
    with TorchShmTransport() as client, TorchShmTransport() as engine:
        client.set_peer("engine", process="engine", alias_unsealed=True)
        yield client, engine


def _handle(client: TorchShmTransport, t: torch.Tensor) -> tuple[bytes, int]:
    placer = client.placer("engine")
    placed = placer.place(t)
    assert placed is not None
    assert placer.lease is not None
    return placed[1], placer.lease


def _no_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    def unpack(handle: bytes) -> None:
        raise AssertionError("parsed again")

    monkeypatch.setattr(_shm_recv, "unpack", unpack)


@pytest.mark.parametrize("kind", ["share", "share_memory_"])
def test_a_repeated_handle_resolves_without_a_parse_to_the_same_memory(
    pair: tuple[TorchShmTransport, TorchShmTransport], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, engine = pair
    src = torch.arange(2 * N, dtype=torch.float32)
    t = share(src) if kind == "share" else src.share_memory_()  # type: ignore[no-untyped-call]
    view = t[N // 2 : N // 2 + N]  # an offset into the storage
    for _ in range(2):  # mapped, then kept and remembered
        handle, lease = _handle(client, view)
        got = engine.resolver(os.getpid(), unsealed=True).resolve(
            TRANSPORT_NAME, handle, torch.float32, (N,)
        )
        client.release(lease)
    _no_parse(monkeypatch)
    handle, lease = _handle(client, view)
    resolver = engine.resolver(os.getpid(), unsealed=True)
    got = resolver.resolve(TRANSPORT_NAME, handle, torch.float32, (N,))
    assert resolver.leases == (lease,)
    assert torch.equal(got, view)
    got[0] = -1.0  # the sender's memory
    assert float(view[0]) == -1.0
    assert engine.statistics().tensors_received_aliased == 3


def test_a_remembered_handle_is_checked_afresh_for_another_pid_dtype_shape_or_gate(
    pair: tuple[TorchShmTransport, TorchShmTransport],
) -> None:
    client, engine = pair
    t = torch.arange(N, dtype=torch.float32).share_memory_()  # type: ignore[no-untyped-call]
    for _ in range(2):
        handle, _ = _handle(client, t)
        engine.resolver(os.getpid(), unsealed=True).resolve(
            TRANSPORT_NAME, handle, torch.float32, (N,)
        )
    assert engine._receiver._known
    cases = [
        ((os.getpid() + 1, True), torch.float32, (N,), "cannot attach"),
        ((os.getpid(), False), torch.float32, (N,), "not accepted from this peer"),
        ((os.getpid(), True), torch.float32, (2 * N,), "needs bytes"),
        ((os.getpid(), True), torch.float64, (N,), "needs bytes"),
    ]
    for (pid, unsealed), dtype, shape, error in cases:
        resolver = engine.resolver(pid, unsealed=unsealed)
        with pytest.raises(TensorTransportError, match=error):
            resolver.resolve(TRANSPORT_NAME, handle, dtype, shape)


def test_a_remembered_handle_of_a_freed_segment_fails(
    pair: tuple[TorchShmTransport, TorchShmTransport],
) -> None:
    """The sender freed the storage and the receiver dropped its mapping: the bytes it
    remembers name a mapping that is gone, and the handle fails as any stale one does."""
    client, engine = pair
    t = share(torch.arange(N, dtype=torch.float32))
    for _ in range(2):
        handle, lease = _handle(client, t)
        got = engine.resolver(os.getpid()).resolve(TRANSPORT_NAME, handle, torch.float32, (N,))
        client.release(lease)
    del got, t
    assert engine._receiver.prune() == 1
    with pytest.raises(TensorTransportError, match="cannot attach"):
        engine.resolver(os.getpid()).resolve(TRANSPORT_NAME, handle, torch.float32, (N,))
