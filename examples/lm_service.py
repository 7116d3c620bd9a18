"""The service the demo engines serve: a tiny language model with a vision-style encoder."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import torch

from examples.tiny_lm import DIM, TinyLM
from tensorrpc import Continuous, current_batch, rpc, service

PATCH = 32


@dataclass
class EngineStats:
    """What an engine reports about itself."""

    pid: int
    requests: int
    tokens: int
    images: int
    busy_seconds: float


@service(name="tiny-lm")
class LMEngine:
    """Generation and image encoding on one CPU engine."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = TinyLM(seed)
        # Fixed random patch projection: a 3x32x32 patch -> a DIM-wide embedding.
        self.patch_proj = (
            torch.randn(3 * PATCH * PATCH, DIM, generator=torch.Generator().manual_seed(seed))
            * 0.02
        )
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.images = 0
        self.busy = 0.0

    @rpc
    async def generate(
        self, prompt: list[int], max_tokens: int = 16, prompt_embeds: torch.Tensor | None = None
    ) -> AsyncIterator[int]:
        """Stream greedy tokens for a prompt of token ids and optional prompt embeddings."""
        self.requests += 1
        steps = self.model.generate(prompt, max_tokens, prompt_embeds)
        while True:
            start = time.perf_counter()
            token = await anyio.to_thread.run_sync(next, steps, None)
            self.busy += time.perf_counter() - start
            if token is None:
                return
            self.tokens += 1
            yield token

    @rpc(batch=Continuous(max_size=32, max_delay=0.0))
    def generate_batched(self, prompt: list[list[int]], max_tokens: list[int]) -> list[int]:
        """The tokens of ``generate`` (no prompt embeddings), with continuous batching.

        One step: a sequence that just joined reads its prompt (its first token); every
        other active sequence gets its next token from one batched forward pass.
        """
        start = time.perf_counter()
        batch = current_batch()
        out = [0] * batch.size
        decoding = []
        for i, item in enumerate(batch.items):
            if max_tokens[i] <= 0:  # nothing to generate: end without a token
                batch.end(i, send=False)
                continue
            if item.first:
                self.requests += 1
                out[i], item.state = self.model.prefill(prompt[i], max_tokens[i])
            else:
                decoding.append(i)
            if item.steps + 1 >= max_tokens[i]:
                batch.end(i)
        if decoding:
            tokens = self.model.decode([batch.items[i].state for i in decoding])
            for i, token in zip(decoding, tokens, strict=True):
                out[i] = token
        self.tokens += batch.size
        self.busy += time.perf_counter() - start
        return out

    @rpc
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """Turn a ``3 x H x W`` float image into ``(H/32 * W/32) x DIM`` patch embeddings."""
        start = time.perf_counter()
        c = image.shape[0]
        patches = image.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH)
        patches = patches.permute(1, 2, 0, 3, 4).reshape(-1, c * PATCH * PATCH)
        out = patches.to(torch.float32) @ self.patch_proj
        self.images += 1
        self.busy += time.perf_counter() - start
        return out

    @rpc
    async def stats(self) -> EngineStats:
        """Counters since start (or the last reset)."""
        return EngineStats(
            os.getpid(), self.requests, self.tokens, self.images, round(self.busy, 4)
        )

    @rpc
    async def reset(self) -> int:
        """Reset the counters; returns how many requests had been served."""
        served = self.requests
        self._reset_counters()
        return served

    @rpc
    async def sleep(self, seconds: float) -> float:
        """Hold a call for a while (the demo uses it to show deadlines and cancellation)."""
        await anyio.sleep(seconds)
        return seconds
