"""An engine whose batched handler never returns: ``python -m tests.integration.batch_engine
ADDR`` dials the client at ``ADDR`` (for the kill -9 test of tests/integration/test_batching.py).
"""

from __future__ import annotations

import sys

import anyio

import tensorrpc
from tensorrpc import Batching, rpc, service


@service
class Hang:
    def __init__(self) -> None:
        self.running = 0

    @rpc(batch=Batching(max_size=4, max_delay=0.05))
    async def hang(self, x: list[int]) -> list[int]:
        self.running = len(x)
        await anyio.sleep_forever()
        return x

    @rpc
    async def batch_size(self) -> int:
        return self.running


if __name__ == "__main__":
    anyio.run(lambda: tensorrpc.serve(Hang(), connect=sys.argv[1], engine_id="hang"))
