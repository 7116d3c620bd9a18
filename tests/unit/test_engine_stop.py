"""How ``tensorrpc.testing.engine_processes`` stops its engines: as a supervisor does.

``tensorrpc serve`` drains on its first SIGTERM and stops handling signals, so a second
SIGTERM would kill a draining engine before its BYE. The processes here are fakes with
``subprocess.Popen``'s interface, so what each received is exact.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

import pytest

from tensorrpc import testing
from tensorrpc.testing import engine_processes


class FakeEngine:
    """Runs until waited for (it drains while waited on); ``hangs`` never ends by itself."""

    def __init__(self, hangs: bool) -> None:
        self.hangs = hangs
        self.signals: list[int] = []
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        assert self.returncode is None, "signalled after it was reaped"
        self.signals.append(signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.signals and (not self.hangs or self.signals[-1] == signal.SIGKILL):
            self.returncode = -self.signals[-1]
            return self.returncode
        raise subprocess.TimeoutExpired("engine", timeout or 0.0)


def factory() -> object:
    """An importable factory for the command line; nothing runs it."""
    return None


def _run(monkeypatch: pytest.MonkeyPatch, hangs: list[bool]) -> list[FakeEngine]:
    fakes = iter([FakeEngine(h) for h in hangs])
    started: list[FakeEngine] = []

    def popen(*_args: Any, **_kwargs: Any) -> FakeEngine:
        started.append(next(fakes))
        return started[-1]

    monkeypatch.setattr(testing, "_popen", popen)
    with engine_processes(factory, "ipc:///nowhere", len(hangs), stop_timeout=0.01) as e:
        assert [x.process for x in e] == list[Any](started)
    return started


def test_each_engine_gets_one_sigterm_and_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    engines = _run(monkeypatch, [False, False, False])
    assert [e.signals for e in engines] == [[signal.SIGTERM]] * 3
    assert all(e.returncode == -signal.SIGTERM for e in engines)


def test_an_engine_past_the_bound_is_killed_never_terminated_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = _run(monkeypatch, [True, False])
    assert engines[0].signals == [signal.SIGTERM, signal.SIGKILL]
    assert engines[1].signals == [signal.SIGTERM]
    assert all(e.returncode is not None for e in engines)
