"""The sender's large copies into its pool are split over threads (issue 20, speed).

`Copier` cuts a copy into pieces that the calling thread and helper threads take in turn:
every byte lands where it should whatever the size, a copy really is shared between
threads, and a helper that never runs does not hold the copy up (the caller takes its
pieces). Nothing here is timed.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from typing import Any

import pytest
import torch

from tensorrpc.transports import _shm_copy
from tensorrpc.transports._shm_copy import MIN_PIECE, SPLIT_BYTES, Copier

WAIT = 30.0


def _copied(copier: Copier, nbytes: int, offset: int = 0) -> None:
    src = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 2 * offset + 64, dtype=torch.uint8)
    copier.copy(dst.data_ptr() + offset, src.data_ptr() + offset, nbytes)
    assert torch.equal(dst[offset : offset + nbytes], src[offset:])
    assert not dst[:offset].any()  # nothing written outside the range
    assert not dst[offset + nbytes :].any()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "nbytes", [1, 4096, SPLIT_BYTES - 1, SPLIT_BYTES, 3 * MIN_PIECE + 4097, 40 * MIN_PIECE + 7]
)
def test_every_byte_lands_in_place(threads: int, nbytes: int) -> None:
    copier = Copier(threads)
    try:
        _copied(copier, nbytes, offset=13)
    finally:
        copier.close()


def test_a_large_copy_is_shared_with_a_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    helped = threading.Event()
    caller = threading.get_ident()
    memmove = ctypes.memmove

    def watched(dst: int, src: int, n: int) -> Any:
        if threading.get_ident() == caller:
            # The caller's first piece waits (bounded) until a helper has copied one.
            assert helped.wait(WAIT), "no helper took a piece"
        else:
            helped.set()
        return memmove(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", watched)
    copier = Copier(2)
    try:
        _copied(copier, 4 * MIN_PIECE)
    finally:
        copier.close()
    assert helped.is_set()


def test_a_helper_that_never_runs_does_not_hold_the_copy_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stuck = threading.Event()

    def never(jobs: Any) -> None:  # a helper the host never schedules
        stuck.wait(WAIT)

    monkeypatch.setattr(Copier, "_help", staticmethod(never))
    copier = Copier(3)
    done = threading.Event()

    def copy() -> None:
        _copied(copier, 6 * MIN_PIECE)
        done.set()

    thread = threading.Thread(target=copy)
    thread.start()
    try:
        assert done.wait(WAIT), "the copy waited for helpers that never ran"
    finally:
        stuck.set()
        thread.join(WAIT)
        copier.close()


def test_one_thread_starts_none_and_a_closed_copier_copies_alone() -> None:
    single = Copier(1)
    _copied(single, 2 * SPLIT_BYTES)
    assert not single._helpers
    copier = Copier(3)
    _copied(copier, SPLIT_BYTES - 1)  # too small to split: no helper yet
    assert not copier._helpers
    _copied(copier, 2 * SPLIT_BYTES)
    helpers = list(copier._helpers)
    assert len(helpers) == 2  # beside the caller (lowered helpers: see test_background)
    copier.close()
    assert not any(t.is_alive() for t in helpers)
    _copied(copier, 2 * SPLIT_BYTES)  # after close: on the caller's thread
    assert not copier._helpers


def test_a_copier_dropped_without_close_stops_its_helpers() -> None:
    copier = Copier(2)
    _copied(copier, 2 * SPLIT_BYTES)
    helpers = list(copier._helpers)
    del copier
    gc.collect()
    for thread in helpers:
        thread.join(WAIT)
        assert not thread.is_alive()


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (3, 3), (5, 4), (64, 4)])
def test_the_default_is_the_processs_cores_at_most_four(
    monkeypatch: pytest.MonkeyPatch, cores: int, threads: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert _shm_copy.default_threads() == threads
    assert Copier().threads == threads
    assert Copier(0).threads == 1
