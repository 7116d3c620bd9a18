"""CPU per torch_shm handle and per call, both sides in one process, no sockets (issue 12).

Run: ``python -m bench.shm_handle_cost``. Each figure is the **minimum** over 15 rounds of
the mean thread CPU time (``time.thread_time``) of 2,000 repetitions: on a loaded machine
the minimum of CPU time moves much less than the median of wall time, so two trees can be
compared at any load (run both the same way, one after the other).

* ``place``: the sender's step for a 4 KiB tensor in tensorrpc shared memory (placer,
  ``place``, and the lease released as the reply would);
* ``resolve``: the receiver's step for that handle (resolver, ``resolve``: parse and
  check the handle, find the cached mapping, build the tensor);
* ``call``: what the transfer benchmark's calls cost in CPU, both sides, without the
  sockets: arguments encoded (``spec.encode_args`` and the codec, with the placer), decoded
  on the engine side (with a ``keep`` resolver, detached before the reply), the handler,
  the result encoded and decoded. ``add`` is the small call, ``consume (inline)`` a
  64-byte tensor that rides in the payload, ``consume (shared)`` the 4 KiB shared tensor
  by handle: the difference between the last two is the transport's share of the
  constant that an already-shared tensor adds to a call.
"""

from __future__ import annotations

import itertools
import time
import timeit
from collections.abc import Callable, Coroutine
from typing import Any

import torch

import tensorrpc
from bench.peers.tensorrpc_peer import BenchService
from tensorrpc import _codec
from tensorrpc._service import describe
from tensorrpc.transports.torch_shm import TorchShmTransport

CONFIG = _codec.CodecConfig()


def cpu_us(fn: Callable[[], object], number: int = 2000, rounds: int = 15) -> float:
    """Minimum over ``rounds`` of the mean thread CPU time of ``fn``, in µs."""
    fn()
    timer = timeit.Timer(fn, timer=time.thread_time)
    return min(timer.repeat(number=number, repeat=rounds)) / number * 1e6


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """The result of a handler coroutine that never waits."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the handler waited")


class Pair:
    """A client-side and an engine-side transport in one process, and the service."""

    def __init__(self) -> None:
        self.client = TorchShmTransport()
        self.engine = TorchShmTransport()
        self.methods = describe(BenchService).methods
        self.service = BenchService()
        self._ids = itertools.count()

    def close(self) -> None:
        """Close both transports."""
        self.client.close()
        self.engine.close()

    def call(self, name: str, args: tuple[Any, ...], *, shm: bool) -> Any:
        """One call's CPU work on both sides, sockets left out."""
        spec = self.methods[name]
        placer = self.client.placer("engine") if shm else None
        encoded = _codec.encode(spec.encode_args(args, {}), CONFIG, placer=placer)
        key = ("client", next(self._ids))
        resolver = self.engine.resolver(None, keep=key) if shm else None
        wire = _codec.decode(encoded.payload, encoded.buffers, CONFIG, resolver=resolver)
        result = _run(getattr(self.service, name)(*spec.decode_args(wire)))
        del wire
        if shm:
            self.engine.detach(key)
        reply = _codec.encode(spec.check_result(result), CONFIG)
        if placer is not None and placer.lease is not None:
            self.client.release(placer.lease)  # the reply ends the argument lease
        return spec.decode_result(_codec.decode(reply.payload, reply.buffers, CONFIG))


def measure(number: int = 2000, rounds: int = 15) -> dict[str, float]:
    """Every figure of the module docstring, in µs (``number`` and ``rounds``: see
    `cpu_us`)."""
    pair = Pair()
    shared = tensorrpc.share(torch.arange(1024, dtype=torch.float32))
    inline = torch.arange(16, dtype=torch.float32)
    try:

        def cpu(fn: Callable[[], object]) -> float:
            return cpu_us(fn, number, rounds)

        def place() -> tuple[str, bytes] | None:
            placer = pair.client.placer("engine")
            placed = placer.place(shared)
            if placer.lease is not None:
                pair.client.release(placer.lease)
            return placed

        kept = pair.client.placer("engine")  # one live lease for the handle resolved below
        placed = kept.place(shared)
        assert placed is not None
        handle = placed[1]

        def resolve() -> torch.Tensor:
            resolver = pair.engine.resolver(None, keep=("client", -1))
            return resolver.resolve("torch_shm", handle, torch.float32, (1024,))

        return {
            "place (shared 4 KiB)": cpu(place),
            "resolve (shared 4 KiB)": cpu(resolve),
            "call: add": cpu(lambda: pair.call("add", (1, 2), shm=False)),
            "call: consume (inline 64 B)": cpu(lambda: pair.call("consume", (inline,), shm=False)),
            "call: consume (shared 4 KiB)": cpu(lambda: pair.call("consume", (shared,), shm=True)),
        }
    finally:
        pair.close()


def main() -> None:
    """Print the figures."""
    for name, us in measure().items():
        print(f"{name:32s}{us:9.2f} µs")


if __name__ == "__main__":
    main()
