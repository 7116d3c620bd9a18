"""A service for the engine tests, with gates the test opens to control each handler."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import anyio
import torch

from tensorrpc._service import rpc, service


@service
class Probe:
    """Unary, sync, streaming, blocking, failing and tensor methods, observable by tests."""

    def __init__(self) -> None:
        #: token -> "started" / "cancelled" / "finished" / "closed"
        self.events: dict[str, str] = {}
        #: token -> items a stream produced so far
        self.produced: dict[str, int] = {}
        self._gates: dict[str, anyio.Event] = {}
        self._started: dict[str, anyio.Event] = {}
        self._done: dict[str, anyio.Event] = {}
        #: Opened by tests to let ``sync_wait`` return.
        self.thread_gate = threading.Event()
        #: Set by ``sync_wait`` when its thread is done.
        self.thread_done = threading.Event()

    # -- helpers for the test side (same event loop) -------------------------------------

    def gate(self, token: str) -> anyio.Event:
        """The event a blocked handler waits on; set it to let the handler finish."""
        return self._gates.setdefault(token, anyio.Event())

    def started(self, token: str) -> anyio.Event:
        """Set once the handler registered under ``token`` runs."""
        return self._started.setdefault(token, anyio.Event())

    def done(self, token: str) -> anyio.Event:
        """Set once the handler (or stream) registered under ``token`` has ended."""
        return self._done.setdefault(token, anyio.Event())

    # -- methods -------------------------------------------------------------------------

    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    def mul(self, a: int, b: int) -> int:
        return a * b

    @rpc
    def sync_wait(self, token: str) -> str:
        self.events[token] = "started"
        self.thread_gate.wait(10.0)
        self.events[token] = "finished"
        self.thread_done.set()
        return token

    @rpc
    async def block(self, token: str) -> str:
        self.events[token] = "started"
        self.started(token).set()
        try:
            await self.gate(token).wait()
        except BaseException:
            self.events[token] = "cancelled"
            raise
        finally:
            self.done(token).set()
        self.events[token] = "finished"
        return token

    @rpc
    async def count(self, n: int, token: str = "") -> AsyncIterator[int]:
        self.started(token).set()
        try:
            for i in range(n):
                self.produced[token] = i + 1
                yield i
        finally:
            self.events[token] = "closed"
            self.done(token).set()

    @rpc
    async def fail(self, message: str) -> int:
        raise ValueError(message)

    @rpc
    async def fail_stream(self, after: int) -> AsyncIterator[int]:
        for i in range(after):
            yield i
        raise RuntimeError(f"stream broke after {after}")

    @rpc
    async def bad_result(self) -> int:
        wrong: object = "not an int"
        return wrong  # type: ignore[return-value]

    @rpc
    async def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @rpc
    async def tensors(self, seed: int, n: int) -> list[torch.Tensor]:
        """Fresh tensors, half of them non-contiguous views (sent via temporaries)."""
        gen = torch.Generator().manual_seed(seed)
        out: list[torch.Tensor] = []
        for i in range(n):
            base = torch.randn(64, 96, generator=gen)
            out.append(base.t() if i % 2 else base)
        return out
