"""BlockingClient: a plain script, code under a running event loop, and clean shutdown.

Engines run as subprocesses (``tensorrpc.testing.engine_processes``): the caller's thread
blocks on every call, so an engine on the caller's own loop could never answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorrpc
from tensorrpc.testing import engine_processes
from tests import _forkserver
from tests.integration.services import Calculator

ROOT = Path(__file__).resolve().parent.parent
THREAD_NAME = "tensorrpc-blocking-client"


def _socket_fds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


#: Run by a fork of the pre-imported interpreter (tests/_forkserver.py), whose own imports
#: are checked under ``-W error`` by the docs' examples; the script turns warnings into
#: errors itself, as ``python -W error`` would.
SCRIPT = """
from __future__ import annotations

import warnings

warnings.simplefilter("error")

import threading

import tensorrpc
from tensorrpc.testing import engine_processes
from tests.integration.services import Calculator

client = tensorrpc.BlockingClient(Calculator, bind="tcp://127.0.0.1:0")
schemaless = tensorrpc.BlockingClient.dynamic(bind="tcp://127.0.0.1:0", backend="trio")
addresses = [client.addresses[0], schemaless.addresses[0]]
with client, schemaless, engine_processes(Calculator, addresses, 2) as engines:
    live = client.wait_for_engines(2, timeout=60)
    assert sorted(live) == ["engine-0", "engine-1"]
    schemaless.wait_for_engines(2, timeout=60)
    assert schemaless.call_by_name("add", {"a": 2}) == 3
    assert list(schemaless.stream_by_name("count", {"n": 2})) == [0, 1]
    assert client.call(Calculator.add, 1, 2) == 3
    assert client.call(Calculator.mul, 3, b=4) == 12  # a sync handler
    assert client.stub().add(5) == 6
    assert list(client.with_options(engine="engine-0").stub().count(2)) == [0, 1]
    assert list(client.stream(Calculator.count, 4)) == [0, 1, 2, 3]
    with client.stream(Calculator.count, 1_000_000) as stream:  # leave early
        assert next(stream) == 0
    assert client.broadcast("add", 1, b=2) == {"engine-0": 3, "engine-1": 3}
    view = client.with_options(engine="engine-1", timeout=10)
    assert view.call(Calculator.pid) == engines[1].process.pid
    try:
        client.with_options(timeout=0.2).call(Calculator.sleep, 30)
    except tensorrpc.CallTimeoutError:
        pass
    else:
        raise AssertionError("the call should have timed out")
    assert client.health("engine-0") is tensorrpc.HealthStatus.SERVING
    assert schemaless.health(service="Other") is tensorrpc.HealthStatus.SERVICE_UNKNOWN
    stats = client.statistics()
    assert stats.engines["engine-0"].calls >= 1
    assert stats.calls_in_flight == 0
assert client.closed and schemaless.closed
client.close()  # idempotent
assert [t.name for t in threading.enumerate()] == ["MainThread"]
try:
    client.call(Calculator.add, 1)
except tensorrpc.ClosedError:
    pass
else:
    raise AssertionError("a closed client must refuse calls")

# Left open on purpose: closed by its finalizer at interpreter exit (no hang, exit 0).
forgotten = tensorrpc.BlockingClient(Calculator, bind="tcp://127.0.0.1:0")
print("done", flush=True)
"""


def test_plain_script(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = _forkserver.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "done"
    assert proc.stderr == ""


def test_under_a_running_event_loop_and_closed_when_collected() -> None:
    """As in a Jupyter cell: the caller's thread runs an asyncio loop already."""
    sockets_before = _socket_fds()

    async def cell() -> tuple[int, list[int]]:
        asyncio.get_running_loop()  # there is one, and the client does not use it
        client = tensorrpc.BlockingClient(Calculator, bind="tcp://127.0.0.1:0")
        with engine_processes(Calculator, client.addresses[0]):
            client.wait_for_engines(1, timeout=60)
            result = client.call(Calculator.add, 40, 2)
            items = list(client.stream(Calculator.count, 3))
        assert len(_loop_threads()) == 1
        del client  # neither closed nor in a `with`: the finalizer closes it
        gc.collect()
        return result, items

    assert asyncio.run(cell()) == (42, [0, 1, 2])
    assert _loop_threads() == []
    # ZMQ's I/O thread closes a socket's descriptors asynchronously: wait for them, bounded.
    deadline = time.monotonic() + 10
    while _socket_fds() > sockets_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _socket_fds() <= sockets_before


def test_bad_arguments_leave_no_thread() -> None:
    with pytest.raises(ValueError, match="bind"):
        tensorrpc.BlockingClient(Calculator)
    with pytest.raises(tensorrpc.ConnectError):
        tensorrpc.BlockingClient(Calculator, bind="nonsense://x")
    assert _loop_threads() == []


def test_request_streams_take_plain_iterators_and_metadata_comes_back() -> None:
    from tests.integration.services import Chunk, Streams

    pulled_in: set[str] = set()

    def chunks(n: int) -> Iterator[Chunk]:
        for i in range(n):
            pulled_in.add(threading.current_thread().name)
            yield Chunk(i, np.full(3, i, dtype=np.int64))

    with (
        tensorrpc.BlockingClient(Streams, bind="tcp://127.0.0.1:0") as client,
        engine_processes(Streams, client.addresses[0]),
    ):
        client.wait_for_engines(1, timeout=60)
        assert client.call(Streams.upload, chunks(40)) == sum(3 * i for i in range(40))
        assert client.stub().first([4, 5]) == 4
        view = client.with_options(metadata={"tag": "b1"})
        with view.stream(Streams.echo, iter(["x", "y"])) as stream:  # type: ignore[arg-type]
            assert list(stream) == ["X", "Y"]
        assert list(client.stub().echo(msgs=["z"])) == ["Z"]
        value, metadata = client.call_with_metadata(Streams.upload, chunks(2))  # type: ignore[call-overload]
        assert (value, dict(metadata)) == (3, {"items": "2"})
        with pytest.raises(tensorrpc.ValidationError, match=r"chunks\[1\]"):
            client.call(Streams.upload, [Chunk(0, np.zeros(1, dtype=np.int64)), "bad"])  # type: ignore[list-item]
    # The caller's iterator ran in worker threads, never on the caller's or the loop's.
    assert pulled_in
    assert threading.current_thread().name not in pulled_in
    assert "tensorrpc-blocking-client" not in pulled_in
