"""Round trip: a small call (two ints → int) and 64 calls in flight, system by system.

Every server runs in its own process on the same machine, over ``ipc://`` (gRPC: a Unix
domain socket; torch.distributed.rpc: TensorPipe's own choice after a loopback TCP
rendezvous; mp.Queue: pipes). Each system is warmed up, then timed:

* ``small``: sequential calls, one at a time: median and p99 latency;
* ``pipelined``: 64 calls kept in flight: calls per second.

Both loops stop at a count or a time budget, whichever comes first.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._common import Progress, guarded, run_async
from bench._measure import Budget, pipelined, summarize, time_async, time_sync

INFLIGHT = 64


@dataclass(frozen=True, slots=True)
class Config:
    """Budgets of the round-trip section."""

    small: Budget
    pipe_total: int
    pipe_seconds: float
    pipe_warmup: int
    case_timeout: float
    ready_timeout: float
    inflight: int = INFLIGHT


def config(quick: bool) -> Config:
    """The full or the reduced (``--quick``) budgets."""
    if quick:
        return Config(
            small=Budget(warmup=50, count=400, seconds=0.6, min_count=20),
            pipe_total=3000,
            pipe_seconds=0.8,
            pipe_warmup=300,
            case_timeout=60.0,
            ready_timeout=45.0,
        )
    return Config(
        small=Budget(warmup=300, count=10_000, seconds=4.0, min_count=100),
        pipe_total=60_000,
        pipe_seconds=4.0,
        pipe_warmup=2_000,
        case_timeout=120.0,
        ready_timeout=90.0,
    )


def _pipe_result(calls: int, elapsed: float, inflight: int) -> dict[str, Any]:
    if calls == 0 or elapsed <= 0:
        raise RuntimeError("no pipelined call completed")
    return {
        "calls": calls,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed,
        "inflight": inflight,
    }


def _pyzmq(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.zmq_peer import ZmqClient

    addr = f"ipc://{workdir}/pyzmq-rt.sock"

    async def case() -> dict[str, Any]:
        client = ZmqClient(addr)
        try:
            if await client.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: client.add(1, 2), cfg.small))
            await client.window(cfg.pipe_warmup, cfg.inflight, cfg.pipe_seconds)
            t0 = time.perf_counter()
            calls = await client.window(cfg.pipe_total, cfg.inflight, cfg.pipe_seconds)
            pipe = _pipe_result(calls, time.perf_counter() - t0, cfg.inflight)
        finally:
            client.close()
        return {"small": small, "pipelined": pipe}

    with PeerProcess("bench.peers.zmq_peer", [addr], ready_timeout=cfg.ready_timeout):
        result: dict[str, Any] = run_async(case, cfg.case_timeout)
    return result


def _pyzmq_futures(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.zmq_peer import ZmqFutureClient

    addr = f"ipc://{workdir}/pyzmq-fut.sock"

    async def case() -> dict[str, Any]:
        async with ZmqFutureClient(addr) as client:
            if await client.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: client.add(1, 2), cfg.small))
            pipe = await pipelined(
                lambda: client.add(1, 2),
                inflight=cfg.inflight,
                total=cfg.pipe_total,
                seconds=cfg.pipe_seconds,
                warmup=cfg.pipe_warmup,
            )
        return {"small": small, "pipelined": pipe}

    with PeerProcess("bench.peers.zmq_peer", [addr], ready_timeout=cfg.ready_timeout):
        result: dict[str, Any] = run_async(case, cfg.case_timeout)
    return result


def _grpc(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.grpc_peer import GrpcClient

    addr = f"unix://{workdir}/grpc-rt.sock"

    async def case() -> dict[str, Any]:
        client = GrpcClient(addr)
        try:
            async with asyncio.timeout(cfg.ready_timeout):
                await client.wait_ready()
            if await client.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: client.add(1, 2), cfg.small))
            pipe = await pipelined(
                lambda: client.add(1, 2),
                inflight=cfg.inflight,
                total=cfg.pipe_total,
                seconds=cfg.pipe_seconds,
                warmup=cfg.pipe_warmup,
            )
        finally:
            await client.aclose()
        return {"small": small, "pipelined": pipe}

    with PeerProcess("bench.peers.grpc_peer", [addr], ready_timeout=cfg.ready_timeout):
        result: dict[str, Any] = run_async(case, cfg.case_timeout)
    return result


def _tensorrpc(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

    client_cls, _ = runtime()
    addr = f"ipc://{workdir}/tensorrpc-rt.sock"

    async def case(peer: PeerProcess) -> dict[str, Any]:
        async with client_cls(BenchService, bind=addr) as client:
            await wait_engine(client, peer, cfg.ready_timeout)
            stub = client.with_options(engine=ENGINE_ID).stub()
            if await stub.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: stub.add(1, 2), cfg.small))
            pipe = await pipelined(
                lambda: stub.add(1, 2),
                inflight=cfg.inflight,
                total=cfg.pipe_total,
                seconds=cfg.pipe_seconds,
                warmup=cfg.pipe_warmup,
            )
        if not peer.alive():
            raise RuntimeError(peer.failure())
        return {"small": small, "pipelined": pipe}

    with PeerProcess("bench.peers.tensorrpc_peer", [addr], ready_timeout=cfg.ready_timeout) as peer:
        result: dict[str, Any] = run_async(lambda: case(peer), cfg.case_timeout)
    return result


def _mpqueue(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers.mpqueue_peer import MpQueuePeer

    with MpQueuePeer(start_timeout=cfg.ready_timeout) as peer:
        small = summarize(time_sync(lambda: peer.add(1, 2), cfg.small))
        peer.window(cfg.pipe_warmup, cfg.inflight, cfg.pipe_seconds)
        t0 = time.perf_counter()
        calls = peer.window(cfg.pipe_total, cfg.inflight, cfg.pipe_seconds)
        pipe = _pipe_result(calls, time.perf_counter() - t0, cfg.inflight)
    return {"small": small, "pipelined": pipe}


def _torch_rpc(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers.torch_rpc_peer import run_pair

    conf = {
        "small": asdict(cfg.small),
        "pipelined": {
            "inflight": cfg.inflight,
            "total": cfg.pipe_total,
            "seconds": cfg.pipe_seconds,
            "warmup": cfg.pipe_warmup,
        },
        "sizes": {},
    }
    result = run_pair(conf, timeout=cfg.case_timeout)
    return {"small": result["small"], "pipelined": result["pipelined"]}


def _ray(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers import ray_peer

    conf = {
        "small": asdict(cfg.small),
        "pipelined": {
            "inflight": cfg.inflight,
            "total": cfg.pipe_total,
            "seconds": cfg.pipe_seconds,
            "warmup": cfg.pipe_warmup,
        },
        "sizes": {},
    }
    result = ray_peer.run(conf, workdir=str(workdir), timeout=cfg.case_timeout)
    return {"small": result["small"], "pipelined": result["pipelined"]}


#: system name → case, in table order; "pyzmq" is the floor the targets refer to
CASES = {
    "tensorrpc": _tensorrpc,
    "pyzmq": _pyzmq,
    "pyzmq (futures)": _pyzmq_futures,
    "grpc.aio": _grpc,
    "torch.distributed.rpc": _torch_rpc,
    "mp.Queue": _mpqueue,
    "Ray actor": _ray,
}

#: one line per system for the report: how it was measured
NOTES = {
    "tensorrpc": "Client (ROUTER, bind) ⇄ engine (DEALER, dial-in), ipc://, stub targeted",
    "pyzmq": "zmq.asyncio DEALER ⇄ ROUTER, ipc://; ping-pong; window of 64 from one coroutine",
    "pyzmq (futures)": "same sockets + call-id → future table and a reader task; 64 tasks",
    "grpc.aio": "generic bytes handler (no protoc), unix socket",
    "torch.distributed.rpc": "TensorPipe, CPU; rpc_sync / 64 rpc_async outstanding",
    "mp.Queue": "torch.multiprocessing (spawn) queues, blocking client; 64 queued",
    "Ray actor": "local ray.init(num_cpus=1), one actor; ray.get(actor.add.remote(1, 2))",
}


def run(
    quick: bool = False,
    *,
    workdir: Path,
    progress: Progress = print,
    systems: list[str] | None = None,
) -> dict[str, Any]:
    """Measure every system; return ``{"config", "notes", "systems"}``."""
    cfg = config(quick)
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        if systems is not None and name not in systems:
            continue
        out[name] = guarded(progress, f"roundtrip {name}", functools.partial(case, cfg, workdir))
    conf = asdict(cfg)
    return {"config": conf, "notes": dict(NOTES), "systems": out}


__all__ = ["CASES", "Config", "config", "run"]
