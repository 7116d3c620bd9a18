"""One demo engine process: ``python -m examples.demo_engine --connect ADDR --engine-id ID``.

SIGTERM and SIGINT drain the engine: running calls finish, BYE is sent, then it exits.
"""

from __future__ import annotations

import argparse
import logging
import signal

import anyio
import torch

import tensorrpc
from examples.lm_service import LMEngine


async def _serve(address: str, engine_id: str, seed: int) -> None:
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        await tensorrpc.serve(LMEngine(seed), connect=address, engine_id=engine_id)
        tg.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connect", required=True, help="the client's address to dial")
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.WARNING, format=f"[{args.engine_id}] %(levelname)s %(message)s"
    )
    anyio.run(_serve, args.connect, args.engine_id, args.seed)


if __name__ == "__main__":
    main()
