"""The torch_shm tensor transport: round trips between independent processes, aliasing,
lifetimes, leak counts (normal exit and ``kill -9`` of either side) and forged handles."""

from __future__ import annotations

import gc
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp

from bench._measure import shm_files_of, shm_names_of
from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports import TensorPlacer, TensorResolver
from tensorrpc.transports._shared import share
from tensorrpc.transports._shm_handle import Handle, pack, unpack
from tensorrpc.transports._shm_pool import Segment
from tensorrpc.transports.torch_shm import TRANSPORT_NAME, HandleKind, TorchShmTransport
from tests import _forkserver

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("_shm_peer.py")
TIMEOUT = 60.0

DTYPES = [
    name
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "complex32",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
]


class Peer:
    """One ``_shm_peer.py`` process, driven by JSON lines with bounded waits."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = _forkserver.popen(
            [sys.executable, str(PEER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        self.pid = self.proc.pid
        self._buf = b""

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        self.proc.stdin.flush()
        return self._readline()

    def _readline(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + TIMEOUT
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                raise TimeoutError(f"peer {self.pid} did not answer in {TIMEOUT} s")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError(f"peer {self.pid} exited with {self.proc.wait(TIMEOUT)}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        reply: dict[str, Any] = json.loads(line)
        assert reply["ok"], reply
        return reply

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(TIMEOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("exit")
            except (OSError, EOFError, TimeoutError):
                self.proc.kill()
        try:
            self.proc.wait(TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(TIMEOUT)
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture(scope="module")
def pair():
    """Two peers started independently of each other (siblings, no shared queue)."""
    a, b = Peer(), Peer()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture
def spare():
    """A third peer for tests that kill or close one side."""
    peers: list[Peer] = []

    def start() -> Peer:
        peers.append(Peer())
        return peers[-1]

    yield start
    for p in peers:
        p.stop()


def transfer(
    src: Peer, dst: Peer, specs: list[dict[str, Any]], *, keep: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    placed = src.request("place", specs=specs, peer=dst.pid)
    items = [
        {
            "handle": h,
            "dtype": s["dtype"],
            "shape": s["shape"],
            **({"keep": s["keep"]} if keep and s.get("keep") else {}),
        }
        for s, h in zip(specs, placed["handles"], strict=True)
    ]
    assert None not in placed["handles"]
    got = dst.request("resolve", items=items, peer_pid=src.pid)
    return placed, got


def wait_for(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling an external condition (a dead process's files), bounded


# -- between two independently started processes ---------------------------------------


LAYOUTS = {
    "contiguous": ("contig", [3, 5]),
    "zero_dim": ("contig", []),
    "strided": ("strided", [4, 3]),
    "transposed": ("transposed", [3, 7]),
    "storage_offset": ("offset", [2, 3]),
    "large": ("contig", [257, 129]),
}


@pytest.mark.parametrize("shared", [None, "file_descriptor", "file_system", "tensorrpc"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_dtype_and_layout_round_trips_between_independent_processes(pair, layout, shared):
    a, b = pair
    kind, shape = LAYOUTS[layout]
    specs = [
        {"dtype": d, "shape": shape, "layout": kind, "seed": i, "shared": shared}
        for i, d in enumerate(DTYPES)
    ]
    placed, got = transfer(a, b, specs)
    assert got["errors"] == []
    assert got["digests"] == placed["digests"]
    assert got["leases"] == [placed["lease"]]
    assert a.request("release", leases=[placed["lease"]])["released"] == [True]


def test_empty_tensors_round_trip(pair):
    a, b = pair
    specs = [{"dtype": d, "shape": [0, 3], "seed": 1} for d in ("float32", "bfloat16", "bool")]
    placed, got = transfer(a, b, specs)
    assert got["digests"] == placed["digests"]
    a.request("release", leases=[placed["lease"]])


def test_tensor_in_tensorrpc_shared_memory_aliases_without_copy(pair):
    a, b = pair
    before = a.request("stats")["stats"]
    spec = {"dtype": "float32", "shape": [64, 64], "shared": "tensorrpc", "keep": "x"}
    placed, got = transfer(a, b, [spec], keep=True)
    after = a.request("stats")["stats"]
    assert after["tensors_aliased"] == before["tensors_aliased"] + 1
    assert after["pool_bytes_in_use"] == before["pool_bytes_in_use"]
    assert got["digests"] == placed["digests"]
    a.request("fill", name="x", value=7.0)
    seen_by_b = b.request("read", name="x")["digest"]
    assert seen_by_b == a.request("read", name="x")["digest"]
    assert seen_by_b != placed["digests"][0]
    b.request("fill", name="x", value=-1.0)
    assert a.request("read", name="x")["digest"] == b.request("read", name="x")["digest"]
    a.request("release", leases=[placed["lease"]])
    a.request("drop", names=["x"])
    b.request("drop", names=["x"])


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_torch_shared_tensor_is_copied_through_the_sealed_pool(pair, strategy):
    # torch's shared files can be ftruncate()d by their owner at any time (SIGBUS in a
    # receiver that maps them), so torch_shm never maps them: it copies them like any
    # other tensor, and the receiver's tensor is private.
    a, b = pair
    before = a.request("stats")["stats"]
    spec = {"dtype": "float32", "shape": [64, 64], "shared": strategy, "keep": "x"}
    placed, got = transfer(a, b, [spec], keep=True)
    after = a.request("stats")["stats"]
    assert after["tensors_aliased"] == before["tensors_aliased"]
    assert got["digests"] == placed["digests"]
    a.request("fill", name="x", value=7.0)
    assert b.request("read", name="x")["digest"] == placed["digests"][0]
    if strategy == "file_system":
        # torch's file, named after its maker, while the sender keeps the tensor: what the
        # leak checks look for (shm_files_of) is what torch really makes.
        assert shm_files_of([a.pid]) != set()
    a.request("release", leases=[placed["lease"]])
    a.request("drop", names=["x"])
    b.request("drop", names=["x"])


def test_shm_leak_checks_see_their_own_processes_files_and_ours_only():
    names = [
        "torch_1234_99_0",  # torch's, made by process 1234
        "torch_12345_99_0",  # another process whose pid starts the same
        "tensorrpc-1",  # tensorrpc names nothing here: a bug, whoever made it
        "psm_abc",  # another program's
        "sem.mp-xyz",
    ]
    assert shm_names_of(names, [1234]) == {"torch_1234_99_0", "tensorrpc-1"}
    assert shm_names_of(names, [12345, 7]) == {"torch_12345_99_0", "tensorrpc-1"}
    assert shm_names_of(names[2:], []) == {"tensorrpc-1"}


@pytest.mark.parametrize("shared", [None, "file_descriptor", "tensorrpc"])
def test_received_tensor_outlives_every_sender_reference(pair, shared):
    a, b = pair
    spec = {"dtype": "int32", "shape": [1000], "seed": 5, "shared": shared, "keep": "y"}
    placed, _ = transfer(a, b, [spec], keep=True)
    a.request("release", leases=[placed["lease"]])
    a.request("drop", names=["y"])
    assert b.request("read", name="y")["digest"] == placed["digests"][0]
    b.request("drop", names=["y"])


def test_fresh_tensor_copy_is_private_to_the_receiver(pair):
    a, b = pair
    spec = {"dtype": "float64", "shape": [100], "seed": 3, "keep": "z"}
    placed, _ = transfer(a, b, [spec], keep=True)
    a.request("fill", name="z", value=1.5)
    assert b.request("read", name="z")["digest"] == placed["digests"][0]
    a.request("release", leases=[placed["lease"]])
    a.request("drop", names=["z"])
    b.request("drop", names=["z"])


def test_handles_from_another_pid_are_refused(pair):
    a, b = pair
    placed = a.request("place", specs=[{"dtype": "float32", "shape": [1024]}], peer=b.pid)
    item = {"handle": placed["handles"][0], "dtype": "float32", "shape": [1024]}
    got = b.request("resolve", items=[item], peer_pid=a.pid + 100_000)
    assert got["digests"] == [None]
    # The one fixed error of a handle its connection's process does not own.
    assert NO_ATTACH in got["errors"][0]
    a.request("release", leases=[placed["lease"]])


def test_two_thousand_transfers_leak_no_fd_and_nothing_in_dev_shm(pair):
    """2,000 transfers in 20 identical batches (sizes, shared ones, release at the end).

    Each batch leaves the pool in the state the one before left it, so a leak of one
    descriptor, segment or lease per transfer or per batch shows (the checks are exact,
    not thresholds) long before the 20th; 10,000 took 5 times as long for nothing more.
    """
    a, b = pair
    sizes = [256, 1024, 4096, 16384, 65536]

    def batch(i: int) -> None:
        specs = [
            {
                "dtype": "float32",
                "shape": [sizes[j % len(sizes)]],
                "seed": j,
                "shared": "tensorrpc" if j % 10 == 0 else None,
            }
            for j in range(i * 100, i * 100 + 100)
        ]
        placed, got = transfer(a, b, specs)
        assert got["digests"] == placed["digests"]
        assert a.request("release", leases=got["leases"])["released"] == [True]

    batch(0)  # warm up: the peer's pool segments and b's mappings of them
    fds_a, fds_b = a.request("fds")["fds"], b.request("fds")["fds"]
    segments = a.request("stats")["stats"]["pool_segments"]
    for i in range(1, 20):
        batch(i)
    assert a.request("fds")["fds"] == fds_a
    assert b.request("fds")["fds"] == fds_b
    # Other processes on this host (other test workers) may come and go in /dev/shm;
    # none of ours may be there.
    assert shm_files_of([a.pid, b.pid]) == set()
    stats = a.request("stats")["stats"]
    assert stats["leases_active"] == 0
    assert stats["pool_segments"] == segments
    assert stats["tensors_sent"] >= 2_000


def test_normal_shutdown_returns_every_fd_and_leaves_nothing(spare):
    a, b = spare(), spare()
    specs = [
        {"dtype": "float32", "shape": [4096], "seed": 1},
        {"dtype": "float32", "shape": [4096], "seed": 2, "shared": "file_descriptor"},
        {"dtype": "float32", "shape": [4096], "seed": 3, "shared": "file_system"},
        {"dtype": "float32", "shape": [4096], "seed": 4, "shared": "tensorrpc"},
    ]
    for _ in range(3):
        placed, got = transfer(a, b, specs)
        assert got["digests"] == placed["digests"]
    for p in (a, b):
        closed = p.request("close")
        assert closed["targets"] == closed["baseline_targets"]
        assert closed["fds"] == closed["baseline"]
    a.stop()
    b.stop()
    assert a.proc.returncode == 0
    assert b.proc.returncode == 0
    wait_for(lambda: shm_files_of([a.pid, b.pid]) == set(), "torch to clean /dev/shm")


def test_kill_9_of_the_sender_leaves_receiver_tensors_valid_and_nothing_behind(pair, spare):
    _, b = pair
    sender = spare()
    fds_b = b.request("fds")["fds"]
    specs = [
        {"dtype": "float32", "shape": [2048], "seed": 1, "keep": "k1"},
        {"dtype": "float32", "shape": [2048], "seed": 2, "shared": "file_descriptor", "keep": "k2"},
        {"dtype": "float32", "shape": [2048], "seed": 3, "shared": "tensorrpc", "keep": "k3"},
    ]
    placed, got = transfer(sender, b, specs, keep=True)
    assert got["digests"] == placed["digests"]
    # Not released: the sender dies holding its leases.
    sender.kill()
    for name, want in zip(("k1", "k2", "k3"), placed["digests"], strict=True):
        assert b.request("read", name=name)["digest"] == want
    assert b.request("forget_peer", pid=sender.pid)["forgotten"] == 2  # pool + shared
    b.request("drop", names=["k1", "k2", "k3"])
    assert b.request("fds")["fds"] == fds_b
    wait_for(lambda: shm_files_of([sender.pid]) == set(), "torch to clean the dead sender's files")


def test_kill_9_of_the_receiver_lets_the_sender_reclaim_everything(pair, spare):
    a, _ = pair
    receiver = spare()
    fds_a = a.request("fds")["fds"]
    stats_before = a.request("stats")["stats"]
    specs = [
        {"dtype": "float32", "shape": [8192], "seed": i, "shared": s}
        for i, s in enumerate([None, None, "file_descriptor", "tensorrpc"])
    ]
    placed, got = transfer(a, receiver, specs)
    assert got["digests"] == placed["digests"]
    receiver.kill()
    assert a.request("release_peer", peer=receiver.pid)["released"] == 1
    stats = a.request("stats")["stats"]
    assert stats["leases_active"] == stats_before["leases_active"]
    assert stats["pool_bytes_in_use"] == stats_before["pool_bytes_in_use"]
    assert a.request("fds")["fds"] == fds_a
    assert shm_files_of([receiver.pid]) == set()


def test_forged_handle_naming_another_processes_file_is_refused(pair, tmp_path):
    a, _ = pair
    path = tmp_path / "secret.bin"
    path.write_bytes(b"x" * 8192)
    fd = a.request("open_file", path=str(path))["fd"]
    st = os.stat(path)
    with TorchShmTransport() as shm:
        for kind in (HandleKind.POOL, HandleKind.SHARED):
            forged = _forge(
                kind,
                pid=a.pid,
                fd=fd,
                dev=st.st_dev,
                ino=st.st_ino,
                base=64 * (kind == HandleKind.POOL),
            )
            with pytest.raises(TensorTransportError, match=NO_ATTACH) as info:
                shm.resolver(a.pid).resolve(TRANSPORT_NAME, forged, torch.uint8, (1024,))
            assert "secret" not in str(info.value)
            assert str(tmp_path) not in str(info.value)
        forged = _forge(HandleKind.TORCH_FD, pid=a.pid, fd=0, dev=st.st_dev, ino=st.st_ino)
        with pytest.raises(TensorTransportError, match="not accepted"):
            shm.resolver(a.pid).resolve(TRANSPORT_NAME, forged, torch.uint8, (1024,))


# -- in this process --------------------------------------------------------------------


@pytest.fixture
def shm():
    with TorchShmTransport() as transport:
        yield transport


NO_ATTACH = "cannot attach to the handle"


def _forge(kind: HandleKind, **fields: Any) -> bytes:
    values: dict[str, Any] = {
        "kind": kind,
        "pid": os.getpid(),
        "fd": 3,
        "dev": 0,
        "ino": 0,
        "lease": 1,
        "tag": 1,
        "base": 64,
        "span": 1024,
        "elem_offset": 0,
        "strides": (1,),
        "tail": b"",
    }
    values.update(fields)
    return pack(Handle(**values))


def _valid_pool_handle(shm: TorchShmTransport, n: int = 1024) -> tuple[bytes, torch.Tensor]:
    src = torch.arange(n, dtype=torch.uint8)
    placed = shm.placer("p").place(src)
    assert placed is not None
    return placed[1], src


def test_placer_and_resolver_fit_the_codec_protocols(shm):
    placer: TensorPlacer = shm.placer("peer")
    resolver: TensorResolver = shm.resolver(os.getpid())
    t = torch.randn(300, 7)
    placed = placer.place(t)
    assert placed is not None
    assert placed[0] == TRANSPORT_NAME
    assert torch.equal(resolver.resolve(*placed, t.dtype, tuple(t.shape)), t)


def test_codec_round_trip_by_handle(shm):
    from tensorrpc._codec import decode, encode

    value: dict[str, Any] = {
        "a": torch.randn(64, 64),
        "b": [torch.arange(10_000), torch.ones(3, 200)[:, ::3]],
    }
    placer = shm.placer("peer")
    enc = encode(value, placer=placer)
    assert enc.buffers == []
    resolver = shm.resolver(os.getpid())
    out: Any = decode(enc.payload, enc.buffers, resolver=resolver)
    assert torch.equal(out["a"], value["a"])
    assert torch.equal(out["b"][0], value["b"][0])
    assert torch.equal(out["b"][1], value["b"][1])
    assert resolver.leases == (placer.lease,)
    assert shm.release(placer.lease)


def test_caller_tensor_and_process_settings_are_never_changed(shm):
    strategy = tmp.get_sharing_strategy()  # type: ignore[no-untyped-call]
    plain = torch.randn(512, 8)
    shared = torch.randn(512, 8).share_memory_()  # type: ignore[no-untyped-call]
    ptrs = (plain.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr())
    copies = (plain.clone(), shared.clone())
    placer = shm.placer("peer")
    assert placer.place(plain) is not None
    assert placer.place(shared) is not None
    assert not plain.is_shared()  # type: ignore[no-untyped-call]
    assert (plain.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()) == ptrs
    assert torch.equal(plain, copies[0])
    assert torch.equal(shared, copies[1])
    assert tmp.get_sharing_strategy() == strategy  # type: ignore[no-untyped-call]


def test_lease_keeps_memory_until_released_then_stale_handle_fails(shm):
    placer = shm.placer("peer")
    fresh = torch.randn(4096)
    shared = torch.randn(4096).share_memory_()  # type: ignore[no-untyped-call]
    want = (fresh.clone(), shared.clone())
    h1 = placer.place(fresh)
    h2 = placer.place(shared)
    assert h1 is not None
    assert h2 is not None
    del fresh, shared
    gc.collect()
    resolver = shm.resolver(os.getpid())
    assert torch.equal(resolver.resolve(*h1, torch.float32, (4096,)), want[0])
    assert torch.equal(resolver.resolve(*h2, torch.float32, (4096,)), want[1])
    assert shm.statistics().leases_active == 1
    lease = placer.lease
    assert lease is not None
    assert not shm.release(lease, peer="someone else")
    assert shm.release(lease, peer="peer")
    assert not shm.release(lease)
    with pytest.raises(TensorTransportError, match="no longer holds"):
        resolver.resolve(*h1, torch.float32, (4096,))
    shm.placer("peer").place(torch.zeros(4096))  # reuses the region
    with pytest.raises(TensorTransportError, match="no longer holds"):
        resolver.resolve(*h1, torch.float32, (4096,))


def test_sweep_drops_old_leases_and_release_peer_drops_a_dead_peers():
    now = [100.0]
    with TorchShmTransport(lease_timeout=10.0, clock=lambda: now[0]) as shm:
        p1, p2 = shm.placer("x"), shm.placer("y")
        assert p1.place(torch.randn(1000)) is not None
        now[0] += 5
        assert p2.place(torch.randn(1000)) is not None
        assert shm.sweep() == 0
        now[0] += 6
        assert shm.sweep() == 1
        assert shm.statistics().leases_active == 1
        assert shm.release_peer("y") == 1
        assert shm.release_peer("y") == 0
        stats = shm.statistics()
        assert (stats.leases_active, stats.leases_expired, stats.pool_bytes_in_use) == (0, 2, 0)


def test_abort_releases_a_message_that_was_never_sent(shm):
    placer = shm.placer("peer")
    assert placer.lease is None
    placer.place(torch.randn(1000))
    placer.abort()
    assert shm.statistics().leases_active == 0


def test_pool_segments_are_reused(shm):
    resolver = shm.resolver(os.getpid())
    for i in range(200):
        placer = shm.placer("peer")
        t = torch.full((1 << 18,), float(i))
        placed = placer.place(t)
        assert placed is not None
        assert torch.equal(resolver.resolve(*placed, t.dtype, (1 << 18,)), t)
        assert placer.lease is not None
        shm.release(placer.lease)
    stats = shm.statistics()
    assert (stats.pool_segments, stats.mapped_segments, stats.tensors_sent) == (1, 1, 200)


def test_large_received_buffers_are_recycled(shm):
    resolver = shm.resolver(os.getpid())
    ptrs = []
    for _ in range(3):
        t = torch.randn(1 << 19)
        placer = shm.placer("peer")
        placed = placer.place(t)
        assert placed is not None
        out = resolver.resolve(*placed, t.dtype, tuple(t.shape))
        assert torch.equal(out, t)
        out.add_(1)  # received tensors are ordinary writable tensors
        ptrs.append(out.data_ptr())
        del out
        assert placer.lease is not None
        shm.release(placer.lease)
    assert ptrs[0] == ptrs[1] == ptrs[2]


def test_concurrent_placers_and_resolvers_in_threads(shm):
    resolver = shm.resolver(os.getpid())
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(100):
                t = torch.full((1000 + seed,), float(seed * 1000 + i))
                placer = shm.placer(seed)
                placed = placer.place(t)
                assert placed is not None
                assert torch.equal(resolver.resolve(*placed, t.dtype, tuple(t.shape)), t)
                assert placer.lease is not None
                assert shm.release(placer.lease, peer=seed)
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert errors == []
    stats = shm.statistics()
    assert (stats.tensors_sent, stats.leases_active, stats.pool_bytes_in_use) == (400, 0, 0)


def test_segment_free_list_coalesces_back_to_one_block():
    rng = random.Random(7)
    seg = Segment("tensorrpc-test-0", 1 << 20)
    try:
        taken: list[tuple[int, int]] = []
        for _ in range(2000):
            if taken and rng.random() < 0.5:
                off, n = taken.pop(rng.randrange(len(taken)))
                seg.release(off, n)
            else:
                n = 64 * rng.randint(1, 64)
                got = seg.alloc(n)
                if got is not None:
                    assert all(got + n <= o or o + m <= got for o, m in taken)
                    taken.append((got, n))
        for off, n in taken:
            seg.release(off, n)
        assert seg.free == [[0, 1 << 20]]
        assert seg.used == 0
    finally:
        seg.close()


def test_tensors_it_cannot_place_fall_back_and_are_counted():
    with TorchShmTransport(pool_max_bytes=16 << 20, segment_bytes=1 << 20) as shm:
        placer = shm.placer("peer")
        assert placer.place(torch.zeros(64 << 20, dtype=torch.uint8)) is None
        assert placer.place(torch.eye(3).to_sparse()) is None
        assert placer.place(torch.empty(3, device="meta")) is None
        shm.disable_peer("bad")
        assert shm.placer("bad").place(torch.zeros(100)) is None
        shm.record_fallback(2)
        stats = shm.statistics()
        assert stats.fallbacks == 6
        assert stats.tensors_sent == 0


def test_closed_transport_refuses_work():
    shm = TorchShmTransport()
    handle, _ = _valid_pool_handle(shm)
    resolver = shm.resolver(os.getpid())
    shm.close()
    shm.close()
    with pytest.raises(TensorTransportError, match="closed"):
        shm.placer("p")
    with pytest.raises(TensorTransportError, match="closed"):
        resolver.resolve(TRANSPORT_NAME, handle, torch.uint8, (1024,))


# -- forged handles ---------------------------------------------------------------------


def _resolve(shm: TorchShmTransport, handle: bytes, shape: tuple[int, ...] = (1024,)) -> Any:
    return shm.resolver(os.getpid()).resolve(TRANSPORT_NAME, handle, torch.uint8, shape)


def test_forged_handle_to_a_regular_file_is_refused(shm, tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(8192))
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        for kind in (HandleKind.POOL, HandleKind.SHARED):
            forged = _forge(
                kind,
                fd=f.fileno(),
                dev=st.st_dev,
                ino=st.st_ino,
                base=64 * (kind == HandleKind.POOL),
            )
            with pytest.raises(TensorTransportError, match=NO_ATTACH):
                _resolve(shm, forged)


def test_forged_handle_to_etc_passwd_is_refused(shm):
    fd = os.open("/etc/passwd", os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        forged = _forge(HandleKind.POOL, fd=fd, dev=st.st_dev, ino=st.st_ino, span=16)
        with pytest.raises(TensorTransportError, match=NO_ATTACH) as info:
            _resolve(shm, forged, (16,))
        assert "passwd" not in str(info.value)
        name = b"/../../etc/passwd"
        forged = _forge(HandleKind.TORCH_FILE, tail=name, span=16, base=0)
        with pytest.raises(TensorTransportError, match="not accepted"):
            _resolve(shm, forged, (16,))
    finally:
        os.close(fd)


def test_forged_handle_to_a_pipe_or_socket_is_refused(shm):
    r, w = os.pipe()
    s1, s2 = socket.socketpair()
    try:
        for fd in (r, w, s1.fileno()):
            forged = _forge(HandleKind.POOL, fd=fd)
            with pytest.raises(TensorTransportError, match=NO_ATTACH):
                _resolve(shm, forged)
    finally:
        for fd in (r, w):
            os.close(fd)
        s1.close()
        s2.close()


def test_forged_handle_to_a_memfd_not_made_by_tensorrpc_is_refused(shm):
    for name in ("evil", "tensorrpc-1-1", "tensorrpc-shared-1-1"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 1 << 16)
            st = os.fstat(fd)
            for kind in (HandleKind.POOL, HandleKind.SHARED):
                forged = _forge(
                    kind, fd=fd, dev=st.st_dev, ino=st.st_ino, base=64 * (kind == HandleKind.POOL)
                )
                with pytest.raises(TensorTransportError, match=rf"{NO_ATTACH}|not sealed"):
                    _resolve(shm, forged)
        finally:
            os.close(fd)


def test_handles_naming_torch_shared_files_are_refused_whatever_they_name(shm):
    # Named like torch's files, after this process (not "tensorrpc...": the leak checks of
    # tests running beside this one would take it for a file of ours, see shm_files_of).
    stem = f"torch_{os.getpid()}_forged_{uuid.uuid4().hex}"
    plain = Path("/dev/shm") / stem
    plain.write_bytes(bytes(8192))
    shared = torch.zeros(1024, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    fd = shared.untyped_storage()._get_shared_fd()
    try:
        st = plain.stat()
        for kind, tail in (
            (HandleKind.TORCH_FILE, f"/{stem}".encode()),
            (HandleKind.TORCH_FD, b""),
        ):
            forged = _forge(kind, dev=st.st_dev, ino=st.st_ino, base=0, tail=tail, fd=fd)
            with pytest.raises(TensorTransportError, match="not accepted"):
                _resolve(shm, forged)
    finally:
        plain.unlink()


def test_forged_handle_to_a_genuine_segment_with_wrong_identity_is_refused(shm):
    handle, _ = _valid_pool_handle(shm)
    h = unpack(handle)
    cases = {
        "inode": {"ino": h.ino + 1},
        "device": {"dev": h.dev + 1},
        "pid": {"pid": os.getpid() + 1},
        "no such": {"pid": 2**31 - 2},
        "tag": {"tag": h.tag ^ 1},
    }
    for _what, change in cases.items():
        fields = {**_fields(h), **change}
        with pytest.raises(TensorTransportError):
            _resolve(shm, pack(Handle(**fields)))


def _fields(h: Handle) -> dict[str, Any]:
    return {name: getattr(h, name) for name in Handle.__slots__}


@pytest.mark.parametrize(
    ("change", "shape"),
    [
        ({"fd": -1}, (1024,)),
        ({"fd": 2**31 - 1}, (1024,)),
        ({"span": 1 << 40}, (1024,)),
        ({"span": 1 << 50}, (1024,)),
        ({"span": 0}, (1024,)),
        ({"base": 3}, (1024,)),
        ({"base": 1 << 45}, (1024,)),
        ({"elem_offset": 1}, (1024,)),
        ({"elem_offset": -5}, (1024,)),
        ({"strides": (2,)}, (1024,)),
        ({"strides": (-1,)}, (1024,)),
        ({"strides": (1, 1)}, (1024,)),
        ({}, (2048,)),
        ({}, (4, 256)),
        ({"kind": HandleKind.EMPTY}, (1024,)),
        ({"tail": b"junk"}, (1024,)),
    ],
)
def test_forged_handle_with_out_of_range_fields_is_refused(shm, change, shape):
    handle, _ = _valid_pool_handle(shm)
    fields = _fields(unpack(handle))
    fields.update(change)
    with pytest.raises(TensorTransportError):
        _resolve(shm, pack(Handle(**fields)), shape)


def test_forged_shared_handle_with_out_of_range_fields_is_refused(shm):
    shared = share(torch.arange(1024, dtype=torch.uint8))
    placed = shm.placer("p").place(shared)
    assert placed is not None
    fields = _fields(unpack(placed[1]))
    assert fields["kind"] == HandleKind.SHARED
    for change in ({"elem_offset": 3073}, {"span": 8192}, {"base": 64}, {"tail": b"x"}):
        with pytest.raises(TensorTransportError):
            _resolve(shm, pack(Handle(**{**fields, **change})))
    assert torch.equal(_resolve(shm, placed[1]), shared)


@pytest.mark.parametrize(
    "handle",
    [
        b"",
        b"TRSH",
        b"XXXX" + bytes(100),
        struct.pack("<4sB", b"TRSH", 9) + bytes(100),
        bytes(5000),
        "not bytes",
    ],
)
def test_malformed_handles_are_refused(shm, handle):
    with pytest.raises(TensorTransportError):
        _resolve(shm, handle)


def test_malformed_kind_ndim_and_transport_are_refused(shm):
    good, _ = _valid_pool_handle(shm)
    bad_kind = good[:5] + bytes([77]) + good[6:]
    bad_ndim = good[:6] + struct.pack("<H", 65) + good[8:]
    truncated = good[:6] + struct.pack("<H", 3) + good[8:]
    for handle in (bad_kind, bad_ndim, truncated):
        with pytest.raises(TensorTransportError):
            _resolve(shm, handle)
    with pytest.raises(TensorTransportError, match="cannot resolve"):
        shm.resolver(None).resolve("zmq_frames", good, torch.uint8, (1024,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_travels_by_cuda_ipc(tmp_path):  # pragma: no cover - needs a GPU
    script = tmp_path / "cuda_peer.py"
    script.write_text(
        "import sys, torch\n"
        "from tensorrpc.transports.torch_shm import TorchShmTransport\n"
        "pid, handle = int(sys.argv[1]), bytes.fromhex(sys.argv[2])\n"
        "with TorchShmTransport() as shm:\n"
        "    t = shm.resolver(pid).resolve('torch_shm', handle, torch.float32, (256, 256))\n"
        "    print(float(t.sum().item()))\n"
    )
    with TorchShmTransport() as shm:
        t = torch.ones(256, 256, device="cuda")
        placer = shm.placer("child")
        placed = placer.place(t)
        assert placed is not None
        assert shm.statistics().tensors_aliased == 1
        out = subprocess.run(
            [sys.executable, str(script), str(os.getpid()), placed[1].hex()],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
        )
        assert float(out.stdout.strip()) == 256 * 256
        assert placer.lease is not None
        assert shm.release(placer.lease)
