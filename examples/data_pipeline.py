"""A data pipeline: a ``DataLoader`` with workers feeds an engine, batches go by alias.

    python -m examples.data_pipeline [--batches 8] [--batch-size 64] [--workers 2]

The shape of a training or scoring job that keeps its model in another process:

* A ``torch.utils.data.DataLoader`` with ``num_workers > 0`` builds each batch in a worker
  process; torch hands it to this process in its own shared memory (``share_memory_()``
  files, either sharing strategy). That is already shared memory, so sending the batch
  to an engine on this host copies nothing: ``torch_shm`` sends a handle and the engine
  maps the same pages (when its gate holds: the same user, the same pid and user
  namespaces, and no privilege this process lacks; see docs/security.md). Otherwise it
  is copied once into tensorrpc's sealed pool, and still arrives.
* The engine's handler (``Trainer.step``) reads the batch where it lies and keeps
  nothing; the loader's next batch is a new one, so nothing is overwritten under it.
* The client talks to the engine over ``ipc://``: on one host the kernel attests the
  peer's identity there, which ``torch_shm`` needs (over tcp, tensors go as frames).
* The loader's workers are forked before the client starts (forking a process that holds
  sockets and threads is unsafe), and ``next()`` on the loader blocks: it runs in a
  thread (``anyio.to_thread``) so that the client's event loop keeps serving heartbeats
  and replies meanwhile.

The program starts one engine process (``tensorrpc.testing.serve_engines``), checks every
answer against the same computation done here, prints how many batches went by alias
(the client's torch_shm statistics) and exits 0 only if all of them did, leaving no
process or memory behind.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import anyio
import anyio.to_thread
import torch
import torch.utils.data

from tensorrpc import rpc, service
from tensorrpc.testing import serve_engines

#: Each sample: a 3x64x64 float32 image (48 KiB) and an int64 label.
SHAPE = (3, 64, 64)


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A synthetic image dataset: sample ``i`` is filled with ``i`` and labelled ``i % 10``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full(SHAPE, float(i)), torch.tensor(i % 10)


def score(images: torch.Tensor, labels: torch.Tensor) -> float:
    """What the engine computes for a batch (a stand-in for a model's step)."""
    return float(images.mean(dim=(1, 2, 3)).sub(labels).square().mean())


@service
class Trainer:
    """The engine: reads each batch in place and answers a number."""

    @rpc
    async def step(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """One step on a batch; the batch is read where it lies and not kept."""
        return score(images, labels)


async def main(batches: int = 8, batch_size: int = 64, workers: int = 2) -> dict[str, float]:
    """Feed ``batches`` batches to one engine process; return what was measured."""
    loader = torch.utils.data.DataLoader(
        Images(batches * batch_size), batch_size=batch_size, num_workers=workers
    )
    # The workers are forked now, before the client opens sockets and starts threads
    # (forking a process that holds them is unsafe); they prefetch meanwhile.
    it = iter(loader)
    with tempfile.TemporaryDirectory(prefix="tensorrpc-pipeline-") as tmp:
        async with serve_engines(
            Trainer, isolation="process", address=f"ipc://{tmp}/client.sock"
        ) as client:
            before = client.statistics().transports
            started = time.perf_counter()
            sent = 0
            while (batch := await anyio.to_thread.run_sync(next, it, None)) is not None:
                images, labels = batch
                got = await client.call(Trainer.step, images, labels)
                assert got == score(images, labels), (got, score(images, labels))
                sent += 1
            elapsed = time.perf_counter() - started
            after = client.statistics().transports
            engine_pid = next(iter(client.engines.values())).pid
    assert sent == batches, sent
    aliased = 0
    if after.torch_shm_detail is not None:
        was = before.torch_shm_detail.tensors_aliased if before.torch_shm_detail else 0
        aliased = after.torch_shm_detail.tensors_aliased - was
    return {
        "batches": float(sent),
        "ms_per_batch": elapsed / sent * 1e3,
        "aliased": float(aliased),
        "by_handle": float(after.torch_shm.tensors_sent - before.torch_shm.tensors_sent),
        "engine_pid": float(engine_pid),
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8, help="batches to send")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = parser.parse_args()
    report = anyio.run(main, args.batches, args.batch_size, args.workers)
    n = int(report["batches"])
    print(
        f"{n} DataLoader batches read by the engine, every answer checked: "
        f"{report['ms_per_batch']:.2f} ms per batch (engine pid {report['engine_pid']:.0f})"
    )
    # Each batch holds one images tensor big enough for torch_shm (the labels are tiny).
    print(
        f"{int(report['aliased'])} of {n} image batches went by alias "
        f"({int(report['by_handle'])} tensors by torch_shm handle in all)"
    )
    sys.exit(0 if report["aliased"] >= n else 3)


if __name__ == "__main__":  # spawned workers and the engine import this module
    cli()
