"""torch_shm's large copies run on a worker thread, not on the event loop (issue 26).

Placing a tensor by handle copies its bytes into our sealed pool (`_Fill.run`), and an
engine that still holds an argument tensor when it replies gives it private pages first
(`privatize`). For a large tensor either is milliseconds of ``memmove`` (tens of them at
64 MiB): the shells run them on a worker thread (the copies release the GIL), so a small
call beside them is not stalled. Each test records the thread that ran them; nothing is
timed. torch_shm needs two processes: the side under test runs here, its peer is a
subprocess.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tensorrpc import _codec
from tensorrpc._client import Client
from tensorrpc._server import Server
from tensorrpc.transports import _shm_recv, torch_shm
from tests import _forkserver
from tests.engine_proc import ROOT, EngineProcess
from tests.transports._engine import TensorService, digest

LARGE = 4 << 20  # above the release threshold (1 MiB): copied off the loop
SMALL = 64 << 10  # by handle too (transport="torch_shm"), but copied inline
WAIT = 60.0
CONFIG = _codec.CodecConfig()

pytestmark = pytest.mark.skipif(
    not torch_shm.TorchShmTransport.available(), reason="torch_shm needs Linux memfds"
)


class Threads:
    """Which thread ran each watched copy: ``(what, nbytes, on the loop)``."""

    def __init__(self, loop: int) -> None:
        self.loop = loop
        self.records: list[tuple[str, int, bool]] = []

    def wrap(self, what: str, fn: Callable[..., Any], size: Callable[..., int]) -> Any:
        def watched(*args: Any) -> Any:
            self.records.append((what, size(*args), threading.get_ident() == self.loop))
            return fn(*args)

        return watched

    def of(self, what: str) -> list[tuple[int, bool]]:
        """``(nbytes, ran on the loop)`` of each ``what``, in order."""
        return [(n, on_loop) for w, n, on_loop in self.records if w == what]


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> Threads:
    watcher = Threads(threading.get_ident())  # (the test's thread runs the event loop)
    fill = torch_shm._Fill.run
    monkeypatch.setattr(torch_shm._Fill, "run", watcher.wrap("fill", fill, lambda j, _: j.nbytes))
    privatize = _shm_recv.privatize  # type: ignore[attr-defined]
    monkeypatch.setattr(
        _shm_recv, "privatize", watcher.wrap("privatize", privatize, lambda _, n: n)
    )
    return watcher


# -- the client's copies (the engine is a subprocess) ---------------------------------------


@pytest.fixture
def engine(tmp_path: Path):
    with EngineProcess(
        "tensor-engine", workdir=tmp_path, bind=f"ipc://{tmp_path}/engine.sock", service="tensor"
    ) as proc:
        yield proc


async def test_a_large_argument_is_copied_off_the_loop(
    engine: EngineProcess, threads: Threads
) -> None:
    with anyio.fail_after(WAIT):
        async with Client(TensorService, connect=engine.address()) as client:
            await client.wait_for_engines(1)
            stub = client.with_options(transport="torch_shm").stub()
            x = torch.arange(LARGE, dtype=torch.uint8)
            assert await stub.digest(x) == digest(x)
            assert threads.of("fill") == [(LARGE, False)]
            small = torch.arange(SMALL, dtype=torch.uint8)
            assert await stub.digest(small) == digest(small)
    # A small copy stays inline: a thread hop would cost more than the copy.
    assert threads.of("fill") == [(LARGE, False), (SMALL, True)]


async def test_a_call_cancelled_during_its_copy_lets_it_end_then_releases_it(
    engine: EngineProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, go = threading.Event(), threading.Event()
    order: list[str] = []
    run = torch_shm._Fill.run

    def held(job: Any, warmer: Any) -> None:
        started.set()
        go.wait(WAIT)  # (bounded: a copy on the loop would block it until then, and fail)
        run(job, warmer)
        order.append("copied")

    monkeypatch.setattr(torch_shm._Fill, "run", held)
    with anyio.fail_after(WAIT):
        async with Client(TensorService, connect=engine.address()) as client:
            await client.wait_for_engines(1)
            stub = client.with_options(transport="torch_shm").stub()
            shm = client._io.policy.shm
            assert shm is not None
            release = shm.release

            def released(lease: int, **kw: Any) -> bool:
                order.append("released")
                return release(lease, **kw)

            monkeypatch.setattr(shm, "release", released)
            scope = anyio.CancelScope()

            async def call() -> None:
                with scope:
                    await stub.digest(torch.ones(LARGE, dtype=torch.uint8))

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.to_thread.run_sync(started.wait, WAIT)
                scope.cancel()
                go.set()
            assert scope.cancelled_caught
            # The cancellation took effect once the copy had ended (the thread is not
            # abandoned), and the call's lease is given back as for any cancelled call.
            while (  # noqa: ASYNC110 - bounded by fail_after; the engine answers the CANCEL
                client.statistics().transports.torch_shm_detail.leases_active  # type: ignore[union-attr]
            ):
                await anyio.sleep(0.01)
            assert order[0] == "copied"
            assert "released" in order
            monkeypatch.setattr(torch_shm._Fill, "run", run)
            x = torch.arange(LARGE, dtype=torch.uint8)
            assert await stub.digest(x) == digest(x)  # the client goes on as before


# -- the engine's copies (the client is a subprocess) ---------------------------------------


async def test_large_results_and_an_echoed_argument_are_copied_off_the_loop(
    tmp_path: Path, threads: Threads
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    with anyio.fail_after(WAIT):
        async with Server(TensorService(), engine_id="e1", bind=address):
            # Forked from the zygote (tests/_forkserver.py): a process of its own, without
            # a fresh interpreter's torch import; waited for on a thread, as the engine
            # it calls runs on this loop.
            done = await anyio.to_thread.run_sync(
                partial(
                    _forkserver.run,
                    [sys.executable, "-m", "tests.transports._copy_client", address, str(LARGE)],
                    cwd=ROOT,
                    capture_output=True,
                    timeout=WAIT,
                )
            )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.strip() == b"ok"
    # make's result, echo's and echo_kept's: the engine's pool copies ...
    assert threads.of("fill") == [(LARGE, False)] * 3
    # ... echo's argument was copied into the pool before the detach and was dead by then
    # (no private pages: 64 MiB of them cost tens of ms); echo_kept's, alive past the
    # reply, gets pages of its own.
    assert threads.of("privatize") == [(LARGE, False)]


# -- the placer's deferred copies (transport level, one process) ---------------------------


def test_a_deferred_copy_waits_for_fill() -> None:
    with torch_shm.TorchShmTransport() as sender, torch_shm.TorchShmTransport() as receiver:
        placer = sender.placer("peer", defer_bytes=LARGE)
        big = torch.arange(LARGE, dtype=torch.uint8)
        small = torch.arange(SMALL, dtype=torch.uint8)
        encoded = _codec.encode([big, small], CONFIG, placer=placer)
        assert placer.pending_bytes == LARGE  # the small one was copied inline
        placer.fill()
        assert placer.pending_bytes == 0
        resolver = receiver.resolver(None)
        got = _codec.decode(encoded.payload, encoded.buffers, CONFIG, resolver=resolver)
        assert torch.equal(got[0], big)
        assert torch.equal(got[1], small)


def test_an_aborted_placer_never_runs_its_deferred_copies(threads: Threads) -> None:
    with torch_shm.TorchShmTransport() as sender:
        placer = sender.placer("peer", defer_bytes=1)
        _codec.encode(torch.ones(SMALL, dtype=torch.uint8), CONFIG, placer=placer)
        lease = placer.lease
        assert lease is not None
        assert sender.leased(lease)
        placer.abort()
        assert not sender.leased(lease)
        assert placer.pending_bytes == 0
        placer.fill()  # nothing left: the region may already be someone else's
    assert threads.of("fill") == []
