"""An engine frees a call's large arguments on the release thread only once it has
replied: the thread's wake-up and its unmapping never delay the reply
(`tensorrpc._dispatch._drop_args` and `_reply_and_free`)."""

from __future__ import annotations

from typing import Any

import pytest

from tensorrpc import _dispatch, _release


class Big:
    """A stand-in for a large argument; records when it dies."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __del__(self) -> None:
        self.events.append("died")


class Scope:
    def __init__(self, cancelled: bool) -> None:
        self.cancel_called = cancelled


def recording(monkeypatch: pytest.MonkeyPatch, events: list[str], fail: bool = False) -> None:
    async def reply(server: Any, call: Any) -> None:
        events.append("reply")
        if fail:
            raise RuntimeError("send failed")

    def later(obj: object) -> bool:
        events.append(f"later {len(obj)}")  # type: ignore[arg-type]
        return True  # (kept here: the test drops it)

    monkeypatch.setattr(_dispatch, "_reply", reply)
    monkeypatch.setattr(_dispatch, "later", later)


def test_large_arguments_are_held_back_not_handed_over() -> None:
    events: list[str] = []
    args: list[Any] = [Big(events), 3]
    held = _dispatch._drop_args(args, _release.threshold())
    assert args == []  # the call's own references are gone ...
    assert events == []  # ... and nothing died: the held copy keeps them
    assert len(held) == 1
    assert len(held[0]) == 2  # type: ignore[arg-type]
    assert getattr(_release._local, "held", None) is None  # hand-overs flow again
    held.clear()
    assert events == ["died"]


def test_small_arguments_die_at_once() -> None:
    events: list[str] = []
    held = _dispatch._drop_args([Big(events)], 0)
    assert held == []
    assert events == ["died"]


def run(coro: Any) -> None:
    """Run a coroutine that never waits (the fakes below never do): no event loop."""
    with pytest.raises(StopIteration):
        coro.send(None)


def test_the_held_arguments_go_to_the_thread_after_the_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    recording(monkeypatch, events)
    run(_dispatch._reply_and_free(None, None, Scope(False), [[1, 2]]))  # type: ignore[arg-type]
    assert events == ["reply", "later 1"]


def test_they_go_when_the_call_was_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    recording(monkeypatch, events)
    run(_dispatch._reply_and_free(None, None, Scope(True), [[1]]))  # type: ignore[arg-type]
    assert events == ["later 1"]


def test_they_go_when_the_reply_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    recording(monkeypatch, events, fail=True)
    coro = _dispatch._reply_and_free(None, None, Scope(False), [[1]])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="send failed"):
        coro.send(None)
    assert events == ["reply", "later 1"]
