"""``tensorrpc top``: the rates it computes, its table, and the command in a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from rich.console import Console

from tensorrpc import _statistics
from tensorrpc._client import Client
from tensorrpc._server import Server
from tensorrpc.top import EngineView, percentile, run, table

from .. import _forkserver
from ..integration.services import Calculator

ROOT = Path(__file__).resolve().parents[2]


def _stats(
    t: float, calls: int, errors: int, nbytes: int, latency: list[list[int]]
) -> dict[str, Any]:
    counters = {
        "tensors_sent": 0,
        "bytes_sent": nbytes,
        "tensors_received": 0,
        "bytes_received": 0,
        "fallbacks": 0,
    }
    return {
        "engine_id": "e1",
        "time": t,
        "calls": calls,
        "errors": errors,
        "in_flight": 2,
        "queued": 1,
        "bytes_in": nbytes,
        "bytes_out": nbytes,
        "transports": {"frames": counters, "torch_shm": dict(counters, bytes_sent=0)},
        "latency_buckets_per_octave": 4,
        "methods": {"add": {"calls": calls, "errors": errors, "latency": latency}},
        "batching": {},
    }


def test_rates_and_windowed_percentiles_come_from_two_answers() -> None:
    view = EngineView("e1")
    view.update(_stats(100.0, 10, 0, 1000, [[40, 10]]))
    assert view.rates == {}
    assert view.p50 is None
    # 2 s later: 200 more calls, 90% in bucket 40 (1 ms), 10% in bucket 60 (~32 ms)
    view.update(_stats(102.0, 210, 4, 5000, [[40, 190], [60, 20]]))
    assert view.rates["calls"] == pytest.approx(100.0)
    assert view.rates["errors"] == pytest.approx(2.0)
    assert view.rates["bytes"] == pytest.approx(4000.0)
    assert view.rates["frames"] == pytest.approx(2000.0)
    assert view.rates["torch_shm"] == 0
    assert view.p50 == pytest.approx(_statistics.bucket_upper_seconds(40))
    assert view.p99 == pytest.approx(_statistics.bucket_upper_seconds(60))
    console = Console(record=True, width=160)
    console.print(table([view, EngineView("e2", live=False)], "top"))
    text = console.export_text()
    assert "e1" in text
    assert "100.0" in text  # calls/s
    assert "1.0 ms" in text  # p50
    assert "32.8 ms" in text  # p99
    assert "dead" in text


def test_percentile_of_an_empty_window_is_none() -> None:
    assert percentile({}, 0.5, 4) is None
    assert percentile({8: 1}, 0.99, 4) == pytest.approx(4e-6)


async def test_run_draws_engines_it_polls(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/e.sock"
    console = Console(record=True, width=160, force_terminal=False)
    async with (
        Server(Calculator("e1"), bind=address, engine_id="e1"),
        Client(Calculator, connect=address) as client,
    ):
        with anyio.fail_after(30):
            await client.wait_for_engines(1)
            for i in range(5):
                await client.stub().add(i)
            assert await run([address], interval=0.01, wait=10, count=2, console=console) == 0
    text = console.export_text()
    assert text.count("tensorrpc top") == 2
    assert "e1" in text
    assert "live" in text


def _pty_top(address: str, columns: int = 160) -> tuple[_forkserver.Forked, int]:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, columns, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)  # the terminal's own size decides
    # Forked from a pre-imported interpreter (tests/_forkserver.py): a session of its own
    # whose controlling terminal is the pty, so Ctrl-C there is a SIGINT to it.
    proc = _forkserver.popen(
        [sys.executable, "-m", "tensorrpc.cli", "top", address, "--interval", "0.2"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        controlling_terminal=True,
        env=env,
    )
    os.close(slave)
    return proc, master


def _read_until(master: int, needle: bytes, seen: bytearray, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([master], [], [], min(left, 0.5))
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                return needle in seen
            if not chunk:
                return needle in seen
            seen += chunk
    return True


async def top_session(
    tmp_path: Path, engine_id: str = "e1", quit_key: bytes = b"q", calls: int = 0
) -> tuple[int, str]:
    """``tensorrpc top`` in a pseudo-terminal, watching an engine that served ``calls``
    adds, until its third refresh; then ``quit_key``. Its exit status and what it drew."""
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Calculator("e1"), bind=address, engine_id=engine_id),
        Client(Calculator, connect=address) as client,
    ):
        with anyio.fail_after(30):
            await client.wait_for_engines(1)
        proc, master = _pty_top(address)
        seen = bytearray()
        try:
            with anyio.fail_after(120):
                for i in range(calls):
                    await client.stub().add(i)
                got = await anyio.to_thread.run_sync(_read_until, master, b"refresh 3,", seen, 90.0)
                assert got, seen.decode(errors="replace")[-2000:]
                os.write(master, quit_key)
                await anyio.to_thread.run_sync(_read_until, master, b"\x00never", seen, 0.5)
                rc = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
            os.close(master)
    return rc, seen.decode(errors="replace")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the engine side; top runs its own loop
@pytest.mark.parametrize("quit_key", [b"q", b"\x03"], ids=["q", "ctrl-c"])
async def test_top_in_a_pseudo_terminal_refreshes_and_quits(
    tmp_path: Path, quit_key: bytes
) -> None:
    rc, text = await top_session(tmp_path, quit_key=quit_key, calls=20)
    assert rc == 0, text[-2000:]
    assert "e1" in text
    assert "live" in text
    assert "q or Ctrl-C quits" in text


def _plain(raw: bytes) -> str:
    """What a terminal shows of ``raw``: escape sequences removed."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r", "", raw.decode(errors="replace"))


def test_the_table_fits_80_columns_by_dropping_the_least_important() -> None:
    view = EngineView("engine-7")
    view.update(_stats(100.0, 10, 0, 1000, [[40, 10]]))
    view.update(_stats(101.0, 30, 1, 3000, [[40, 20], [60, 10]]))
    for width, dropped in ((80, "shm/s"), (200, None)):
        console = Console(record=True, width=width, force_terminal=False)
        console.print(table([view], "tensorrpc top ipc:///tmp/e.sock", width))
        text = console.export_text()
        assert max(len(line.rstrip()) for line in text.splitlines()) <= width
        assert "…" not in text  # no cell cut to "en…"
        header = next(line for line in text.splitlines() if "engine" in line)
        for name in ("engine", "state", "calls/s", "err/s", "p50", "p99", "in flight"):
            assert name in header
        if dropped is None:
            assert "not shown" not in text
        else:
            assert f"not shown at this width: {dropped}" in text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the engine side; top runs its own loop
async def test_top_in_an_80_column_terminal_is_readable(tmp_path: Path) -> None:
    # Issue 24 item 5: at 80 columns every column was cut to "en…", "s…".
    address = f"ipc://{tmp_path}/e.sock"
    async with (
        Server(Calculator("e1"), bind=address, engine_id="e1"),
        Client(Calculator, connect=address) as client,
    ):
        with anyio.fail_after(30):
            await client.wait_for_engines(1)
        proc, master = _pty_top(address, columns=80)
        seen = bytearray()
        try:
            with anyio.fail_after(120):
                for i in range(5):
                    await client.stub().add(i)
                got = await anyio.to_thread.run_sync(_read_until, master, b"refresh 2,", seen, 90.0)
                assert got, seen.decode(errors="replace")[-2000:]
                os.write(master, b"q")
                rc = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
            os.close(master)
    assert rc == 0
    text = _plain(bytes(seen))
    assert "…" not in text, text[-2000:]
    header = next(line for line in text.splitlines() if "calls/s" in line)
    for name in ("engine", "state", "calls/s", "err/s", "p50", "p99", "in flight"):
        assert name in header
    assert "not shown at this width:" in text


def test_the_docs_capture_fits_80_columns() -> None:
    # At 1280 px the docs' code blocks show about 90 columns; the old capture had 125.
    page = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    start = page.index("```\ntensorrpc top ipc://")
    block = page[start + 4 : page.index("```", start + 4)]
    assert "calls/s" in block
    assert max(len(line) for line in block.splitlines()) <= 80
