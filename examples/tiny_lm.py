"""A tiny decoder-only transformer with fixed random weights, for the demo.

It is a real model (embeddings, causal self-attention, MLP, greedy decoding with a KV
cache), just small and untrained: the same seed gives the same weights in every process,
so every engine generates the same tokens for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

VOCAB = 512
DIM = 64
HEADS = 4
LAYERS = 2
MAX_LEN = 256


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(DIM, dim=-1)
        q, k, v = (z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, DIM))
        x = x + self.mlp(self.norm2(x))
        return x, (k, v)


class TinyLM(nn.Module):
    """Token ids (and optional prompt embeddings) in, greedy tokens out."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.eval()

    @torch.inference_mode()
    def generate(
        self, prompt: list[int], max_tokens: int, prompt_embeds: torch.Tensor | None = None
    ) -> Iterator[int]:
        """Yield up to ``max_tokens`` greedy tokens, one at a time.

        ``prompt_embeds`` (shape ``[n, DIM]``) is prepended to the embedded prompt tokens,
        the way vLLM accepts prompt embeddings.
        """
        x = self.embed(torch.tensor([prompt], dtype=torch.long)) if prompt else None
        if prompt_embeds is not None:
            pe = prompt_embeds.to(torch.float32).reshape(1, -1, DIM)
            x = pe if x is None else torch.cat([pe, x], dim=1)
        if x is None:
            raise ValueError("need a prompt or prompt embeddings")
        x = x[:, -(MAX_LEN - max_tokens) :]
        caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * LAYERS
        pos = 0
        for _ in range(max_tokens):
            t = x.shape[1]
            h = x + self.pos(torch.arange(pos, pos + t)).unsqueeze(0)
            for i, block in enumerate(self.blocks):
                h, caches[i] = block(h, caches[i])
            token = int(self.head(self.norm(h[:, -1])).argmax(-1))
            yield token
            pos += t
            x = self.embed(torch.tensor([[token]]))
