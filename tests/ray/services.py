"""Services the Ray actors construct (importable on every node of the test cluster)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import anyio
import ray
import torch

from tensorrpc import rpc, service


@service
class Where:
    """Says where it runs; sleeps on demand (to have calls in flight)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    @rpc
    async def where(self) -> dict[str, str]:
        return {
            "node": str(ray.get_runtime_context().get_node_id()),
            "pid": str(os.getpid()),
            "tag": self.tag,
        }

    @rpc
    async def sleep(self, seconds: float) -> int:
        await anyio.sleep(seconds)
        return os.getpid()

    @rpc
    def double(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


@service
class Broken:
    """Fails in its constructor: the launch must say so."""

    def __init__(self) -> None:
        raise RuntimeError("no model weights here")

    @rpc
    async def ping(self) -> str:
        return "pong"
