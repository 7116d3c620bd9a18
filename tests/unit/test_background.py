"""tensorrpc's bulk threads run below the event loop's priority (issue 26, tail latency).

With `set_background_nice`, the copier's helpers, the pool's warmer and the release
thread lower their own nice value (`tensorrpc._background`); by default (None) they stay
at their creator's. Each test reads the nice value the kernel reports for the thread
that did the work. Nothing here is timed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

import tensorrpc
from tensorrpc import _background, _release
from tensorrpc.transports import _shm_copy, _shm_pool
from tensorrpc.transports._shm_copy import SPLIT_BYTES, Copier
from tensorrpc.transports._shm_pool import WARM_CHUNK, Segment, Warmer
from tensorrpc.transports.torch_shm import TorchShmTransport

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's"
)

WAIT = 30.0


def _nice() -> int:
    """The calling thread's nice value, as the kernel has it."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture
def restore() -> Iterator[None]:
    before = _background.background_nice()
    yield
    tensorrpc.set_background_nice(before)


def _nice_in_new_thread() -> int:
    got: list[int] = []

    def run() -> None:
        _background.lower_this_thread()
        got.append(_nice())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(WAIT)
    return got[0]


@pytest.mark.usefixtures("restore")
def test_a_thread_takes_the_nice_value_set_and_none_leaves_it() -> None:
    assert _background.background_nice() is None  # off by default
    start = _nice()
    tensorrpc.set_background_nice(max(start, 7))
    assert _nice_in_new_thread() == max(start, 7)
    assert _nice() == start  # the caller's own thread is never touched
    tensorrpc.set_background_nice(None)
    assert _background.lower_this_thread() is None
    assert _nice_in_new_thread() == start


@pytest.mark.usefixtures("restore")
def test_a_thread_is_never_raised() -> None:
    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        tensorrpc.set_background_nice(3)
        got.append(_background.lower_this_thread())

    got: list[int | str | None] = []
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(WAIT)
    assert got == [19]


@pytest.mark.usefixtures("restore")
def test_idle_puts_a_new_thread_under_sched_idle_and_never_the_caller() -> None:
    tensorrpc.set_background_nice("idle")
    got: list[object] = []

    def run() -> None:
        got.append(_background.lower_this_thread())
        got.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(WAIT)
    assert got == ["idle", os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is untouched


@pytest.mark.usefixtures("restore")
def test_under_idle_the_copier_leaves_its_pieces_to_idle_helpers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensorrpc.set_background_nice("idle")
    monkeypatch.setattr(_shm_copy, "SLOWEST", 4 * SPLIT_BYTES / WAIT)
    policies: dict[int, int] = {}
    memmove = ctypes.memmove

    def watched(dst: int, src: int, n: int) -> Any:
        policies[threading.get_native_id()] = os.sched_getscheduler(0)
        return memmove(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", watched)
    src = bytearray(os.urandom(1024)) * (4 * SPLIT_BYTES // 1024)
    dst = bytearray(len(src))
    copier = Copier(2)
    try:
        s = (ctypes.c_char * len(src)).from_buffer(src)
        d = (ctypes.c_char * len(dst)).from_buffer(dst)
        copier.copy(ctypes.addressof(d), ctypes.addressof(s), len(src))
        del s, d
    finally:
        copier.close()
    assert dst == src
    assert policies
    assert threading.get_native_id() not in policies
    assert set(policies.values()) == {os.SCHED_IDLE}


@pytest.mark.parametrize("bad", [-1, 20, 1.5, True, "19", "IDLE"])
def test_values_outside_0_to_19_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="nice"):
        tensorrpc.set_background_nice(bad)
    assert _background.background_nice() is None


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize(("nice", "threads"), [(None, 2), (19, 2), (19, 1)])
def test_the_copiers_helpers_run_at_the_setting_and_the_caller_leaves_them_the_pieces(
    monkeypatch: pytest.MonkeyPatch, nice: int | None, threads: int
) -> None:
    tensorrpc.set_background_nice(nice)
    # (the caller's patience, `nbytes / SLOWEST`: WAIT at most, so a loaded host's late
    # helpers do not make the caller join in)
    monkeypatch.setattr(_shm_copy, "SLOWEST", 4 * SPLIT_BYTES / WAIT)
    copied: dict[int, int] = {}
    memmove = ctypes.memmove

    def watched(dst: int, src: int, n: int) -> Any:
        copied[threading.get_native_id()] = _nice()
        return memmove(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", watched)
    src = bytearray(os.urandom(1024)) * (4 * SPLIT_BYTES // 1024)
    dst = bytearray(len(src))
    copier = Copier(threads)
    try:
        s = (ctypes.c_char * len(src)).from_buffer(src)
        d = (ctypes.c_char * len(dst)).from_buffer(dst)
        copier.copy(ctypes.addressof(d), ctypes.addressof(s), len(src))
        helpers = {t.native_id for t in copier._helpers}
        del s, d
    finally:
        copier.close()
    assert dst == src
    caller = threading.get_native_id()
    if nice is None:  # the caller is one of the two threads, at its own priority
        assert len(helpers) == 1
        assert copied.get(caller) == _nice()
        assert all(copied[h] == _nice() for h in helpers if h in copied)
    else:  # one lowered helper per thread; the caller only waited
        assert len(helpers) == threads
        assert caller not in copied
        assert copied
        assert set(copied) <= helpers
        assert set(copied.values()) == {max(_nice(), nice)}


@pytest.mark.usefixtures("restore")
@pytest.mark.skipif(not TorchShmTransport.available(), reason="needs Linux memfd and /proc")
def test_the_warmer_runs_at_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    tensorrpc.set_background_nice(_background.LOWEST)
    libc = _shm_pool._libc
    seen: list[int] = []

    class Recording:
        def madvise(self, addr: int, n: int, advice: int) -> int:
            seen.append(_nice())
            return int(libc.madvise(addr, n, advice))

        def __getattr__(self, name: str) -> Any:
            return getattr(libc, name)

    monkeypatch.setattr(_shm_pool, "_libc", Recording())
    seg = Segment("tensorrpc-test-nice", 2 * WARM_CHUNK)
    warmer = Warmer()
    try:
        warmer.submit(seg, 0, 2 * WARM_CHUNK)
        assert warmer.idle(WAIT)
    finally:
        warmer.close()
        seg.close()
    assert seen
    assert set(seen) == {_background.LOWEST}


class _Box:
    """A weakly referenceable stand-in for a large buffer."""


@pytest.mark.usefixtures("restore")
def test_the_release_thread_runs_at_the_setting() -> None:
    tensorrpc.set_background_nice(_background.LOWEST)
    box = _Box()
    dropped = threading.Event()
    seen: list[int] = []

    def record() -> None:
        seen.append(_nice())
        dropped.set()

    weakref.finalize(box, record)
    assert _release.later(box)
    del box
    assert dropped.wait(WAIT)
    assert seen == [_background.LOWEST]  # (the thread lowers itself with its next buffer)
    thread = _release._thread
    assert thread is not None
    assert thread.native_id is not None
    # The process's one release thread serves the tests after this one: back to the
    # normal priority where the process may raise it again (root), else it stays lowered.
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, thread.native_id, _nice())


@pytest.fixture
def copy_threads() -> Iterator[None]:
    yield
    tensorrpc.set_copy_threads(None)


@pytest.mark.usefixtures("copy_threads")
def test_copy_threads_set_the_default_of_copiers_made_afterwards() -> None:
    cores = _shm_copy.default_threads()
    tensorrpc.set_copy_threads(1)
    assert _shm_copy.default_threads() == 1
    copier = Copier()
    try:
        assert copier.threads == 1
    finally:
        copier.close()
    explicit = Copier(2)  # (a transport's own choice still wins)
    try:
        assert explicit.threads == 2
    finally:
        explicit.close()
    tensorrpc.set_copy_threads(None)
    assert _shm_copy.default_threads() == cores


@pytest.mark.parametrize("bad", [0, 5, 1.0, True, "1"])
def test_copy_threads_outside_1_to_4_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="copy threads"):
        tensorrpc.set_copy_threads(bad)
    assert _shm_copy._threads is None


@pytest.fixture
def tasks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list[Any]]]:
    """A fake ``/proc/self/task`` (thread id -> name) and what `_lower` was asked."""
    lowered: list[tuple[int, object]] = []

    def lower(tid: int, nice: object) -> object:
        lowered.append((tid, nice))
        return nice

    monkeypatch.setattr(_background, "_lower", lower)
    monkeypatch.setattr(_background, "_zmq_lowered", False)

    def thread(tid: int, name: str) -> None:
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "comm").write_text(name + "\n")

    thread(100, "python")
    thread(101, "ZMQbg/Reaper")
    thread(102, "ZMQbg/IO/0")
    yield thread, lowered
    tensorrpc.set_background_nice(None)


def test_the_zmq_bulk_io_thread_is_lowered_once_and_only_it(tasks: Any, tmp_path: Any) -> None:
    thread, lowered = tasks
    assert not _background.lower_zmq_bulk_thread(str(tmp_path))  # off by default
    tensorrpc.set_background_nice("idle")
    assert not _background.lower_zmq_bulk_thread(str(tmp_path))  # not started yet
    thread(103, "ZMQbg/IO/1")
    assert _background.lower_zmq_bulk_thread(str(tmp_path))
    assert lowered == [(103, "idle")]  # never the control thread (IO/0) nor the others
    thread(104, "ZMQbg/IO/1")
    assert _background.lower_zmq_bulk_thread(str(tmp_path))
    assert lowered == [(103, "idle")]  # done once: a flag test from then on
    _background._after_fork_in_child()
    assert _background.lower_zmq_bulk_thread(str(tmp_path))  # a child's own threads
    assert sorted(lowered) == [(103, "idle"), (103, "idle"), (104, "idle")]
