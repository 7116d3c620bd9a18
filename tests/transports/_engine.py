"""A tensor engine program for the transport tests (not a test module).

Run as ``python -m tests.transports._engine --bind ipc://... --address-file F`` (listen) or
``--connect ADDR`` (dial-in). It is its own program, forked by tests/_forkserver.py
(``subprocess.Popen`` semantics): it shares nothing with the test process but the socket
address.
:class:`TensorEngine` starts one from a test and always reaps it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

import tensorrpc
from tensorrpc import rpc, service
from tests import _forkserver

ROOT = Path(__file__).resolve().parents[2]

#: The running engine's Server, so that handlers can report its transport statistics.
SERVER: Any = None


@dataclass
class Batch:
    """Tensors nested in a struct."""

    name: str
    first: torch.Tensor
    rest: list[torch.Tensor]


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and C-contiguous bytes."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def pattern(dtype: str, shape: list[int], seed: int) -> torch.Tensor:
    """A deterministic tensor of any dtype (random bytes; bool as 0/1)."""
    dt = getattr(torch, dtype)
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty((), dtype=dt).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dt == torch.bool:
        raw &= 1
    return raw.view(dt).reshape(shape)


@service
class TensorService:
    """What the transport tests call."""

    def __init__(self) -> None:
        self.board: torch.Tensor = tensorrpc.shared_empty(1 << 16, dtype=torch.float32)
        self.board.zero_()
        self._events: dict[str, anyio.Event] = {}

    @rpc
    async def echo(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @rpc
    async def digest(self, x: torch.Tensor) -> str:
        return digest(x)

    @rpc
    async def echo_many(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs

    @rpc
    async def echo_batch(self, batch: Batch) -> Batch:
        return batch

    @rpc
    async def make(self, dtype: str, shape: list[int], seed: int) -> torch.Tensor:
        return pattern(dtype, shape, seed)

    @rpc
    async def fill(self, x: torch.Tensor, value: float) -> float:
        """Write into the received tensor (visible to the caller only if it aliases)."""
        x.fill_(value)
        return float(x.sum())

    @rpc
    async def shared_board(self) -> torch.Tensor:
        """A tensor in tensorrpc shared memory: goes by alias under torch_shm."""
        return self.board

    @rpc
    async def bump_board(self, value: float) -> None:
        self.board.add_(value)

    @rpc
    async def hold(self, x: torch.Tensor, seconds: float) -> int:
        await anyio.sleep(seconds)
        return x.numel()

    @rpc
    async def gated_sum(self, x: torch.Tensor) -> float:
        """Hold the argument until ``open_gate``, then read it (bounded wait)."""
        self._event("gated").set()
        with anyio.fail_after(60):
            await self._event("gate").wait()
        return float(x.sum())

    def _event(self, name: str) -> anyio.Event:
        return self._events.setdefault(name, anyio.Event())

    @rpc
    async def wait_gated(self) -> None:
        """Return once a ``gated_sum`` call holds its argument (bounded wait)."""
        with anyio.fail_after(60):
            await self._event("gated").wait()

    @rpc
    async def open_gate(self) -> None:
        self._event("gate").set()

    @rpc
    async def items(self, n: int, size: int) -> AsyncIterator[torch.Tensor]:
        for i in range(n):
            yield torch.full((size,), float(i))

    @rpc
    async def shm_state(self) -> list[int]:
        """[leases_active, pool_bytes_in_use, tensors_sent, tensors_received,
        pool_segments, tensors_aliased] of the engine's torch_shm transport."""
        detail = SERVER.statistics().transports.torch_shm_detail
        if detail is None:
            return [-1] * 6
        return [
            detail.leases_active,
            detail.pool_bytes_in_use,
            detail.tensors_sent,
            detail.tensors_received,
            detail.pool_segments,
            detail.tensors_aliased,
        ]


class TensorEngine:
    """The engine program in a subprocess; a context manager that kills and reaps it."""

    def __init__(
        self,
        workdir: Path,
        *,
        bind: str | None = None,
        connect: str | None = None,
        torch_shm: bool = True,
    ) -> None:
        self.address_file = workdir / f"engine-{os.urandom(4).hex()}.addr"
        self.log_path = self.address_file.with_suffix(".log")
        args = [sys.executable, "-m", "tests.transports._engine"]
        if bind is not None:
            args += ["--bind", bind, "--address-file", str(self.address_file)]
        if connect is not None:
            args += ["--connect", connect]
        if not torch_shm:
            args.append("--no-torch-shm")
        self._log = self.log_path.open("wb")
        # Forked from a pre-imported interpreter (tests/_forkserver.py): a process of its
        # own, without the seconds of torch's import.
        self.proc = _forkserver.popen(
            args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def address(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                text = self.address_file.read_text()
                if text.endswith("\n"):
                    return text.strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited early:\n{self.output()}")
            time.sleep(0.02)
        raise TimeoutError(f"engine did not bind within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """``kill -9`` and reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful drain) and reap; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def __enter__(self) -> TensorEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self._log.close()


async def _serve(args: argparse.Namespace) -> None:
    global SERVER
    from tensorrpc._server import Server

    server = Server(
        TensorService(),
        engine_id="tensor-engine",
        connect=args.connect or None,
        bind=args.bind,
        heartbeat_interval=0.2,
        dead_after=2.0,
        grace_period=1.0,
        torch_shm=not args.no_torch_shm,
    )
    SERVER = server
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        async with server:
            if args.address_file:
                assert server.endpoint is not None
                _write_address(args.address_file, server.endpoint)
            await server.serve_forever()
        tg.cancel_scope.cancel()


def _write_address(path: str, address: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(address + "\n")
    tmp.rename(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bind")
    parser.add_argument("--connect")
    parser.add_argument("--address-file")
    parser.add_argument("--no-torch-shm", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="[engine] %(name)s %(message)s")
    anyio.run(_serve, args)


if __name__ == "__main__":
    main()
