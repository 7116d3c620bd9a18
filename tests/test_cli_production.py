"""``tensorrpc serve`` as an operator runs it (issue 24 items 1 and 4): metrics, tracing and
CURVE from flags and ``TENSORRPC_*`` variables, ``health``, ``describe ADDR``, SIGTERM
draining a running call, and two engine processes on one host, each exporting its own
metrics. Real engine processes (forked as in tests/test_cli.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorrpc import generate_keypair, save_keypair

from . import _forkserver
from .test_cli import COMMAND, PROC_WAIT_S, ROOT, SERVICE, assert_one_line_error, run_cli


@contextlib.contextmanager
def serving(
    tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[_forkserver.Forked, Path]]:
    """``tensorrpc serve`` in a child process, its output in ``name``.log; always reaped."""
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = _forkserver.popen(
            [*COMMAND, "serve", SERVICE, *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=PROC_WAIT_S)


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A ``tensorrpc`` command in a child process (for its environment), reaped."""
    proc = _forkserver.popen(
        [*COMMAND, *argv],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=PROC_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=PROC_WAIT_S)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def wait_for_line(log: Path, pattern: str) -> re.Match[str]:
    """The first match of ``pattern`` in a child's log, once written (bounded wait)."""
    deadline = time.monotonic() + PROC_WAIT_S
    while True:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found is not None:
            return found
        assert time.monotonic() < deadline, f"{pattern!r} never appeared in {log.name}"
        time.sleep(0.05)  # polling a file another process writes, bounded above


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_two_engine_processes_each_export_their_own_metrics(tmp_path: Path) -> None:
    a_addr, b_addr = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    tracing = {"TENSORRPC_TRACING": "1", "OTEL_TRACES_EXPORTER": "console"}
    with serving(tmp_path, "a", "--bind", a_addr, "--engine-id", "a", "--metrics-port", "0",
                 env=tracing) as (a, a_log):  # fmt: skip
        done = cli("call", a_addr, "add", "a=2", "b=5", "--timeout", str(PROC_WAIT_S))
        assert (done.returncode, done.stdout) == (0, "7\n"), done.stderr
        port = int(wait_for_line(a_log, r"metrics on http://127\.0\.0\.1:(\d+)/metrics")[1])

        # A second engine on the same port: one line naming the option, exit 1.
        taken = cli("serve", SERVICE, "--bind", b_addr, env={"TENSORRPC_METRICS_PORT": str(port)})
        assert_one_line_error(
            taken.returncode, taken.stderr, 1, f"metrics port {port}", "--metrics-port"
        )
        assert "Address already in use" in taken.stderr

        # With a port of its own (from the environment), both run side by side.
        with serving(tmp_path, "b", "--bind", b_addr, "--engine-id", "b",
                     env={"TENSORRPC_METRICS_PORT": "0"}) as (b, b_log):  # fmt: skip
            done = cli("health", b_addr, "--timeout", str(PROC_WAIT_S))
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("ok: engine b: service Calculator")
            b_port = int(wait_for_line(b_log, r"metrics on http://127\.0\.0\.1:(\d+)/metrics")[1])
            assert b_port != port
            for metrics, me in ((scrape(port), "a"), (scrape(b_port), "b")):
                # an engine exports no client families (no "client has no live engines")
                assert not [n for n in metrics if n.startswith("tensorrpc_client_")]
                assert {labels["engine"] for labels, _ in metrics["tensorrpc_engine_clients"]} == {
                    me
                }
            calls = scrape(port)["tensorrpc_engine_calls_total"]
            assert ({"method": "add", "engine": "a", "outcome": "ok"}, 1.0) in calls
            b.send_signal(signal.SIGTERM)
            assert b.wait(timeout=PROC_WAIT_S) == 0

        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=PROC_WAIT_S) == 0
        text = a_log.read_text()
        # --tracing from TENSORRPC_TRACING, the exporter from OTEL_TRACES_EXPORTER.
        assert '"rpc.method": "add"' in text
        assert '"service.name": "Calculator"' in text
        assert "Traceback" not in text


def test_curve_from_flags_and_environment(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    save_keypair(generate_keypair(), keys, "engine")
    save_keypair(generate_keypair(), keys, "client")
    save_keypair(generate_keypair(), keys, "stranger")
    (allowed / "client.key").write_bytes((keys / "client.key").read_bytes())
    address = f"ipc://{tmp_path}/curve.sock"
    engine_env = {
        "TENSORRPC_CURVE_KEYPAIR": str(keys / "engine.key_secret"),
        "TENSORRPC_CURVE_ALLOW": str(allowed),  # a directory of *.key files
    }
    with serving(tmp_path, "curve", "--bind", address, "--engine-id", "c1", env=engine_env):
        ours = ["--curve-keypair", str(keys / "client.key_secret")]
        server = ["--curve-server-key", str(keys / "engine.key")]
        wait = ["--timeout", str(PROC_WAIT_S)]
        argv = ["call", address, "add", "a=1", "b=41", *ours, *server, *wait]
        status, out, err = run_cli(capsys, *argv)
        assert (status, out) == (0, "42\n"), err
        status, out, err = run_cli(capsys, "health", address, *ours, *server, "--json")
        assert status == 0, err
        assert json.loads(out)["engine_id"] == "c1"
        status, out, err = run_cli(capsys, "describe", address, *ours, *server)
        assert status == 0, err
        assert "  add(a: int, b: int = 1) -> int" in out.splitlines()
        # The client side from the environment too.
        done = cli(
            "health",
            address,
            *wait,
            env={
                "TENSORRPC_CURVE_KEYPAIR": str(keys / "client.key_secret"),
                "TENSORRPC_CURVE_SERVER_KEY": str(keys / "engine.key"),
            },
        )
        assert done.returncode == 0, done.stderr
        # Not on the allow-list, or no CURVE at all: no engine answers.
        stranger = ["--curve-keypair", str(keys / "stranger.key_secret")]
        for argv in ([*stranger, *server], []):
            status, _, err = run_cli(capsys, "health", address, "--timeout", "0.5", *argv)
            assert_one_line_error(status, err, 1, "no engine answered")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["call", "5555", "add", "--curve-server-key", "k"], "give --curve-keypair"),
        (["call", "5555", "add", "--curve-keypair", "k"], "give --curve-server-key"),
        (["call", "5555", "add", "--curve-keypair", "k", "--curve-allow", "d"], "listens"),
        (["serve", SERVICE, "--bind", "1", "--curve-keypair", "k"], "--curve-allow-any"),
        (["serve", SERVICE, "--bind", "1", "--metrics-port", "70000"], "--metrics-port"),
    ],
)
def test_production_flag_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    status, _, err = run_cli(capsys, *argv)
    assert_one_line_error(status, err, 2, fragment)


def test_a_bad_environment_variable_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORRPC_METRICS_PORT", "http")
    status, _, err = run_cli(capsys, "serve", SERVICE, "--bind", "1")
    assert_one_line_error(status, err, 2, "TENSORRPC_METRICS_PORT 'http'")


def test_sigterm_drains_a_running_call(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/drain.sock"
    with serving(tmp_path, "drain", "--bind", address, "--grace-period", "60") as (proc, log):
        slow = _forkserver.popen(
            [*COMMAND, "call", address, "sleep", "seconds=1.5", "token=t",
             "--timeout", str(PROC_WAIT_S)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + PROC_WAIT_S
            while cli("call", address, "event", "token=t", "--timeout", "30").stdout != "started\n":
                assert time.monotonic() < deadline, "the slow call never started"
            proc.send_signal(signal.SIGTERM)  # while the handler sleeps
            out, err = slow.communicate(timeout=PROC_WAIT_S)
        finally:
            if slow.poll() is None:
                slow.kill()
                slow.communicate(timeout=PROC_WAIT_S)
        assert (slow.returncode, out) == (0, "t\n"), err
        assert proc.wait(timeout=PROC_WAIT_S) == 0
        assert "SIGTERM: draining" in log.read_text()


def test_health_has_help_and_serve_lists_the_variables(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "health", "--help")
    assert status == 0
    assert out.startswith("usage: tensorrpc health")
    status, out, _ = run_cli(capsys, "serve", "--help")
    assert status == 0
    for name in ("TENSORRPC_METRICS_PORT", "TENSORRPC_TRACING", "TENSORRPC_CURVE_KEYPAIR",
                 "TENSORRPC_CURVE_ALLOW", "OTEL_TRACES_EXPORTER"):  # fmt: skip
        assert name in " ".join(out.split())
