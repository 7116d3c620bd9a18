"""`_release.drained`: a marker through the release thread's queue, in order."""

from __future__ import annotations

import threading
import weakref

from tensorrpc import _release


class _Big:
    """Stands for a large buffer; records the thread that freed it."""

    freed_by: int | None = None


def test_drained_returns_once_everything_handed_over_before_it_is_gone() -> None:
    freed: list[int] = []
    objs = [_Big() for _ in range(5)]
    for obj in objs:
        weakref.finalize(obj, lambda: freed.append(threading.get_ident()))
    for obj in objs:
        assert _release.later(obj)
    del obj, objs
    assert _release.drained(10.0)
    assert len(freed) == 5
    assert threading.get_ident() not in freed  # dropped on the release thread


def test_an_object_still_held_by_its_caller_delays_no_other_release() -> None:
    # Before, the thread slept (up to 0.25 s) on each object whose caller still held it,
    # then dropped its reference, so the caller's own del freed it on the loop after all.
    freed: dict[str, int] = {}
    gate = threading.Event()
    kept, other = _Big(), _Big()
    weakref.finalize(kept, lambda: freed.__setitem__("kept", threading.get_ident()))

    def other_freed() -> None:
        freed["other"] = threading.get_ident()
        gate.set()

    weakref.finalize(other, other_freed)
    assert _release.later(kept)  # the caller keeps its reference for now
    assert _release.later(other)
    del other
    assert gate.wait(10.0)  # freed while ``kept`` is still held
    assert "kept" not in freed
    del kept
    assert _release.drained(10.0)
    assert set(freed) == {"kept", "other"}
    assert threading.get_ident() not in freed.values()
