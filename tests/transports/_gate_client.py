"""A client program for the alias-gate test (not a test module): run under ``setpriv``.

``python -m tests.transports._gate_client ADDRESS`` sends one ``share_memory_()`` tensor
of each torch sharing strategy to the engine at ADDRESS (``fill`` writes into what the
engine received) and prints one JSON line: what came back, whether the engine's writes
showed in our tensors, our torch_shm counters and the engine's.
"""

from __future__ import annotations

import json
import sys

import anyio
import torch
import torch.multiprocessing as tmp

from tensorrpc._client import Client
from tests.transports._engine import TensorService

N = 1 << 16


async def main(address: str) -> None:
    # Made before the session: the first file_system tensor starts torch's shm manager,
    # which blocks this thread (the event loop) for seconds under load, longer than the
    # engine's bound on a silent client.
    tensors = []
    for strategy in ("file_descriptor", "file_system"):
        tmp.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
        tensors.append(torch.zeros(N).share_memory_())  # type: ignore[no-untyped-call]
    async with Client(TensorService, connect=address, heartbeat_interval=0.2) as client:
        await client.wait_for_engines(1, timeout=60)
        stub = client.with_options(transport="torch_shm").stub()
        sums, untouched = [], []
        for x in tensors:
            sums.append(await stub.fill(x, 3.0))
            untouched.append(int(torch.count_nonzero(x)) == 0)
        detail = client.statistics().transports.torch_shm_detail
        assert detail is not None
        print(
            json.dumps(
                {
                    "sums": sums,
                    "untouched": untouched,
                    "sent": detail.tensors_sent,
                    "aliased": detail.tensors_aliased,
                    "fallbacks": detail.fallbacks,
                    "frames_sent": client.statistics().transports.frames.tensors_sent,
                    "engine": await stub.shm_state(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
