"""A client program for the lifetime tests (not a test module): ``kill -9`` target.

``python -m tests.transports._client_proc ADDRESS`` connects to the engine at ADDRESS,
prints ``running`` once calls with torch_shm tensors both ways are flowing, and keeps
calling until it is killed.
"""

from __future__ import annotations

import sys

import anyio
import torch

from tensorrpc._client import Client
from tests.transports._engine import TensorService


async def main(address: str) -> None:
    async with Client(TensorService, connect=address, heartbeat_interval=0.2) as client:
        await client.wait_for_engines(1, timeout=60)
        stub = client.with_options(transport="torch_shm").stub()
        x = torch.ones(1 << 18)
        announced = False

        async def worker() -> None:
            nonlocal announced
            while True:
                await stub.echo(x)
                await stub.make("float32", [1 << 17], 1)
                if not announced:
                    announced = True
                    print("running", flush=True)

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(worker)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
