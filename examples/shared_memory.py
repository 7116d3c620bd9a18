"""Zero copy: tensors born in shared memory travel by alias, in both directions.

    python -m examples.shared_memory [--mib 64] [--calls 5]

The recipe (see docs/transports.md, "Zero copy"):

* **An engine that produces large results** allocates each result in tensorrpc shared
  memory (``tensorrpc.shared_empty``) and computes into it in place. Returned through
  ``torch_shm``, it reaches the client by alias: the client's tensor *is* that memory, no
  byte is copied, and the memory is freed when the last tensor viewing it (in either
  process) is gone. ``render`` below does this.
* **A client that sends a large input on every call** keeps one input buffer in shared
  memory (``tensorrpc.shared_empty``, or ``tensorrpc.share`` for a copy of an existing
  tensor) and refills it in place between calls: every call sends only a handle.
  ``total`` below reads it. Refill only when no call using it is in flight, since the
  engine reads the same memory; and an engine that must keep an input past its call
  keeps a copy (``clone()``).
* Aliasing means sharing: a buffer the engine reuses (``ring`` below, a ring of output
  buffers) changes under the client's feet when the engine writes it again. Reuse
  buffers only with such a protocol (the client is done with a frame before the ring
  comes round), or allocate a new one per result, as ``render`` does.

The example starts one engine process (``tensorrpc.testing.serve_engines``), checks each
pattern by content and by the client's statistics (tensors sent by alias, bytes by
torch_shm), prints what it measured and exits 0, leaving no process or memory behind.
"""

from __future__ import annotations

import argparse
import sys
import time

import anyio
import torch

import tensorrpc
from tensorrpc import rpc, service
from tensorrpc.testing import serve_engines

#: Frames in the engine's output ring (``Renderer.ring``).
RING = 2


@service
class Renderer:
    """An engine whose results are large tensors, born in shared memory."""

    def __init__(self) -> None:
        self._ring: list[torch.Tensor] = []
        self._next = 0

    @rpc
    async def render(self, numel: int, value: float) -> torch.Tensor:
        """A new result per call: allocated in shared memory, filled in place, returned."""
        out = tensorrpc.shared_empty(numel, dtype=torch.float32)
        out.fill_(value)  # the model would write its output here
        return out  # by alias; the engine keeps no reference

    @rpc
    async def total(self, x: torch.Tensor) -> float:
        """Read the client's input where it lies (by alias); keep nothing."""
        return float(x.sum())

    @rpc
    async def ring(self, numel: int, value: float) -> torch.Tensor:
        """Reuse a ring of RING output buffers: frame k's memory is written again at k+RING."""
        if not self._ring or self._ring[0].numel() != numel:
            self._ring = [tensorrpc.shared_empty(numel, dtype=torch.float32) for _ in range(RING)]
        out = self._ring[self._next % RING]
        self._next += 1
        out.fill_(value)
        return out


async def main(mib: int = 64, calls: int = 5) -> dict[str, float]:
    """Run both patterns against one engine process; return what was measured."""
    numel = mib * 2**20 // 4
    async with serve_engines(Renderer, isolation="process") as client:
        shm = client.with_options(transport="torch_shm")
        report: dict[str, float] = {}

        # 1. Results born in shared memory: received by alias.
        before = client.statistics().transports.torch_shm
        started = time.perf_counter()
        for i in range(calls):
            frame = await shm.call(Renderer.render, numel, float(i))
            assert frame.shape == (numel,)
            assert frame[0].item() == frame[-1].item() == i
        report["render_ms"] = (time.perf_counter() - started) / calls * 1e3
        after = client.statistics().transports.torch_shm
        assert after.tensors_received - before.tensors_received == calls
        assert after.bytes_received - before.bytes_received == calls * numel * 4

        # 2. One input buffer in shared memory, refilled in place: sent by alias.
        buffer = tensorrpc.shared_empty(numel, dtype=torch.float32)
        detail = client.statistics().transports.torch_shm_detail
        aliased_before = detail.tensors_aliased if detail is not None else 0
        started = time.perf_counter()
        for i in range(calls):
            buffer.fill_(float(i))  # no call using the buffer is in flight here
            assert await shm.call(Renderer.total, buffer) == float(i) * numel
        report["total_ms"] = (time.perf_counter() - started) / calls * 1e3
        detail = client.statistics().transports.torch_shm_detail
        assert detail is not None
        assert detail.tensors_aliased - aliased_before == calls  # no copy of the buffer

        # 3. The hazard that proves the aliasing: the engine's ring comes round.
        first = await shm.call(Renderer.ring, 1024, 1.0)
        await shm.call(Renderer.ring, 1024, 2.0)
        assert first[0].item() == 1.0
        await shm.call(Renderer.ring, 1024, 3.0)  # the engine writes `first`'s memory
        assert first[0].item() == 3.0, "not aliased: the client holds a copy"
        report["mib"] = float(mib)
        report["engine_pid"] = float(next(iter(client.engines.values())).pid)
        return report


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB")
    parser.add_argument("--calls", type=int, default=5, help="calls per pattern")
    args = parser.parse_args()
    report = anyio.run(main, args.mib, args.calls)
    print(
        f"{args.mib} MiB results born in shared memory: {report['render_ms']:.2f} ms per call; "
        f"{args.mib} MiB input buffer reused by alias: {report['total_ms']:.2f} ms per call "
        f"(engine pid {report['engine_pid']:.0f})"
    )
    sys.exit(0)


if __name__ == "__main__":  # the engine process imports this module: keep the run guarded
    cli()
