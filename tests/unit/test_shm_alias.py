"""Tensors that go by alias under torch_shm, counted on both sides (issue 12 item 3).

Transport level, in one process (it sends and receives through ``/proc/self/fd``): a
tensor in tensorrpc shared memory is sent with no copy (``tensors_aliased`` on the
sender) and received as the sender's memory (``tensors_received_aliased`` on the
receiver); anything else, torch's own ``share_memory_()`` included, is copied once. The
transfer benchmark's engine answers such a tensor for its ``shared`` results, and the
benchmark flags a run where the statistics show a copy instead.
"""

from __future__ import annotations

import os
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from bench.peers.tensorrpc_peer import BenchService
from bench.shm_handle_cost import Pair, measure
from bench.transfer import _transport_check
from tensorrpc import _codec
from tensorrpc.transports._shared import lookup, share
from tensorrpc.transports._shm_handle import HandleKind, unpack
from tensorrpc.transports.torch_shm import TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

CONFIG = _codec.CodecConfig()


def _run(coro: Coroutine[Any, Any, torch.Tensor]) -> torch.Tensor:
    """Run a coroutine that never waits (the benchmark's handlers), on no event loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        result: torch.Tensor = stop.value
        return result
    coro.close()
    raise AssertionError("the handler waited")


def _send(tensor: torch.Tensor) -> tuple[torch.Tensor, TorchShmTransport, TorchShmTransport]:
    """Encode ``tensor`` with one transport's placer and decode it with another's resolver."""
    sender, receiver = TorchShmTransport(), TorchShmTransport()
    placer = sender.placer("client")
    encoded = _codec.encode(tensor, CONFIG, placer=placer)
    resolver = receiver.resolver(None, hold="engine")
    got = _codec.decode(encoded.payload, encoded.buffers, CONFIG, resolver=resolver)
    assert isinstance(got, torch.Tensor)
    return got, sender, receiver


def test_a_shared_tensor_is_received_as_the_senders_memory() -> None:
    t = share(torch.arange(1024, dtype=torch.float32))
    got, sender, receiver = _send(t[8:520])
    try:
        assert sender.statistics().tensors_aliased == 1
        stats = receiver.statistics()
        assert (stats.tensors_received, stats.tensors_received_aliased) == (1, 1)
        assert torch.equal(got, t[8:520])
        got[0] = -1.0  # an alias: a write is seen on the other side
        assert float(t[8]) == -1.0
    finally:
        sender.close()
        receiver.close()


def test_a_torch_shared_tensor_is_copied_and_received_private() -> None:
    t = torch.arange(1024, dtype=torch.float32)
    t.share_memory_()  # type: ignore[no-untyped-call]
    got, sender, receiver = _send(t)
    try:
        assert (sender.statistics().tensors_sent, sender.statistics().tensors_aliased) == (1, 0)
        stats = receiver.statistics()
        assert (stats.tensors_received, stats.tensors_received_aliased) == (1, 0)
        got[0] = -1.0  # built on the sender's pool region leased to us, not on `t`
        assert float(t[0]) == 0.0
    finally:
        sender.close()
        receiver.close()


def test_the_benchmark_engines_shared_result_goes_by_alias() -> None:
    service = BenchService()
    result = _run(service.produce(64 << 10, True))
    assert lookup(result.untyped_storage()) is not None  # in tensorrpc shared memory
    got, sender, receiver = _send(result)
    try:
        assert sender.statistics().tensors_aliased == 1
        assert receiver.statistics().tensors_received_aliased == 1
        assert float(got[-1]) == (64 << 10) // 4 - 1
        got[0] = 42.0  # the engine's own tensor, not a copy
        assert float(result[0]) == 42.0
    finally:
        sender.close()
        receiver.close()
    # The fresh result of the same size is a different tensor, copied once.
    fresh = _run(service.produce(64 << 10, False))
    assert lookup(fresh.untyped_storage()) is None


def test_the_benchmark_flags_shared_results_that_were_copied() -> None:
    names = ("shm_tensors", "shm_aliased", "shm_received", "shm_received_aliased")
    before: dict[str, int | None] = dict.fromkeys(names, 0)
    aliased: dict[str, int | None] = dict(zip(names, (5, 5, 7, 7), strict=True))
    assert "warning" not in _transport_check("torch_shm", "share", before, aliased)
    copied = {**aliased, "shm_received_aliased": 4}
    warning = _transport_check("torch_shm", "share", before, copied)["warning"]
    assert "3 shared result tensors were copied" in warning
    # torch's shared memory (share_memory_(), DataLoader batches) is flagged alike
    batches: dict[str, int | None] = dict(zip(names, (5, 0, 0, 0), strict=True))
    for kind in ("torch_shared", "loader"):
        got = _transport_check("torch_shm", kind, before, batches)["warning"]
        assert "5 shared tensors were copied, not aliased" in got
    assert "warning" not in _transport_check("torch_shm", "new", before, batches)


def test_the_handle_cost_bench_runs_both_sides_of_a_call() -> None:
    pair = Pair()
    try:
        shared = share(torch.arange(1024, dtype=torch.float32))
        assert pair.call("consume", (shared,), shm=True) == (1024, 0.0, 1023.0)
        assert pair.call("add", (1, 2), shm=False) == 3
        assert pair.client.statistics().tensors_aliased == 1
        assert pair.engine.statistics().tensors_received_aliased == 1
        assert pair.client.statistics().leases_active == 0  # the reply ended the lease
    finally:
        pair.close()
    figures = measure(number=2, rounds=1)
    assert len(figures) == 5
    assert all(us > 0 for us in figures.values())


def test_a_torch_shared_storage_is_looked_up_once_while_it_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sending one ``share_memory_()`` tensor again costs no ``fstat`` of its file: what
    the file is stays known while the storage lives, and is forgotten with it."""
    fstats: list[int] = []
    real_fstat = os.fstat

    def counting_fstat(fd: int) -> os.stat_result:
        fstats.append(fd)
        return real_fstat(fd)

    t = torch.arange(1024, dtype=torch.float32)
    t.share_memory_()  # type: ignore[no-untyped-call]
    with TorchShmTransport() as sender:
        sender.set_peer("engine", process="engine", alias_unsealed=True)
        monkeypatch.setattr(os, "fstat", counting_fstat)
        handles = []
        for _ in range(3):
            placer = sender.placer("engine")
            placed = placer.place(t)
            assert placed is not None
            handles.append(unpack(placed[1]))
            assert placer.lease is not None
            sender.release(placer.lease)
        monkeypatch.undo()
        assert len(fstats) == 1
        assert {(h.kind, h.fd, h.dev, h.ino) for h in handles} == {
            (HandleKind.TORCH_FD, h.fd, h.dev, h.ino) for h in handles[:1]
        }
        assert len(sender._torch_files) == 1
        del t
        assert len(sender._torch_files) == 0
