"""Services shared by the client integration tests (imported by tests and engine processes)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import numpy as np
import torch

from tensorrpc import call_context
from tensorrpc._service import rpc, service


@service
class Calculator:
    """A small service exercising unary, sync, streaming, tensor and failing methods."""

    def __init__(self, engine_id: str = "") -> None:
        self.engine_id = engine_id
        #: token -> what happened to the handler registered under it
        self.events: dict[str, str] = {}
        #: token -> how many items a stream produced so far
        self.produced: dict[str, int] = {}

    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    def mul(self, a: int, b: int) -> int:
        return a * b

    @rpc
    async def whoami(self) -> str:
        return self.engine_id

    @rpc
    async def pid(self) -> int:
        return os.getpid()

    @rpc
    async def echo(self, tag: str) -> str:
        await anyio.lowlevel.checkpoint()
        return f"{self.engine_id}:{tag}"

    @rpc
    async def sleep(self, seconds: float, token: str = "") -> str:
        self.events[token] = "started"
        try:
            await anyio.sleep(seconds)
        except BaseException:
            self.events[token] = "cancelled"
            raise
        self.events[token] = "finished"
        return token

    @rpc
    async def event(self, token: str) -> str:
        return self.events.get(token, "")

    @rpc
    async def produced_count(self, token: str) -> int:
        return self.produced.get(token, 0)

    @rpc
    async def fail(self, message: str) -> int:
        raise ValueError(message)

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    @rpc
    async def forever(self, token: str) -> AsyncIterator[int]:
        self.events[token] = "started"
        self.produced[token] = 0
        i = 0
        try:
            while True:
                yield i
                i += 1
                self.produced[token] = i
        except BaseException:
            self.events[token] = "cancelled"
            raise
        finally:
            if self.events[token] != "cancelled":
                self.events[token] = "closed"

    @rpc
    async def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor


@service(name="Calculator")
class CalculatorV2:
    """Same service name as :class:`Calculator` but another signature: fingerprints differ."""

    @rpc
    async def add(self, a: int, b: int, c: int) -> int:
        return a + b + c


@dataclass
class Chunk:
    seq: int
    data: np.ndarray


@service
class Streams:
    """Client streaming and bidirectional methods (tests/integration/test_request_streams.py)."""

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.taken: list[int] = []
        self.closed: list[str] = []
        self.gated_closed = anyio.Event()
        self.kept: list[torch.Tensor] = []

    @rpc
    async def upload(self, chunks: AsyncIterator[Chunk]) -> int:
        total = n = 0
        async for chunk in chunks:
            total += int(chunk.data.sum())
            n += 1
        call_context().set_response_metadata({"items": str(n)})
        return total

    @rpc
    async def first(self, xs: AsyncIterator[int]) -> int:
        async for x in xs:
            return x  # returns before the request stream ends
        return -1

    @rpc
    async def echo(self, msgs: AsyncIterator[str]) -> AsyncIterator[str]:
        ctx = call_context()
        ctx.set_response_metadata({"seen": ctx.metadata.get("tag", "")})
        async for m in msgs:
            yield m.upper()

    @rpc
    async def gated(self, xs: AsyncIterator[int]) -> AsyncIterator[int]:
        """Takes one item, then waits for the gate before taking more: a slow reader."""
        try:
            async for x in xs:
                self.taken.append(x)
                yield x
                await self.gate.wait()
        finally:
            self.closed.append("gated")
            self.gated_closed.set()

    @rpc
    async def doubles(self, xs: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
        async for x in xs:
            yield x * 2

    @rpc
    async def tensors(self, xs: AsyncIterator[torch.Tensor]) -> AsyncIterator[torch.Tensor]:
        async for x in xs:
            yield x * 2

    @rpc
    async def keep(self, xs: AsyncIterator[torch.Tensor]) -> int:
        """Keeps its items past the call (they must keep their values: torch_shm)."""
        self.kept = [x async for x in xs]
        return len(self.kept)

    @rpc
    async def recall(self) -> torch.Tensor:
        return torch.stack(self.kept)

    @rpc
    async def hold(self, xs: AsyncIterator[torch.Tensor]) -> int:
        """Takes one item, keeps it and never ends (the client gives up)."""
        async for x in xs:
            self.kept = [x]
            await anyio.sleep(3600)
        return 0

    @rpc
    async def fails_at(self, xs: AsyncIterator[int]) -> int:
        async for x in xs:
            if x == 3:
                raise ValueError(f"boom at {x}")
        return 0

    @rpc
    async def sleepy(self, xs: AsyncIterator[int]) -> int:
        async for _ in xs:
            await anyio.sleep(3600)
        return 0
