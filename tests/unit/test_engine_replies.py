"""Which of an engine's methods reply without a torch_shm placer: only those whose
result (or stream item) type can hold no tensor, so that skipping the placer there never
sends a tensor another way than the client asked."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from tensorrpc import describe, rpc, service
from tensorrpc._dispatch import scalar_results


@service
class Replies:
    @rpc
    async def count(self) -> int:
        return 1

    @rpc
    async def name(self) -> str:
        return ""

    @rpc
    async def nothing(self) -> None:
        return None

    @rpc
    async def tensor(self) -> torch.Tensor:
        return torch.zeros(1)

    @rpc
    async def pair(self) -> tuple[int, torch.Tensor]:
        return 1, torch.zeros(1)

    @rpc
    async def maybe(self) -> torch.Tensor | None:
        return None

    @rpc
    async def table(self) -> dict[str, torch.Tensor]:
        return {}

    @rpc
    async def tensors(self) -> AsyncIterator[torch.Tensor]:
        yield torch.zeros(1)

    @rpc
    async def numbers(self) -> AsyncIterator[float]:
        yield 1.0


def test_only_methods_whose_results_hold_no_tensor_skip_the_placer() -> None:
    assert scalar_results(describe(Replies)) == {"count", "name", "nothing", "numbers"}
