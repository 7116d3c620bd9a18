"""`tensorrpc._release`: the thread that drops large buffers off the event loop."""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

import tensorrpc
from tensorrpc import _release

WAIT = 20.0


class Box:
    """A weakly referenceable stand-in for a buffer."""


def died_in(obj: object) -> tuple[threading.Event, list[str]]:
    """An event set, and the thread's name recorded, when ``obj`` dies."""
    done = threading.Event()
    names: list[str] = []

    def record() -> None:
        names.append(threading.current_thread().name)
        done.set()

    weakref.finalize(obj, record)
    return done, names


@pytest.fixture
def settings() -> Iterator[None]:
    """Restore the module's threshold and queue size after a test changes them."""
    threshold, queued = _release.threshold(), _release.max_queued()
    yield
    _release.set_release_threshold(threshold, max_queued=queued)


def test_a_handed_over_object_dies_on_the_release_thread() -> None:
    box = Box()
    done, names = died_in(box)
    assert tensorrpc.release_later(box)
    del box  # dropped at once: the thread's reference is the last
    assert done.wait(WAIT)
    assert names == ["tensorrpc-release"]


def test_the_thread_waits_for_the_callers_reference() -> None:
    # A container still referenced by its sender is not dropped before the sender's
    # reference goes, so the object in it still dies on the release thread.
    inner = Box()
    done, names = died_in(inner)
    outer = [inner]
    del inner
    assert _release.later(outer)
    # The sender lets the thread run before it drops its reference (as a preempted
    # event loop would); the thread must not drop the list meanwhile.
    time.sleep(0.005)
    del outer
    assert done.wait(WAIT)
    assert names == ["tensorrpc-release"]


def test_small_objects_stay_with_the_caller() -> None:
    box = Box()
    done, names = died_in(box)
    assert not _release.later_if_large(box, _release.threshold() - 1)
    del box
    assert done.is_set()
    assert names == [threading.current_thread().name]


def test_large_objects_are_handed_over() -> None:
    box = Box()
    done, names = died_in(box)
    assert _release.later_if_large(box, _release.threshold())
    del box
    assert done.wait(WAIT)
    assert names == ["tensorrpc-release"]


def test_a_full_queue_refuses_and_the_object_dies_inline(settings: None) -> None:
    _release.set_release_threshold(_release.threshold(), max_queued=1)
    entered = threading.Event()
    leave = threading.Event()

    class Blocker:
        def __del__(self) -> None:
            entered.set()
            leave.wait(WAIT)

    assert _release.later(Blocker())
    assert entered.wait(WAIT)  # the thread is busy with it; the queue is empty
    queued = Box()
    queued_done, queued_names = died_in(queued)
    assert _release.later(queued)  # takes the queue's one place
    del queued
    refused = Box()
    refused_done, refused_names = died_in(refused)
    assert not _release.later(refused)
    del refused
    assert refused_done.is_set()
    assert refused_names == [threading.current_thread().name]
    leave.set()
    assert queued_done.wait(WAIT)
    assert queued_names == ["tensorrpc-release"]


def test_threshold_is_tunable(settings: None) -> None:
    _release.set_release_threshold(10)
    assert _release.threshold() == 10
    assert not _release.later_if_large(Box(), 9)
    tensorrpc.set_release_threshold(sys.maxsize)
    assert not _release.later_if_large(Box(), 1 << 40)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        tensorrpc.set_release_threshold(-1)
    with pytest.raises(ValueError, match="max_queued"):
        tensorrpc.set_release_threshold(1, max_queued=0)


def test_nbytes_sums_buffers() -> None:
    assert _release.nbytes([b"abc", bytearray(5), memoryview(b"xy")]) == 10
    assert _release.nbytes(()) == 0


def test_an_evicted_mapping_is_unmapped_on_the_release_thread() -> None:
    import torch

    from tensorrpc.transports._shm_recv import SegmentMaps

    big = _release.threshold()
    maps = SegmentMaps(max_segments=1, max_bytes_per_peer=4 * big)
    view = torch.zeros(big, dtype=torch.uint8)
    done, names = died_in(view)
    assert maps.put((1, 9, 1), view)
    del view
    assert maps.put((2, 9, 2), torch.zeros(16, dtype=torch.uint8))  # evicts the first
    assert done.wait(WAIT)
    assert names == ["tensorrpc-release"]
    small = torch.zeros(16, dtype=torch.uint8)
    small_done, small_names = died_in(small)
    assert maps.put((2, 9, 2), small)  # replaces the 16-byte entry (small: freed inline)
    del small
    maps.clear()
    assert small_done.wait(WAIT)
    assert small_names == ["tensorrpc-release"]  # clear hands the whole table over


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")
def test_a_closed_pool_segment_is_unmapped_on_the_release_thread() -> None:
    from tensorrpc.transports._shm_pool import Segment

    seg = Segment("tensorrpc-test-release", _release.threshold())
    done, names = died_in(seg.view)
    seg.close()
    assert done.wait(WAIT)
    assert names == ["tensorrpc-release"]


def test_held_nbytes_counts_what_has_a_size() -> None:
    import torch

    held = [torch.zeros(10, dtype=torch.float32), memoryview(b"abc"), object(), "text"]
    assert _release.held_nbytes(held) == 43


def test_a_send_done_at_once_is_released_after_its_frames() -> None:
    # tests/integration/test_release.py::test_echo_frees_both_frames_off_the_loop, made
    # deterministic: ZMQ finished the send before `PendingSends.add`, and the sender
    # still holds the frames it sent (views of the tensor's memory that the release
    # thread cannot see). Handed over at once, the tensor died with those frames, on
    # the sender's thread.
    import torch
    import zmq

    from tensorrpc import _codec
    from tensorrpc._zmq import PendingSends

    nbytes = _release.threshold()
    owner, view = _codec._host_bytes(torch.ones(nbytes, dtype=torch.uint8))
    done, names = died_in(owner)
    frames: list[object] = [b"header", view]
    keepalive: list[object] = [owner]
    del owner, view
    pending = PendingSends()
    pending.add(zmq.MessageTracker(), keepalive, nbytes)  # no events: done already
    del keepalive
    assert _release.drained(WAIT)
    del frames  # the sender returns
    assert not done.is_set()
    assert pending.prune() == 0  # the next send or housekeeping tick
    assert done.wait(WAIT)
    assert names == ["tensorrpc-release"]


def test_hand_overs_held_back_reach_the_thread_only_when_handed_on() -> None:
    box = Box()
    done, names = died_in(box)
    held = _release.hold_back()
    try:
        assert _release.later_if_large(box, _release.threshold())
        assert not _release.later_if_large(Box(), 0)  # small: not held, dies inline
    finally:
        _release.resume()
    del box
    assert len(held) == 1
    assert not done.is_set()
    other = Box()
    other_done, _ = died_in(other)
    assert _release.later(other)  # after resume(): straight to the thread again
    del other
    assert other_done.wait(WAIT)
    assert not done.is_set()
    assert _release.later(held)
    del held
    assert done.wait(WAIT)
    assert names == ["tensorrpc-release"]


def test_holding_back_is_per_thread() -> None:
    held = _release.hold_back()
    try:
        box = Box()
        done, names = died_in(box)
        worker = threading.Thread(target=_release.later, args=(box,))
        worker.start()
        worker.join(WAIT)
        del box
        assert done.wait(WAIT)  # another thread's hand-over went to the thread
        assert names == ["tensorrpc-release"]
        assert held == []
    finally:
        _release.resume()
