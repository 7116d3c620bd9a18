"""tests/_xdist.py, the suite's pytest-xdist plugin: its groups hold and its lists are current.

The groups decide what may run at once (one Ray cluster, one mypy cache): a group that
silently stops holding (as xdist's own ``xdist_group`` marks do with pytest 9.2) would
make parallel runs flaky, not fail. Here the scheduler is driven with fake workers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests import _xdist

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("xdist", reason="pytest-xdist is not installed (the dev extra has it)")


class FakeConfig:
    def __init__(self, workers: int, dist: str) -> None:
        self.values = {"tx": ["popen"] * workers, "dist": dist}
        self.option = type("Options", (), {"loadscopereorder": True})()

    def getvalue(self, name: str) -> Any:
        return self.values[name]


class FakeWorker:
    """What the scheduler calls on a worker: it records the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


COLLECTION = [
    "tests/unit/test_a.py::test_1",
    "tests/ray/test_launch.py::test_spread[asyncio]",
    "tests/unit/test_a.py::test_2",
    "tests/test_packaging.py::test_wheel",
    "tests/ray/test_launch.py::test_killed[asyncio]",
    "tests/typing/test_stub_plugin.py::test_mypy_rejects_stub_calls_that_fail_at_run_time",
    "tests/unit/test_a.py::test_3",
    "tests/ray/test_launch.py::test_bad_arguments[trio]",
    "tests/test_packaging.py::test_sdist",
]


def run_schedule(workers: int, dist: str) -> list[list[str]]:
    """Schedule COLLECTION on fake workers that finish their tests in turn."""
    scheduler = _xdist.pytest_xdist_make_scheduler(FakeConfig(workers, dist), None)  # type: ignore[arg-type]
    nodes = [FakeWorker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    done = dict.fromkeys(nodes, 0)
    for _ in range(100):  # each round, every worker finishes one test it was sent
        progressed = False
        for node in nodes:
            if done[node] < len(node.sent):
                scheduler.mark_test_complete(node, node.sent[done[node]])
                done[node] += 1
                progressed = True
        if not progressed:
            break
    assert scheduler.tests_finished
    return [[COLLECTION[i] for i in node.sent] for node in nodes]


@pytest.mark.parametrize("dist", ["load", "loadgroup"])
def test_each_group_runs_in_one_worker_and_every_test_once(dist: str) -> None:
    runs = run_schedule(3, dist)
    assert sorted(t for run in runs for t in run) == sorted(COLLECTION)
    for group in ("ray", "mypy-cache"):
        members = {t for t in COLLECTION if _xdist.group_of(t) == group}
        assert len(members) == 3
        assert sum(bool(members & set(run)) for run in runs) == 1, (group, runs)
    assert sum(bool(run) for run in runs) == 3  # the single tests spread


def test_other_distributions_are_left_to_xdist() -> None:
    assert _xdist.pytest_xdist_make_scheduler(FakeConfig(2, "loadfile"), None) is None  # type: ignore[arg-type]


def _names_an_existing_test(prefix: str) -> bool:
    """Whether ``prefix`` (``path`` or ``path::name-start``) names a file, or a test in it."""
    path, _, name = prefix.partition("::")
    target = ROOT / path
    if not name:
        return target.exists()
    if not target.is_file():
        return False
    function, _, param = name.partition("[")
    page = param.partition(":")[0]  # a docs block's page: test_python_block_runs[README.md:42]
    if page and not (ROOT / page).is_file():
        return False
    return re.search(rf"def {re.escape(function)}", target.read_text(encoding="utf-8")) is not None


@pytest.mark.parametrize("prefix", [p for p, _ in _xdist.GROUPS] + [p for p, _ in _xdist.SLOW])
def test_listed_tests_exist(prefix: str) -> None:
    assert _names_an_existing_test(prefix), f"{prefix} names no test: update tests/_xdist.py"


def test_a_stale_entry_is_found() -> None:
    assert not _names_an_existing_test("tests/test_demo.py::test_no_such_test")
    assert not _names_an_existing_test("tests/no_such_file.py")
    assert not _names_an_existing_test("tests/test_docs.py::test_python_block_runs[docs/gone.md:")
