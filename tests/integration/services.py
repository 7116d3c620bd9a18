"""Services shared by the client integration tests (imported by tests and engine processes)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import torch

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
