"""``torch.distributed.rpc`` with the TensorPipe backend on CPU.

Setup: two processes, both started by the benchmark: rank 1 (``server``) only serves,
rank 0 (``client``) makes the calls and prints its measurements as JSON on stdout.
They meet through ``init_method="tcp://127.0.0.1:PORT"`` (a free port picked by the
benchmark) and TensorPipe then chooses its own transports and channels for a pair of
processes on one host (shared memory where it can). ``TP_SOCKET_IFNAME=lo`` keeps it on
loopback. A call is ``rpc_sync("server", consume, args=(tensor,))`` and the reply is
``(numel, first, last)``; the small call is ``rpc_sync("server", add, args=(1, 2))``.
Pipelined calls keep N ``rpc_async`` futures outstanding and wait for them in order.
Both ranks end with ``rpc.shutdown()`` (a barrier); the benchmark bounds the whole
exchange with a timeout and kills both processes past it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import IO, Any

import torch

from bench.peers._proc import ROOT, child_env


def add(a: int, b: int) -> int:
    """The small call, run on the server rank."""
    return a + b


def consume(t: torch.Tensor) -> tuple[int, float, float]:
    """The tensor call, run on the server rank."""
    return (t.numel(), float(t[0]), float(t[-1]))


def _client(config: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.rpc as rpc

    from bench.peers._suite import sync_suite

    return sync_suite(
        config,
        call_add=functools.partial(rpc.rpc_sync, "server", add, args=(1, 2)),
        submit_add=functools.partial(rpc.rpc_async, "server", add, args=(1, 2)),
        wait=lambda fut: fut.wait(),
        consume=lambda t: rpc.rpc_sync("server", consume, args=(t,)),
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_pair(config: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Run both ranks (from the benchmark process); return the client's measurements.

    Args:
        config: ``{"small": Budget fields, "pipelined": {...}, "sizes": {bytes: Budget
            fields}}``.
        timeout: seconds for the whole exchange; both processes are killed past it.

    Raises:
        RuntimeError: a rank failed; the message carries its stderr tail.
    """
    port = free_port()
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(2)]
        return _run_ranks(config, port, logs, timeout)


def _run_ranks(
    config: dict[str, Any], port: int, logs: Sequence[IO[bytes]], timeout: float
) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in (1, 0):
            cmd = [sys.executable, "-m", "bench.peers.torch_rpc_peer"]
            cmd += ["--rank", str(rank), "--port", str(port), "--timeout", str(timeout)]
            if rank == 0:
                cmd += ["--config", json.dumps(config)]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=child_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stderr=logs[rank],
                )
            )
        server, client = procs
        try:
            stdout, _ = client.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"torch.distributed.rpc: no result within {timeout:.0f}s") from None
        if client.returncode != 0:
            logs[0].seek(0)
            tail = logs[0].read()[-1500:].decode("utf-8", "replace").strip()
            raise RuntimeError(f"torch.distributed.rpc client exited {client.returncode}: {tail}")
        server.wait(timeout=30)
        result: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
        return result
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def main() -> None:
    """Rank entry point: ``python -m bench.peers.torch_rpc_peer --rank R --port P``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    # torch's own deprecation notice from inside init_rpc; nothing we call
    warnings.filterwarnings("ignore", message="You are using a Backend")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{args.port}",
        rpc_timeout=args.timeout,
        num_worker_threads=4,
    )
    name = "client" if args.rank == 0 else "server"
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        name, rank=args.rank, world_size=2, rpc_backend_options=options
    )
    result: dict[str, Any] | None = None
    try:
        if args.rank == 0:
            result = _client(json.loads(args.config))
    finally:
        rpc.shutdown()
    if result is not None:
        from bench.peers._suite import emit

        emit(result)


if __name__ == "__main__":
    main()
