"""The service the transport tests call (not a test module).

An engine serving it runs in its own process: ``tests.engine_proc.EngineProcess(...,
service="tensor")`` (``python -m tests.engine_proc --service tensor``).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

import tensorrpc
from tensorrpc import rpc, service

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
        self.kept: torch.Tensor | None = None

    @rpc
    async def echo(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @rpc
    async def echo_kept(self, x: torch.Tensor) -> torch.Tensor:
        """Send the argument back and keep it (alive past the reply) until the next call."""
        self.kept = x
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
        pool_segments, tensors_aliased, tensors_received_aliased] of the engine's
        torch_shm transport."""
        detail = SERVER.statistics().transports.torch_shm_detail
        if detail is None:
            return [-1] * 7
        return [
            detail.leases_active,
            detail.pool_bytes_in_use,
            detail.tensors_sent,
            detail.tensors_received,
            detail.pool_segments,
            detail.tensors_aliased,
            detail.tensors_received_aliased,
        ]
