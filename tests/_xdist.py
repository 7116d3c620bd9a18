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

#: ``(nodeid prefix, seconds)``: the single tests that take long (``pytest -n 2
#: --durations`` of the whole suite on the 2-core machine at load 7-9, 2026-12-02, property
#: tests at their share of examples, tests/conftest.py; the grouped ones go first anyway);
#: they start first, the longest first. Only the order depends on it: a stale entry costs
#: time, never a result.
SLOW: tuple[tuple[str, float], ...] = (
    # mypy strict without the plugin, on a cache of its own (cold in a fresh clone)
    ("tests/typing/test_typed_stub.py::test_mypy_without_the_plugin", 135.6),
    # with Ray Serve installed (make bench's extra) it runs that peer too, in two modes
    # (54 s alone at load 4-7)
    ("tests/test_bench_smoke.py::test_quick_batching_section", 54.0),
    ("tests/test_bench_smoke.py::test_quick_compression_section", 30.1),
    ("tests/transports/test_shm_torch_alias.py::test_an_engine_that_fails_the_gate", 29.3),
    ("tests/test_demo.py::test_demo_runs_small_and_leaves_nothing_behind", 24.1),
    ("tests/test_bench_smoke.py::test_startup_measures_the_commands", 24.0),
    ("tests/test_bench_smoke.py::test_quick_mixed_load_reports_tails", 21.5),
    ("tests/test_bench_smoke.py::test_dataloader_batches_are_shared", 20.7),
    ("tests/hardening/test_soak_short.py::test_short_soak", 20.5),
    ("tests/hardening/test_fuzz_live.py::test_engine_survives_hostile_frames", 19.1),
    ("tests/test_demo.py::test_demo_stops_cleanly_on_ctrl_c", 15.9),
    ("tests/test_example_shared_memory.py::test_shared_memory_recipe_runs", 15.5),
    ("tests/transports/test_torch_shm.py::test_pool_segments_are_reused", 13.5),
    ("tests/test_blocking_client.py::test_plain_script", 13.0),
    ("tests/test_bench_smoke.py::test_call_cpu_reports_client_and_engine_cpu", 12.0),
    ("tests/test_docs.py::test_python_block_runs[docs/testing.md:", 11.8),
    ("tests/test_bench_smoke.py::test_shm_held_reports", 11.5),
    ("tests/test_bench_smoke.py::test_quick_roundtrip_writes_json_and_markdown", 11.2),
    ("tests/hardening/test_faults.py::test_kill_9_mid_transfer_of_large_tensors", 10.6),
    ("tests/test_testing_plugin.py::test_asyncio_handler_on_trio_fails", 8.8),
    ("tests/transports/test_torch_shm.py::test_two_thousand_transfers", 8.5),
    ("tests/transports/test_shm_lifetimes.py::test_2000_calls", 8.3),
    ("tests/transports/test_shm_lifetimes.py::test_normal_shutdown_leaves_nothing", 6.8),
    ("tests/transports/test_shm_one_copy.py::test_many_one_copy_transfers", 6.3),
    ("tests/test_docs.py::test_python_block_runs[docs/quickstart.md:", 5.4),
    ("tests/hardening/test_fuzz_live.py::test_engine_memory_stays_bounded", 5.4),
    ("tests/test_code_size.py::", 5.3),
    ("tests/integration/test_bulk.py::test_a_session_that_ends_takes_its_bulk", 5.3),
    ("tests/test_docs.py::test_messages_spell_dialling_one_way", 5.2),
    ("tests/test_docs.py::test_docstrings_have_no_rst_literal_markers", 5.1),
    ("tests/hardening/test_faults.py::test_client_killed_mid_call_cancels_the_handler", 4.1),
    ("tests/transports/test_shm_lifetimes.py::test_client_killed_mid_transfer", 3.5),
    ("tests/test_docs.py::test_python_block_runs[docs/client.md:", 3.5),
    ("tests/test_docs.py::test_python_block_runs[README.md:", 3.2),
    ("tests/test_testing_plugin.py::test_an_engine_that_cannot_start_fails", 2.8),
    ("tests/test_cli.py::test_serve_and_call_end_to_end", 1.9),
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
