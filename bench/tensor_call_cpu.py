"""CPU of the tensor-carrying steps of a call, split by side, in one process (issue 12).

Run: ``python -m bench.tensor_call_cpu [--number 2000] [--rounds 15]``. The transfer
benchmark's calls go through the same steps as the runtime's, both ends in this process
and no sockets: the client's `TransportPolicy` placer and ``encode_args`` + codec, the
engine's lazy resolver, decode, ``decode_args``, the handler, the argument detach, the
result's check and encode, then the client's lease release, the reply's decode and the
leases it releases. Each step is timed with ``time.perf_counter`` around it; a figure is
the **minimum** over the rounds of the mean of ``--number`` calls, in µs, which moves
little on a loaded machine (compare two trees by running both, alternately).

* ``add``: the small call (two ints);
* ``tiny_in``: ``consume`` of a 16-element float32 tensor (inline in the payload);
* ``in``: ``consume`` of a 64 MiB tensor already in tensorrpc shared memory
  (``tensorrpc.share``), sent by alias (``transport="torch_shm"``: a handle travels);
* ``torch_in``: the same with a ``share_memory_()`` tensor (torch's shared memory; both
  ends pass the unsealed-alias gate here);
* ``torch_new``: ``consume`` of a ``share_memory_()`` tensor not sent before, each call
  (what a ``DataLoader`` batch is to the transport); ``--number`` ÷ 20 calls a round,
  the tensors made and freed outside the timed steps;
* ``out``: ``produce(64 MiB, shared=True)``, the result sent back by alias.

Each row gives the client's CPU (``cli``) and the engine's (``eng``) per call. The
engine resolves its own process's handles here (a real engine refuses them): the pid
check is the only step left out.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

import torch

import tensorrpc
from bench.peers.tensorrpc_peer import BenchService
from tensorrpc import _codec
from tensorrpc._service import describe
from tensorrpc.transports._links import PeerLinks
from tensorrpc.transports._policy import TransportPolicy
from tensorrpc.transports._shm_recv import ShmResolver

CONFIG = _codec.CodecConfig()
SIZE = 64 << 20


class _SelfLinks(PeerLinks):
    """Links that resolve handles of their own process (both ends live here)."""

    def resolver(
        self,
        peer: Hashable,
        *,
        frame: object = None,
        hold: Hashable = None,
        keep: Hashable = None,
    ) -> ShmResolver | None:
        assert self.shm is not None
        return self.shm.resolver(None, hold=hold, keep=keep, unsealed=True)


def _self_policy() -> TransportPolicy:
    policy = TransportPolicy()
    policy.peers = _SelfLinks(
        policy.shm, alias_unsealed="same-user", trust_unattested=False, message_address=None
    )
    return policy


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """The result of a handler coroutine that never waits."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the handler waited")


class Pair:
    """A client-side and an engine-side policy in one process, and the service."""

    def __init__(self) -> None:
        self.client = _self_policy()
        self.engine = _self_policy()
        assert self.client.shm is not None, "torch_shm is not available"
        assert self.engine.shm is not None, "torch_shm is not available"
        # (both ends passed the unsealed-alias gate: torch's shared files go by alias)
        self.client.shm.set_peer("engine", process="engine", alias_unsealed=True)
        self.engine.shm.set_peer("client", process="client", alias_unsealed=True)
        self.methods = describe(BenchService).methods
        self.service = BenchService()
        self._ids = itertools.count()
        self.cli = 0.0
        self.eng = 0.0

    def close(self) -> None:
        """Close both transports."""
        for policy in (self.client, self.engine):
            if policy.shm is not None:
                policy.shm.close()

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        """One call's CPU work on both sides, sockets left out; adds to ``cli``/``eng``."""
        clock = time.perf_counter
        spec = self.methods[name]
        t0 = clock()
        # client: encode the arguments
        placer = self.client.placer("torch_shm", "engine", peer_receives=True)
        encoded = _codec.encode(spec.encode_args(args, {}), CONFIG, placer=placer)
        t1 = clock()
        # engine: decode, run, detach, encode the result
        key = ("client", next(self._ids))
        lazy = self.engine.peers.lazy_resolver("client", keep=key)
        wire = _codec.decode(encoded.payload, encoded.buffers, CONFIG, resolver=lazy)
        if lazy is not None and lazy.inner is not None:
            _ = lazy.inner.leases
            detach = True
        else:
            detach = False
        values = spec.decode_args(wire)
        del wire
        result = _run(getattr(self.service, name)(*values))
        del values
        if detach:
            self.engine.memory.detach(key)
        rplacer = self.engine.placer("torch_shm", "client", peer_receives=True)
        reply = _codec.encode(spec.check_result(result), CONFIG, placer=rplacer)
        del result
        t2 = clock()
        # client: the reply ends the argument lease; decode the result
        if placer is not None and placer.lease is not None:
            self.client.memory.release([placer.lease], "engine")
        rlazy = self.client.peers.lazy_resolver("engine", hold="engine")
        out = spec.decode_result(
            _codec.decode(reply.payload, reply.buffers, CONFIG, resolver=rlazy)
        )
        inner = rlazy.inner if rlazy is not None else None
        done = self.client.memory.releasable("engine", inner)
        del out
        done += self.client.memory.releasable("engine")
        t3 = clock()
        # engine: the client's RELEASE of the result lease
        if done:
            self.engine.memory.release(done, "client")
        t4 = clock()
        self.cli += (t1 - t0) + (t3 - t2)
        self.eng += (t2 - t1) + (t4 - t3)
        return done


def _new_shared() -> torch.Tensor:
    t = torch.arange(SIZE // 4, dtype=torch.float32)
    t.share_memory_()  # type: ignore[no-untyped-call]
    return t


def measure(number: int = 2000, rounds: int = 15) -> dict[str, tuple[float, float]]:
    """``{kind: (client µs, engine µs)}``, each the minimum over ``rounds`` of the mean."""
    pair = Pair()
    shared = tensorrpc.share(torch.arange(SIZE // 4, dtype=torch.float32))
    tiny = torch.arange(16, dtype=torch.float32)
    kinds: dict[str, Callable[[], object]] = {
        "add": lambda: pair.call("add", (1, 2)),
        "tiny_in": lambda: pair.call("consume", (tiny,)),
        "in": lambda: pair.call("consume", (shared,)),
        "out": lambda: pair.call("produce", (SIZE, True)),
    }
    torch_shared = torch.arange(SIZE // 4, dtype=torch.float32)
    torch_shared.share_memory_()  # type: ignore[no-untyped-call]
    kinds["torch_in"] = lambda: pair.call("consume", (torch_shared,))
    new: list[torch.Tensor] = []
    kinds["torch_new"] = lambda: pair.call("consume", (new.pop(),))
    best: dict[str, tuple[float, float]] = {}
    try:
        for kind, fn in kinds.items():
            if kind != "torch_new":
                for _ in range(50):
                    fn()
        for _ in range(rounds):
            for kind, fn in kinds.items():
                n = number
                if kind == "torch_new":
                    n = max(1, number // 20)
                    new[:] = [_new_shared() for _ in range(n)]
                pair.cli = pair.eng = 0.0
                for _ in range(n):
                    fn()
                cli, eng = pair.cli / n * 1e6, pair.eng / n * 1e6
                old = best.get(kind)
                best[kind] = (cli, eng) if old is None else (min(old[0], cli), min(old[1], eng))
        assert pair.client.shm is not None
        stats = pair.client.shm.statistics()
        if stats.tensors_aliased != stats.tensors_sent:  # (every argument here is shared)
            raise RuntimeError(f"arguments were copied, not aliased: {stats}")
    finally:
        pair.close()
    return best


def main() -> None:
    """Print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    ns = parser.parse_args()
    for kind, (cli, eng) in measure(ns.number, ns.rounds).items():
        print(f"{kind:8s} cli {cli:7.2f} µs  eng {eng:7.2f} µs")


if __name__ == "__main__":
    main()
