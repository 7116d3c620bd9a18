"""One measurement routine for peers whose client API is blocking and whose client
side must itself run in a child process (torch.distributed.rpc, Ray).

Such a child receives a JSON config, runs :func:`sync_suite` and prints the result as
one JSON line; :func:`run_json_child` is the parent's side: it starts the child in its
own process group, bounds it by a timeout and kills the whole group past it (so helper
processes the system spawned are reaped too).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench._common import unavailable
from bench._measure import Budget, summarize, time_sync
from bench.peers._proc import ROOT, child_env


def sync_suite(
    config: dict[str, Any],
    *,
    call_add: Callable[[], object],
    submit_add: Callable[[], Any],
    wait: Callable[[Any], object],
    consume: Callable[[Any], Any],
) -> dict[str, Any]:
    """Small call, pipelined window and tensor sizes for a blocking client.

    Args:
        config: ``{"small": Budget fields, "pipelined": {"inflight", "total", "seconds",
            "warmup"}, "sizes": {bytes: Budget fields}}``; an empty ``sizes`` skips them.
        call_add: one small call, blocking.
        submit_add: start one small call, returning a handle for ``wait``.
        wait: block until the call behind a handle completes.
        consume: send a tensor, blocking; return the reply ``(numel, first, last)``.
    """
    from bench.transfer import make_tensor

    out: dict[str, Any] = {"sizes": {}}
    out["small"] = summarize(time_sync(call_add, Budget(**config["small"])))

    pipe = config["pipelined"]
    inflight = int(pipe["inflight"])

    def window(total: int, seconds: float) -> tuple[int, float]:
        start = time.perf_counter()
        handles = [submit_add() for _ in range(min(inflight, total))]
        sent, done = len(handles), 0
        while handles:
            wait(handles.pop(0))
            done += 1
            if sent < total and time.perf_counter() - start < seconds:
                handles.append(submit_add())
                sent += 1
        return done, time.perf_counter() - start

    window(int(pipe["warmup"]), float(pipe["seconds"]))
    calls, elapsed = window(int(pipe["total"]), float(pipe["seconds"]))
    out["pipelined"] = {
        "calls": calls,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed,
        "inflight": inflight,
    }
    out["sizes"] = sizes_suite(config, consume, make_tensor)
    return out


def sizes_suite(
    config: dict[str, Any],
    send: Callable[[Any], Any],
    make: Callable[[int], Any],
    *,
    direction: str = "in",
) -> dict[str, Any]:
    """Time ``send`` per tensor size, after checking its reply once per size.

    ``direction="in"``: ``send(payload)`` sends ``make(size)`` and the reply is ``(numel,
    first, last)``. ``"out"``: ``send(size)`` asks for a tensor (or array) of ``size``
    bytes and the reply is that tensor, checked like :func:`bench.transfer.check_tensor`.
    """
    from bench.transfer import check, check_tensor

    out: dict[str, Any] = {}
    for size, budget in config["sizes"].items():
        try:
            if direction == "in":
                arg = make(int(size))
                check(send(arg), int(size))
            else:
                arg = int(size)
                check_tensor(send(arg), int(size))
            out[size] = summarize(time_sync(functools.partial(send, arg), Budget(**budget)))
            del arg
        except Exception as exc:
            out[size] = unavailable(exc)
    return out


def emit(result: dict[str, Any]) -> None:
    """Print a child's result as its last stdout line."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_json_child(module: str, args: list[str], *, timeout: float) -> dict[str, Any]:
    """Run ``python -m module *args`` in its own process group; return its JSON line.

    Raises:
        RuntimeError: the child failed, printed no result, or ran past ``timeout``
            (then its whole process group is killed).
    """
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
        try:
            try:
                stdout, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{module}: no result within {timeout:.0f}s") from None
            if proc.returncode != 0:
                log.seek(0)
                tail = log.read()[-1500:].decode("utf-8", "replace").strip()
                raise RuntimeError(f"{module} exited {proc.returncode}: {tail}")
            lines = stdout.decode().strip().splitlines()
            if not lines:
                raise RuntimeError(f"{module} printed no result")
            result: dict[str, Any] = json.loads(lines[-1])
            return result
        finally:
            # the child's helpers (if any) share its process group
            _kill_group(proc)
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
