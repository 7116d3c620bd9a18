"""A data pipeline: a ``DataLoader`` with workers feeds an engine, batches go by alias.

    python -m examples.data_pipeline [--batches 8] [--batch-size 64] [--workers 2]

The shape of a training or scoring job that keeps its model in another process:

* A ``torch.utils.data.DataLoader`` with ``num_workers > 0`` builds each batch in a worker
  process. Its ``collate_fn`` is `tensorrpc.loader.SharedBatches.collate`: the worker
  stacks the samples straight into a *slot*, tensorrpc shared memory made before the
  workers started, and this process rebuilds the batch on that slot. Sending it to an
  engine on this host copies nothing: ``torch_shm`` sends a handle, and from a slot's
  second batch on the engine already has the slot mapped (a plain ``DataLoader`` batch
  is a new file of torch's each time, which the engine must take and map: about 0.4 ms
  more per call at 64 MiB, and it goes by alias only past the unsealed-alias gate; see
  docs/transports.md).
* The engine's handler (``Trainer.step``) reads the batch where it lies and keeps
  nothing: a slot is written again once its batch is gone here and its call returned,
  so a handler that kept a batch would have to ``.clone()`` it.
* The client talks to the engine over ``ipc://``: on one host the kernel attests the
  peer's identity there, which ``torch_shm`` needs (over tcp, tensors go as frames).
* The loader's workers are forked before the client starts (forking a process that holds
  sockets and threads is unsafe), and ``next()`` on the loader blocks: it runs in a
  thread (``anyio.to_thread``) so that the client's event loop keeps serving heartbeats
  and replies meanwhile.

The program starts one engine process (``tensorrpc.testing.serve_engines``), checks every
answer against the same computation done here, prints how many batches went by alias
(the client's torch_shm statistics) and how many missed a slot, and exits 0 only if every
batch was on a slot and went by alias, leaving no process or memory behind.
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
from tensorrpc.loader import SharedBatches
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
    # A slot holds one batch: its images and its labels, each rounded up to 64 bytes.
    image_bytes = batch_size * torch.Size(SHAPE).numel() * 4
    slots = SharedBatches(max_batch_bytes=image_bytes + batch_size * 8 + 128)
    loader = torch.utils.data.DataLoader(
        Images(batches * batch_size),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=slots.collate,
    )
    # The workers are forked now, before the client opens sockets and starts threads
    # (forking a process that holds them is unsafe); they prefetch meanwhile.
    it = slots.iterate(loader)
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
    slots.close()
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
        "on_slots": float(slots.batches),
        "missed_slots": float(slots.fallbacks),
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
    print(
        f"{int(report['on_slots'])} of {n} batches were written into a slot "
        f"({int(report['missed_slots'])} missed one)"
    )
    sys.exit(0 if report["aliased"] >= n and report["on_slots"] >= n else 3)


if __name__ == "__main__":  # spawned workers and the engine import this module
    cli()
