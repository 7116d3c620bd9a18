"""tensorrpc itself, set up the way vLLM runs its engines.

Setup: the benchmark process holds a :class:`tensorrpc.Client` bound on ``ipc://``
(engines dial in, vLLM's topology); the engine is ``tensorrpc.serve(BenchService(),
connect=..., engine_id="bench")`` in its own process. Both handlers are ``async def``, so
they run on the engine's event loop like the other peers' handlers. Calls go through a
stub targeted at the engine: ``client.with_options(engine="bench", transport=...).stub()`` with
``"frames"`` (out-of-band zero-copy ZMQ frames) or ``"torch_shm"`` (shared memory; only a
handle travels). ``consume`` answers ``(numel, first, last)`` like every other peer.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import time
from typing import Any

import torch

import tensorrpc
from bench._common import background_nice_arg
from bench.peers._child import ready, wait_stdin_eof
from bench.peers._proc import PeerProcess
from tensorrpc._service import rpc, service

ENGINE_ID = "bench"
#: ``tensorrpc.set_background_nice(N)`` in this process and the engines it starts.
BACKGROUND_NICE_ENV = "BENCH_BACKGROUND_NICE"


def apply_background_nice(nice: int | str | None = None) -> None:
    """Lower tensorrpc's bulk threads to ``nice`` (``idle``: ``SCHED_IDLE``; None: what
    `BACKGROUND_NICE_ENV` says, which the engine processes started afterwards inherit)."""
    if nice is not None:
        os.environ[BACKGROUND_NICE_ENV] = str(nice)
    value = os.environ.get(BACKGROUND_NICE_ENV)
    setter = getattr(tensorrpc, "set_background_nice", None)
    if value and setter is not None:
        setter(background_nice_arg(value))


#: ``tensorrpc.set_copy_threads(N)`` in this process and the engines it starts.
COPY_THREADS_ENV = "BENCH_COPY_THREADS"


def apply_copy_threads(threads: int | None = None) -> None:
    """Large torch_shm copies on ``threads`` threads (None: what `COPY_THREADS_ENV` says,
    which the engine processes started afterwards inherit)."""
    if threads is not None:
        os.environ[COPY_THREADS_ENV] = str(threads)
    value = os.environ.get(COPY_THREADS_ENV)
    if value:
        tensorrpc.set_copy_threads(int(value))


@service(name="BenchService")
class BenchService:
    """The benchmark's service: a small call, a tensor sink and a tensor source."""

    def __init__(self) -> None:
        self._tensors: dict[tuple[int, bool], torch.Tensor] = {}

    @rpc
    async def add(self, a: int, b: int) -> int:
        """Two ints in, one int out."""
        return a + b

    @rpc
    async def consume(self, t: torch.Tensor) -> tuple[int, float, float]:
        """Take a tensor; answer its size and its first and last elements."""
        return (t.numel(), float(t[0]), float(t[-1]))

    @rpc
    async def echo(self, t: torch.Tensor) -> torch.Tensor:
        """Send the received tensor back (in and out in one call)."""
        return t

    @rpc
    async def produce(self, nbytes: int, shared: bool) -> torch.Tensor:
        """Answer a float32 ``arange`` tensor of ``nbytes`` bytes that the engine holds.

        The tensor is made once per size, so that a call times the transfer, not the
        tensor's creation. With ``shared`` it is made in tensorrpc shared memory
        (`tensorrpc.share`, a sealed memfd): the zero-copy recipe for results, sent by
        alias under torch_shm. (torch's own ``share_memory_()`` would not do: its files
        cannot be sealed, so torch_shm copies such a tensor into its pool like any other.)
        """
        key = (nbytes, shared)
        t = self._tensors.get(key)
        if t is None:
            t = torch.arange(nbytes // 4, dtype=torch.float32)
            if shared:
                t = tensorrpc.share(t)
            self._tensors[key] = t
        return t


def runtime() -> tuple[Any, Any]:
    """``(Client, serve)`` from tensorrpc, or ``ImportError`` saying what is missing."""
    pkg = importlib.import_module("tensorrpc")
    client_cls = getattr(pkg, "Client", None)
    serve = getattr(pkg, "serve", None)
    if client_cls is None:
        client_cls = importlib.import_module("tensorrpc._client").Client
    if serve is None:
        serve = importlib.import_module("tensorrpc._server").serve
    return client_cls, serve


async def wait_engine(client: Any, peer: PeerProcess, within: float) -> None:
    """Wait until the engine has joined ``client``; fail at once if its process died."""
    deadline = time.monotonic() + within
    while True:
        try:
            await client.wait_for_engines(1, timeout=1.0)
            return
        except TimeoutError:
            if not peer.alive():
                raise RuntimeError(peer.failure()) from None
            if time.monotonic() > deadline:
                raise


async def serve_main(addr: str, *, listen: bool = False) -> None:
    """Serve one engine dialling in to ``addr`` (``listen``: bound on it) until stdin closes."""
    _, serve = runtime()
    where = {"bind": addr} if listen else {"connect": addr}
    engine = asyncio.create_task(serve(BenchService(), engine_id=ENGINE_ID, **where))
    ready(addr)
    stop = asyncio.create_task(wait_stdin_eof())
    try:
        done, _ = await asyncio.wait({engine, stop}, return_when=asyncio.FIRST_COMPLETED)
        if engine in done:
            engine.result()  # serve() ended on its own: let its error end the process
    finally:
        # cancelling serve() drains it gracefully (BYE to the client)
        engine.cancel()
        stop.cancel()
        await asyncio.gather(engine, stop, return_exceptions=True)


def main() -> None:
    """Engine entry point: ``python -m bench.peers.tensorrpc_peer ADDR [--listen]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("addr")
    parser.add_argument("--listen", action="store_true", help="bind ADDR (clients dial in)")
    args = parser.parse_args()
    apply_background_nice()
    apply_copy_threads()
    asyncio.run(serve_main(args.addr, listen=args.listen))


if __name__ == "__main__":
    main()
