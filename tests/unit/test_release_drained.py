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
