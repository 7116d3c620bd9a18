"""The suite under pytest-xdist (``make test`` runs ``pytest -n 3``): a plugin of the suite.

It acts only when xdist distributes the tests (``-n N``), so ``pytest tests/unit/x.py``
stays the serial run it always was. With ``-n``:

* Tests go out one by one to whichever worker has the least left (`GroupScheduling`,
  with ``-n`` alone, ``--dist load`` or ``--dist loadgroup``), except the `GROUPS`: each
  group runs in one worker. They hold what must not run twice at once on this machine
  (one Ray cluster, the network namespaces, the mypy cache) or share an expensive module
  fixture (a ``mkdocs build``, a wheel build, a fresh interpreter).
  (xdist's own ``xdist_group`` marks are not used: with pytest 9.2, xdist 3.8 loses
  them without a word, pytest-dev/pytest-xdist#1386; ``tests/test_xdist_plugin.py``
  checks that the groups hold.)
* The slowest tests start first (`SLOW`), so that none of them is the tail of the
  run; the groups go out before single tests (the biggest first).
* The temporary directories get a short root (``/tmp/trpc-run-XXXXXXXX``) instead of pytest's
  ``/tmp/pytest-of-USER/pytest-N`` plus xdist's ``popen-gwN`` level: tests build ``ipc://``
  paths (Unix socket paths, at most 107 bytes) from ``tmp_path``. It is removed at the end
  of a run that passed, kept (and named in the summary) after one that failed.
* The zygotes that fork test programs (tests/_forkserver.py) are the controller's,
  shared by the workers: one start per interpreter flags for the run, not per worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import _forkserver

#: ``(nodeid prefix, group)``: tests whose id starts with the prefix run in one worker,
#: the group's. The first matching entry wins.
GROUPS: tuple[tuple[str, str], ...] = (
    # One Ray cluster (a head and two nodes, module fixture) at a time on the machine.
    ("tests/ray/", "ray"),
    # Network namespaces and a bridge (module fixture).
    ("tests/netns/test_hosts.py", "netns"),
    # mypy against the project's .mypy_cache (sqlite: concurrent writers can fail with
    # "database is locked"); the packaging tests also share one wheel build.
    ("tests/test_packaging.py", "mypy-cache"),
    ("tests/typing/test_stub_plugin.py::test_mypy_rejects_stub_calls_that_fail", "mypy-cache"),
    # The tests of the built site share one `mkdocs build` (module fixture).
    ("tests/test_docs.py::test_mkdocs_build_is_strict_clean", "mkdocs"),
    ("tests/test_docs.py::test_rendered_pages_have_no_sphinx_roles", "mkdocs"),
    # The data pipeline example runs once (module fixture) for both of its tests.
    ("tests/test_example_data_pipeline.py", "data-pipeline"),
    # The optional-import checks read one fresh interpreter's answers, once per process
    # (tests/_fresh_imports.py).
    ("tests/test_exports.py", "fresh-interpreter"),
)

#: ``(nodeid prefix, seconds)``: the single tests that take long (serial run on a quiet
#: 2-core machine, 2026-12-01; the grouped ones go first anyway); they start first, the
#: longest first. Only the order depends on it: a stale entry costs time, never a result.
SLOW: tuple[tuple[str, float], ...] = (
    ("tests/hardening/test_soak_short.py::test_short_soak", 10.6),
    ("tests/test_demo.py::test_demo_stops_cleanly_on_ctrl_c", 7.5),
    ("tests/test_docs.py::test_python_block_runs[docs/testing.md:", 7.1),
    ("tests/test_bench_smoke.py::test_quick_roundtrip_writes_json_and_markdown", 7.1),
    ("tests/test_service_main.py::test_fingerprint_matches_between_import_and_main", 6.8),
    ("tests/test_docs.py::test_python_block_runs[docs/quickstart.md:", 6.5),
    ("tests/test_blocking_client.py::test_plain_script", 6.4),
    ("tests/observe/test_top.py::test_top_in_a_pseudo_terminal_refreshes_and_quits", 5.8),
    ("tests/test_cli.py::test_serve_and_call_end_to_end", 5.3),
    ("tests/hardening/test_faults.py::test_client_killed_mid_call_cancels_the_handler", 5.3),
    ("tests/test_docs.py::test_python_block_runs[docs/client.md:", 4.9),
    ("tests/test_demo.py::test_demo_runs_small_and_leaves_nothing_behind", 4.9),
    ("tests/transports/test_shm_lifetimes.py::test_2000_calls", 4.6),
    ("tests/unit/test_schema_fast_paths.py::test_dataclasses_decide_like_the_reference", 3.8),
    ("tests/test_example_shared_memory.py::test_shared_memory_recipe_runs", 3.7),
    ("tests/hardening/test_fuzz_live.py::test_engine_memory_stays_bounded", 3.7),
    ("tests/test_testing_plugin.py::test_an_engine_that_cannot_start_fails", 3.6),
    ("tests/unit/test_codec_fuzz.py::test_forged_descriptors", 3.5),
    ("tests/test_blocking_client.py::test_under_a_running_event_loop", 3.4),
    ("tests/test_docs.py::test_python_block_runs[README.md:", 3.2),
    ("tests/hardening/test_faults.py::test_kill_9_mid_transfer_of_large_tensors", 3.1),
    ("tests/transports/test_torch_shm.py::test_pool_segments_are_reused", 2.9),
    ("tests/test_testing_plugin.py::test_process_engines_are_separate_and_reaped", 2.9),
    ("tests/transports/test_shm_lifetimes.py::test_client_killed_mid_transfer", 2.6),
    ("tests/test_cli.py::test_serve_dials_a_client_that_binds", 2.5),
    ("tests/unit/test_codec_fuzz.py::test_size_mismatch", 2.4),
    ("tests/transports/test_shm_lifetimes.py::test_engine_killed_mid_transfer", 2.3),
    ("tests/hardening/test_fuzz_live.py::test_client_survives_hostile_frames", 2.2),
    ("tests/unit/test_codec_fuzz.py::test_mutated_messages", 2.0),
)


@dataclass
class _Run:
    """What the controller set up for a distributed run, ended by ``pytest_unconfigure``."""

    broker: _forkserver.Broker
    basetemp: Path | None = None  # ours to remove
    passed: bool = False


_RUN = pytest.StashKey[_Run]()


@pytest.hookimpl(tryfirst=True)  # before pytest's own, which reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    run = _Run(_forkserver.Broker())
    # Inherited by the workers, started after this hook.
    os.environ[_forkserver.BROKER_ENV] = run.broker.address
    if config.option.basetemp is None:
        run.basetemp = Path(tempfile.mkdtemp(prefix="trpc-run-"))
        config.option.basetemp = str(run.basetemp)
    config.stash[_RUN] = run


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's hook: our scheduler for ``-n`` alone, ``--dist load`` or ``loadgroup``."""
    if config.getvalue("dist") in ("load", "loadgroup"):
        from xdist.scheduler import LoadGroupScheduling

        class GroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
            """Each test a unit of its own, except the `GROUPS`, a unit each."""

            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid) or str(super()._split_scope(nodeid))

        return GroupScheduling(config, log)
    return None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = session.config.stash.get(_RUN, None)
    if run is not None:
        run.passed = exitstatus == 0


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    run = config.stash.get(_RUN, None)
    if run is not None and run.basetemp is not None and not run.passed:
        terminalreporter.write_line(f"temporary files of this run kept in {run.basetemp}")


def pytest_unconfigure(config: pytest.Config) -> None:
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    run.broker.close()
    os.environ.pop(_forkserver.BROKER_ENV, None)
    if run.basetemp is not None and run.passed:
        shutil.rmtree(run.basetemp, ignore_errors=True)


def group_of(nodeid: str) -> str | None:
    """The group (see `GROUPS`) of the test ``nodeid``, or None for a test on its own."""
    return next((group for prefix, group in GROUPS if nodeid.startswith(prefix)), None)


def _seconds(nodeid: str) -> float:
    for prefix, seconds in SLOW:
        if nodeid.startswith(prefix):
            return seconds
    return 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only workers collect; they all sort alike (xdist checks that they collected the same).
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: -_seconds(item.nodeid))  # stable: the rest keeps its order
