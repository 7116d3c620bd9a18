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

    def decode(
        self, x: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One new token for each of ``b`` sequences whose caches differ in length.

        The caches are padded to the longest and masked: one attention call for the batch.
        """
        b = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split(DIM, dim=-1)
        q, k, v = (z.view(b, 1, HEADS, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        new = [
            (torch.cat([ck, k[i : i + 1]], dim=2), torch.cat([cv, v[i : i + 1]], dim=2))
            for i, (ck, cv) in enumerate(caches)
        ]
        longest = max(ck.shape[2] for ck, _ in new)
        keys = q.new_zeros(b, HEADS, longest, DIM // HEADS)
        values = torch.zeros_like(keys)
        mask = torch.zeros(b, 1, 1, longest, dtype=torch.bool)
        for i, (ck, cv) in enumerate(new):
            n = ck.shape[2]
            keys[i, :, :n] = ck[0]
            values[i, :, :n] = cv[0]
            mask[i, ..., :n] = True
        attn = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, 1, DIM))
        x = x + self.mlp(self.norm2(x))
        return x, new


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
        x = self._prompt(prompt, max_tokens, prompt_embeds)
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

    def _prompt(
        self, prompt: list[int], max_tokens: int, prompt_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embed(torch.tensor([prompt], dtype=torch.long)) if prompt else None
        if prompt_embeds is not None:
            pe = prompt_embeds.to(torch.float32).reshape(1, -1, DIM)
            x = pe if x is None else torch.cat([pe, x], dim=1)
        if x is None:
            raise ValueError("need a prompt or prompt embeddings")
        kept: torch.Tensor = x[:, -(MAX_LEN - max_tokens) :]
        return kept

    @torch.inference_mode()
    def prefill(self, prompt: list[int], max_tokens: int) -> tuple[int, Sequence]:
        """Read a prompt: its first greedy token, and the sequence's state for `decode`."""
        x = self._prompt(prompt, max_tokens, None)
        t = x.shape[1]
        h = x + self.pos(torch.arange(t)).unsqueeze(0)
        caches = []
        for block in self.blocks:
            h, cache = block(h, None)
            caches.append(cache)
        token = int(self.head(self.norm(h[:, -1])).argmax(-1))
        return token, Sequence(caches, t, token)

    @torch.inference_mode()
    def decode(self, sequences: list[Sequence]) -> list[int]:
        """One greedy token for each sequence, in one batched forward pass (continuous
        batching: the sequences may have started at different steps)."""
        tokens = torch.tensor([[s.last] for s in sequences])
        positions = torch.tensor([[s.length] for s in sequences])
        h = self.embed(tokens) + self.pos(positions)
        for layer, block in enumerate(self.blocks):
            assert isinstance(block, Block)
            h, new = block.decode(h, [s.caches[layer] for s in sequences])
            for s, cache in zip(sequences, new, strict=True):
                s.caches[layer] = cache
        out = self.head(self.norm(h[:, -1])).argmax(-1).tolist()
        for s, token in zip(sequences, out, strict=True):
            s.length += 1
            s.last = int(token)
        return [int(t) for t in out]


class Sequence:
    """One sequence being decoded: its KV caches, its length and its last token."""

    __slots__ = ("caches", "last", "length")

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], length: int, last: int):
        self.caches = caches
        self.length = length
        self.last = last
