"""Segments the sender freed are unmapped by the receiver (issue 20, item 4).

A receiver keeps peers' segments mapped so that a repeated handle costs no mapping; but
once the sender has freed a segment (a `tensorrpc.share` tensor gone, a pool segment
trimmed) that mapping is all that keeps the memory. The bound: a freed segment is dropped
before the receiver maps another of that peer's segments, and at its next sweep (once
per heartbeat interval through the runtime). Driven here without clocks or sockets: two
transports of this process, the sweep called by hand.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorrpc import _release
from tensorrpc.transports._shared import share
from tensorrpc.transports._shm_handle import unpack
from tensorrpc.transports._shm_pool import pid as current_pid
from tensorrpc.transports._shm_recv import PRUNE_PER_MAP
from tensorrpc.transports.torch_shm import TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)


@pytest.fixture(autouse=True)
def inline_release() -> Iterator[None]:
    """Mappings die where they are dropped (not on the release thread, a moment later),
    so that this process's maps show the receiver's decisions at once."""
    threshold, queued = _release.threshold(), _release.max_queued()
    _release.set_release_threshold(sys.maxsize)
    yield
    _release.set_release_threshold(threshold, max_queued=queued)


def _mapped_inodes() -> set[int]:
    """Inodes of the memfds this process has mapped now."""
    out = set()
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/memfd:tensorrpc"):
                out.add(int(fields[4]))
    return out


def test_freed_shared_tensors_are_unmapped_at_the_next_mapping_and_the_sweep() -> None:
    sent: set[int] = set()
    with TorchShmTransport() as client, TorchShmTransport() as engine:
        resolver = engine.resolver(None)
        for i in range(100):
            t = share(torch.full((1024,), float(i)))
            placer = client.placer("engine")
            placed = placer.place(t)
            assert placed is not None
            sent.add(unpack(placed[1]).ino)
            got = resolver.resolve(*placed, torch.float32, (1024,))
            assert float(got[0]) == i
            assert placer.lease is not None
            assert client.release(placer.lease)
            del got, t, placer, placed  # the client frees it: its memfd is closed
            # At most the segment just received stays mapped: each new mapping first
            # dropped those the client had freed.
            assert engine.statistics().mapped_segments <= 1
        assert sent & _mapped_inodes()  # the last one, until the sweep
        engine.sweep()
        stats = engine.statistics()
        assert stats.mapped_segments == 0
        assert stats.mappings_pruned == 100
        assert not sent & _mapped_inodes()


def test_a_trimmed_pool_segment_is_unmapped_at_the_sweep() -> None:
    with TorchShmTransport(pool_keep_bytes=0) as client, TorchShmTransport() as engine:
        big = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: a segment of its own
        placer = client.placer("engine")
        placed = placer.place(big)
        assert placed is not None
        ino = unpack(placed[1]).ino
        got = engine.resolver(None).resolve(*placed, torch.float32, tuple(big.shape))
        assert torch.equal(got, big)
        assert placer.lease is not None
        client.release(placer.lease)  # idle beyond keep_bytes: the client closes it
        assert client.statistics().pool_segments == 0
        assert ino in _mapped_inodes()  # the engine still maps it, until the sweep
        engine.sweep()
        assert engine.statistics().mapped_segments == 0
        # The client's page warmer holds the segment's mapping while it faults pages in
        # (a background thread): the last mapping goes once it is done.
        assert client._warmer.idle(30.0)
        assert ino not in _mapped_inodes()


def test_a_live_sender_segment_stays_mapped_and_tensors_keep_theirs() -> None:
    with TorchShmTransport() as client, TorchShmTransport() as engine:
        t = share(torch.arange(4096, dtype=torch.float32))
        placer = client.placer("engine")
        placed = placer.place(t)
        assert placed is not None
        got = engine.resolver(None).resolve(*placed, torch.float32, (4096,))
        engine.sweep()
        assert engine.statistics().mapped_segments == 1  # still open in the client
        assert placer.lease is not None
        client.release(placer.lease)
        del t, placer
        engine.sweep()
        assert engine.statistics().mapped_segments == 0
        assert torch.equal(got, torch.arange(4096, dtype=torch.float32))  # still valid


def _torch_shared(value: float) -> torch.Tensor:
    t = torch.full((4096,), value)
    t.share_memory_()  # type: ignore[no-untyped-call]
    return t


def _mappings_of(ino: int) -> int:
    """How many mappings of torch's shared file ``ino`` this process has now."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        rows = [line.split(maxsplit=5) for line in f]
    return sum(
        len(r) == 6 and r[5].startswith("/dev/shm/torch_") and int(r[4]) == ino for r in rows
    )


def test_a_torch_file_named_once_is_not_kept_mapped_and_twice_is() -> None:
    """A DataLoader batch is sent once: its mapping dies with the received tensor, so the
    sender's free is what releases its pages (a kept mapping made the receiver pay for
    freeing them later); a tensor sent again is kept mapped."""
    with TorchShmTransport() as client, TorchShmTransport() as engine:
        client.set_peer("engine", process="engine", alias_unsealed=True)
        for value in (1.0, 2.0):
            t = _torch_shared(value)  # (a new file each time, like a batch)
            for sent in (1, 2):
                placer = client.placer("engine")
                placed = placer.place(t)
                assert placed is not None
                h = unpack(placed[1])
                got = engine.resolver(None, unsealed=True).resolve(*placed, torch.float32, (4096,))
                assert engine.statistics().tensors_received_aliased == 2 * (value - 1) + sent
                assert float(got[-1]) == value
                assert engine.statistics().mapped_segments == sent - 1
                assert placer.lease is not None
                client.release(placer.lease)
                del got, placer
                # The client's own mapping, and the engine's only once kept.
                assert _mappings_of(h.ino) == sent
            del t
            engine.sweep()  # freed by the client: its kept mapping goes too
            assert engine.statistics().mapped_segments == 0


def test_a_new_mapping_checks_a_bounded_number_of_kept_ones_in_turn() -> None:
    """Before keeping a new mapping, the receiver stats only `PRUNE_PER_MAP` of the
    peer's kept ones, those checked longest ago: a new segment costs O(1), not O(kept),
    and every kept mapping is still looked at in turn (and all at each sweep)."""
    with TorchShmTransport() as client, TorchShmTransport() as engine:
        resolver = engine.resolver(None)
        held = []
        stats: list[str] = []
        real_stat = os.stat

        def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            stats.append(str(path))
            return real_stat(path, *args, **kwargs)

        for i in range(12):
            t = share(torch.full((1024,), float(i)))
            placed = client.placer("engine").place(t)
            assert placed is not None
            stats.clear()
            os.stat = counting_stat
            try:
                held.append(resolver.resolve(*placed, torch.float32, (1024,)))
            finally:
                os.stat = real_stat
            # one stat of the new file itself, at most PRUNE_PER_MAP of the kept ones
            assert len(stats) <= 1 + PRUNE_PER_MAP
        assert engine.statistics().mapped_segments == 12  # all still open in the client
        maps = engine._receiver.maps
        first = maps.oldest_checked(current_pid(), 3)
        second = maps.oldest_checked(current_pid(), 3)
        assert not {k for k, _ in first} & {k for k, _ in second}  # in turn


def test_a_torch_file_mapped_once_is_unmapped_by_the_release_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-off mapping of a large torch file (a DataLoader batch) is not unmapped
    where its tensor dies (on the engine: the event loop, before the reply) but handed
    to the release thread; small ones and kept ones are unaffected."""
    from tensorrpc.transports import _shm_pool

    _release.set_release_threshold(1 << 20)
    handed: list[tuple[object, int]] = []

    def hand(obj: object, size: int) -> bool:
        handed.append((obj, size))
        return True

    monkeypatch.setattr(_shm_pool, "later_if_large", hand)
    n = (2 << 20) // 4
    with TorchShmTransport() as client, TorchShmTransport() as engine:
        client.set_peer("engine", process="engine", alias_unsealed=True)
        t = torch.full((n,), 5.0)
        t.share_memory_()  # type: ignore[no-untyped-call]
        placed = client.placer("engine").place(t)
        assert placed is not None
        ino = unpack(placed[1]).ino
        got = engine.resolver(None, unsealed=True).resolve(*placed, torch.float32, (n,))
        assert float(got[-1]) == 5.0
        assert _mappings_of(ino) == 2  # the client's and the engine's
        del got
        assert [size for _, size in handed] == [2 << 20]
        assert _mappings_of(ino) == 2  # still mapped: the release thread's to unmap
        handed.clear()  # (what the release thread does: drop it)
        assert _mappings_of(ino) == 1
