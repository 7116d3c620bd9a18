"""One copy for fresh tensors (issue 12): the receiver builds its tensor on the sender's pool
region, which stays leased to it until the tensor is freed.

Transport level, in one process (the same process sends and receives, through
``/proc/self/fd``), except for one test that kills a real sender with ``kill -9``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading

import pytest
import torch

from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports._policy import TransportPolicy
from tensorrpc.transports._shared import shared_empty
from tensorrpc.transports._shm_handle import unpack
from tensorrpc.transports.torch_shm import TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

#: Transfers in the leak check: 2,000 in the suite (about 1.5 s here); the issue's 10,000
#: with ``TENSORRPC_ONE_COPY_CALLS=10000`` (about 8 s on the 2-core CI machine under load;
#: docs/benchmarks.md has the command and the figures).
CALLS = int(os.environ.get("TENSORRPC_ONE_COPY_CALLS", "2000"))


@pytest.fixture
def shm():
    with TorchShmTransport() as transport:
        yield transport


def _segment_bytes(shm: TorchShmTransport, handle: bytes) -> torch.Tensor:
    h = unpack(handle)
    seg = next(s for s in shm._pool.segments if s.ino == h.ino)
    return seg.view[h.base : h.base + h.span]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


# -- hold: results, released when the tensor dies ------------------------------------------


def test_the_received_tensor_is_the_region_and_holds_it_until_freed(shm):
    x = torch.arange(1 << 16, dtype=torch.float32)
    placer = shm.placer("engine")
    placed = placer.place(x)
    assert placed is not None
    lease = placer.lease
    assert lease is not None
    resolver = shm.resolver(os.getpid(), hold="engine")
    y = resolver.resolve(*placed, x.dtype, tuple(x.shape))
    assert torch.equal(x, y)
    region = _segment_bytes(shm, placed[1])
    region[:4].view(torch.float32).fill_(-5.0)  # the sender's bytes...
    assert y[0].item() == -5.0  # ...are the received tensor's: no second copy was made
    region[:4].view(torch.float32).fill_(0.0)
    assert resolver.close() == ()  # the tensor lives on the region: nothing to release
    assert shm.statistics().leases_held == 1
    view = y[10:20]
    del y
    gc.collect()
    assert shm.releasable("engine") == ()  # a view still uses the region
    assert torch.equal(view, x[10:20])
    del view
    gc.collect()
    assert shm.statistics().leases_held == 0
    assert shm.releasable("engine") == (lease,)
    assert shm.releasable("engine") == ()  # each lease once
    assert shm.release(lease, peer="engine")
    assert shm.statistics().pool_bytes_in_use == 0


def test_a_lease_is_not_released_while_its_message_is_still_being_decoded(shm):
    placer = shm.placer("engine")
    placed = [placer.place(torch.full((4096,), float(i))) for i in range(3)]
    resolver = shm.resolver(os.getpid(), hold="engine")
    for p in placed:
        assert p is not None
        resolver.resolve(*p, torch.float32, (4096,))  # dropped at once
        gc.collect()
        assert shm.releasable("engine") == ()  # the decode holds the lease
    assert resolver.close() == (placer.lease,)
    assert resolver.close() == ()


def test_a_tensor_freed_in_another_thread_releases_its_lease(shm):
    placer = shm.placer("engine")
    placed = placer.place(torch.ones(1 << 14))
    assert placed is not None
    resolver = shm.resolver(os.getpid(), hold="engine")
    box = [resolver.resolve(*placed, torch.float32, (1 << 14,))]
    assert resolver.close() == ()
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join(30)
    gc.collect()
    assert shm.releasable("engine") == (placer.lease,)


def test_a_receiver_that_never_releases_cannot_grow_the_sender_and_gets_frames(shm):
    with TorchShmTransport(peer_max_bytes=8 << 20) as sender:
        kept = []
        by_handle = 0
        for _ in range(32):
            placer = sender.placer("hoarder")
            placed = placer.place(torch.ones(1 << 18))  # 1 MiB
            if placed is None:
                continue  # the documented fallback: this tensor goes as a frame
            by_handle += 1
            resolver = shm.resolver(os.getpid(), hold="s")
            kept.append(resolver.resolve(*placed, torch.float32, (1 << 18,)))
            assert resolver.close() == ()
        stats = sender.statistics()
        assert 0 < by_handle < 8
        assert stats.peer_limited == stats.fallbacks == 32 - by_handle
        assert stats.pool_bytes_in_use <= 8 << 20
        assert stats.pool_bytes <= 16 << 20  # one segment: no growth past the cap
        assert all(bool((t == 1).all()) for t in kept)
        kept.clear()
        gc.collect()
        for lease in shm.releasable("s"):
            assert sender.release(lease, peer="hoarder")
        assert sender.statistics().pool_bytes_in_use == 0
        assert sender.placer("hoarder").place(torch.ones(1 << 18)) is not None  # room again


def test_the_policy_falls_back_to_frames_and_counts_it_when_the_peer_holds_too_much():
    policy = TransportPolicy(shm_threshold=0)
    assert policy.shm is not None
    policy.shm._budget.max_bytes = 3 << 20  # room for two 1 MiB regions (and headers)
    try:
        kept = []
        for _ in range(4):
            placer = policy.placer("torch_shm", "client", peer_receives=True)
            assert placer is not None
            kept.append(placer.place(torch.ones(1 << 18)))  # 1 MiB each
        assert sum(p is None for p in kept) == 2
        stats = policy.statistics()
        assert stats.torch_shm.fallbacks == 2
        assert stats.torch_shm_detail is not None
        assert stats.torch_shm_detail.peer_limited == 2
    finally:
        policy.close()


def test_a_shared_storage_in_many_unreleased_messages_is_charged_once():
    # 32 calls in flight passing the same 4 MiB shared tensor pin 4 MiB, not 128: each
    # goes by alias (before: the cap counted it per lease, and past 2 calls here, 16 at
    # the default cap with 64 MiB, every call fell back to frames: 190x slower).
    with TorchShmTransport(peer_max_bytes=10 << 20) as sender:
        board = shared_empty(1 << 20)  # 4 MiB
        board.fill_(1.0)
        placers = [sender.placer("client") for _ in range(32)]
        for placer in placers:
            assert placer.place(board) is not None
            assert placer.place(board[8:]) is not None  # another view: the same storage
        stats = sender.statistics()
        assert stats.peer_limited == stats.fallbacks == 0
        assert stats.tensors_aliased == 64
        # A second storage fits beside it (8 MiB of 10), a third does not.
        other = shared_empty(1 << 20)
        third = shared_empty(1 << 20)
        assert sender.placer("client").place(other) is not None
        assert sender.placer("client").place(third) is None
        assert sender.statistics().peer_limited == 1
        # Another peer has a budget of its own.
        assert sender.placer("engine-2").place(third) is not None
        # The storage stays charged until its last lease goes.
        for placer in placers[:-1]:
            assert placer.lease is not None
            assert sender.release(placer.lease, peer="client")
        assert sender.placer("client").place(third) is None
        last = placers[-1].lease
        assert last is not None
        assert sender.release(last, peer="client")
        assert sender.placer("client").place(third) is not None


def test_a_pinned_storage_is_uncharged_however_its_leases_end():
    # Released, swept (lease timeout) or dropped with its peer: the charge goes with the
    # last lease, never before, and never twice.
    now = [0.0]
    with TorchShmTransport(peer_max_bytes=6 << 20, lease_timeout=10.0, clock=lambda: now[0]) as s:
        a, b = shared_empty(1 << 20), shared_empty(1 << 20)  # 4 MiB each

        def fits(t: torch.Tensor) -> bool:
            return s.placer("peer").place(t) is not None

        assert fits(a)
        assert fits(a)
        assert not fits(b)
        now[0] = 11.0
        assert s.sweep() == 2
        assert fits(b)
        assert not fits(a)
        assert s.release_peer("peer") == 1  # b's (a refused placement makes no lease)
        assert fits(a)
        assert fits(a)


# -- RELEASE: only the peer's own leases, once --------------------------------------------


def test_bad_releases_are_refused_counted_and_free_nothing(shm):
    x = torch.arange(1 << 14, dtype=torch.float32)
    placer = shm.placer("client-a")
    placed = placer.place(x)
    assert placed is not None
    lease = placer.lease
    assert lease is not None
    y = shm.resolver(os.getpid(), hold="a").resolve(*placed, x.dtype, tuple(x.shape))
    in_use = shm.statistics().pool_bytes_in_use
    assert not shm.release(lease + 1000, peer="client-a")  # never leased
    assert not shm.release(lease, peer="client-b")  # another peer's
    stats = shm.statistics()
    assert stats.releases_refused == 2
    assert stats.pool_bytes_in_use == in_use
    assert stats.leases_active == 1
    # Nothing was freed early: a new tensor cannot land on the held region.
    other = shm.placer("client-a").place(torch.full((1 << 14,), -1.0))
    assert other is not None
    assert unpack(other[1]).base != unpack(placed[1]).base or (
        unpack(other[1]).ino != unpack(placed[1]).ino
    )
    assert torch.equal(y, x)
    assert shm.release(lease, peer="client-a")
    assert not shm.release(lease, peer="client-a")  # twice
    assert shm.statistics().releases_refused == 3


# -- keep: arguments, detached before the first reply --------------------------------------


def test_detach_gives_live_tensors_pages_of_their_own_before_the_region_is_reused(shm):
    x = torch.arange(3000, dtype=torch.float64)
    placer = shm.placer("client")
    placed = placer.place(x)
    assert placed is not None
    lease = placer.lease
    assert lease is not None
    resolver = shm.resolver(os.getpid(), keep=("client", 7))
    kept = resolver.resolve(*placed, x.dtype, (3000,))
    dead = resolver.resolve(*placed, x.dtype, (3000,))
    del dead
    gc.collect()
    assert shm.detach(("client", 7)) == 1  # only the live tensor is copied
    assert shm.detach(("client", 7)) == 0
    assert shm.release(lease)
    again = shm.placer("client").place(torch.full((3000,), -1.0, dtype=torch.float64))
    assert again is not None
    assert unpack(again[1]).base == unpack(placed[1]).base  # the same region, rewritten
    assert torch.equal(kept, x)  # private pages: the sender's new bytes do not show
    fresh = shm.resolver(os.getpid()).resolve(*again, torch.float64, (3000,))
    assert bool((fresh == -1.0).all())  # later resolves see the shared pages again


def test_a_peer_gone_detaches_its_messages_and_releases_nothing_more(shm):
    placer = shm.placer("client")
    placed = placer.place(torch.arange(5000, dtype=torch.float32))
    assert placed is not None
    arg = shm.resolver(os.getpid(), keep=("client", 1)).resolve(*placed, torch.float32, (5000,))
    res = shm.resolver(os.getpid(), hold="client").resolve(*placed, torch.float32, (5000,))
    assert shm.forget_holds("client") == 1  # the argument got pages of its own
    assert shm.statistics().leases_held == 0
    del res
    gc.collect()
    assert shm.releasable("client") == ()  # nothing is released to a peer that is gone
    assert shm.release(placer.lease)
    _segment_bytes(shm, placed[1]).fill_(0)
    assert torch.equal(arg, torch.arange(5000, dtype=torch.float32))


def test_the_mode_of_a_resolver_is_one_of_hold_or_keep(shm):
    with pytest.raises(ValueError, match="exclusive"):
        shm.resolver(os.getpid(), hold="a", keep=("a", 1))


def test_a_released_region_is_refused_not_read(shm):
    placer = shm.placer("engine")
    placed = placer.place(torch.ones(4096))
    assert placed is not None
    assert shm.release(placer.lease)
    with pytest.raises(TensorTransportError, match="no longer holds"):
        shm.resolver(os.getpid(), hold="engine").resolve(*placed, torch.float32, (4096,))


# -- kill -9 of the sender ------------------------------------------------------------------


def _forked_sender(tensors: list[torch.Tensor]) -> tuple[int, list[bytes]]:
    """Fork a sender that places ``tensors`` (the first from its pool, the second from
    tensorrpc shared memory), reports the handles and waits to be killed."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(rfd)
            shm = TorchShmTransport()
            # No torch kernel in a forked child (its thread pool does not survive fork):
            # fill the shared tensor with one memmove.
            shared = shared_empty(tensors[1].shape, dtype=tensors[1].dtype)
            ctypes.memmove(shared.data_ptr(), tensors[1].data_ptr(), tensors[1].nbytes)
            placer = shm.placer("parent")
            handles = [placer.place(tensors[0]), placer.place(shared)]
            os.write(wfd, b"".join(h[1].hex().encode() + b"\n" for h in handles if h))
            while True:  # until the parent's SIGKILL
                signal.pause()
        finally:
            os._exit(0)
    os.close(wfd)
    data = b""
    with os.fdopen(rfd, "rb") as r:
        while data.count(b"\n") < 2:
            chunk = r.read1(4096)
            assert chunk, "the forked sender died"
            data += chunk
    return pid, [bytes.fromhex(line.decode()) for line in data.split()]


def test_tensors_on_a_killed_senders_regions_stay_valid():
    want = [torch.arange(1 << 16, dtype=torch.int32), torch.arange(1 << 16, dtype=torch.int32) * 3]
    pid, handles = _forked_sender(want)
    try:
        with TorchShmTransport() as shm:
            held = shm.resolver(pid, hold="sender")
            kept = shm.resolver(pid, keep=("sender", 1))
            a = held.resolve("torch_shm", handles[0], torch.int32, (1 << 16,))
            b = kept.resolve("torch_shm", handles[0], torch.int32, (1 << 16,))
            c = held.resolve("torch_shm", handles[1], torch.int32, (1 << 16,))
            sender, pid = pid, 0
            os.kill(sender, signal.SIGKILL)
            assert os.waitpid(sender, 0)[0] == sender
            # The mappings keep the memory alive: the tensors keep their values.
            assert torch.equal(a, want[0])
            assert torch.equal(b, want[0])
            assert torch.equal(c, want[1])
            a.add_(1)  # still writable, still ours (b is on the same region)
            assert torch.equal(b, want[0] + 1)
            assert shm.forget_holds("sender") == 1  # b gets pages of its own
            # Its shared block (the pool segment's mapping was dropped by the detach; the
            # tensors on it keep it mapped).
            assert shm.forget_peer(sender) == 1
            assert shm.statistics().mapped_segments == 0
            assert torch.equal(c, want[1])
            assert torch.equal(b, want[0] + 1)  # its private pages hold the same values
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


# -- 10,000 transfers keeping every 10th tensor: fds, mappings, RSS flat -------------------


def test_many_one_copy_transfers_keeping_every_10th_leave_fds_maps_and_rss_flat(shm):
    kept: list[torch.Tensor] = []

    def run(n: int) -> None:
        for i in range(n):
            placer = shm.placer("peer")
            placed = placer.place(torch.full((1 << 12,), float(i)))  # 16 KiB
            assert placed is not None
            resolver = shm.resolver(os.getpid(), hold="peer")
            t = resolver.resolve(*placed, torch.float32, (1 << 12,))
            if i % 10 == 0:
                kept.append(t)  # the receiver keeps it (bounded below: the last 50)
                del kept[:-50]
            del t
            for lease in resolver.close():
                assert shm.release(lease, peer="peer")

    run(500)  # warm up: segments, mappings and allocator pools come into being
    gc.collect()
    fds, maps, rss = len(os.listdir("/proc/self/fd")), _maps(), _rss()
    before = shm.statistics()
    run(CALLS)
    gc.collect()
    for lease in shm.releasable("peer"):
        assert shm.release(lease, peer="peer")
    after = shm.statistics()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert _maps() <= maps + 2
    assert (after.mapped_segments, after.pool_segments) == (
        before.mapped_segments,
        before.pool_segments,
    )
    assert after.leases_held == len(kept) == 50
    assert after.leases_active == 50
    assert after.pool_bytes_in_use == before.pool_bytes_in_use
    assert _rss() - rss < 16 << 20
    kept.clear()
    gc.collect()
    for lease in shm.releasable("peer"):
        assert shm.release(lease, peer="peer")
    assert shm.statistics().leases_active == shm.statistics().leases_held == 0
