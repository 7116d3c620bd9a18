"""The environment ``tensorrpc.testing.engine_processes`` gives its engines.

Large buffers go on transparent huge pages in the engine processes (glibc's malloc for
libzmq's received messages, torch's CPU allocator), unless the caller's environment says
otherwise. The processes here are fakes; what matters is the ``env`` they were given.
"""

from __future__ import annotations

from typing import Any

import pytest

from tensorrpc import testing
from tensorrpc.testing import engine_processes


class FakeEngine:
    """Exits at its first signal; remembers nothing else."""

    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.returncode = -signum

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode or 0


def factory() -> object:
    """An importable factory for the command line; nothing runs it."""
    return None


def _engine_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    envs: list[dict[str, str]] = []

    def popen(*_args: Any, env: dict[str, str], **_kwargs: Any) -> FakeEngine:
        envs.append(env)
        return FakeEngine()

    monkeypatch.setattr(testing, "_popen", popen)
    with engine_processes(factory, "ipc:///nowhere", stop_timeout=0.01):
        pass
    (env,) = envs
    return env


def test_engines_get_huge_pages_for_large_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    env = _engine_env(monkeypatch)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"


def test_other_tunables_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    env = _engine_env(monkeypatch)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_the_callers_own_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    env = _engine_env(monkeypatch)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    assert env["THP_MEM_ALLOC_ENABLE"] == "0"
