"""Transfer: a tensor of 4 KiB, 1 MiB and 64 MiB sent to a server, a small result back;
and the other direction, a small request and a tensor back (``sizes_out``).

The tensor is ``float32``, filled with ``arange`` so that the reply ``(numel, first,
last)`` proves the bytes arrived; every system's reply is checked once per size before
any timing. Each server runs in its own process on the same machine and only reads the
tensor at both ends (scanning all of it would add the same cost to every system and hide
the transports' differences). Latency is the median of sequential calls after warm-up,
bounded by count and time. A small call (two ints) is measured beside it in the same
session, for the "no more than 3 times a small call" target.

Systems (each one's peer module says how it is set up):

* ``Tensor.copy_ (in-process)``: one copy of the same bytes into a preallocated tensor,
  the physical floor; ``Tensor.clone (in-process)``: allocate and copy, what any fresh
  buffer costs;
* ``pyzmq``: raw DEALER → ROUTER, the tensor as one zero-copy frame;
* ``tensorrpc frames`` / ``tensorrpc torch_shm (fresh)`` / ``tensorrpc torch_shm
  (shared)``: the tensor as an out-of-band frame; copied into tensorrpc's shared memory;
  already in tensorrpc shared memory (``tensorrpc.share()`` of the benchmark's tensor);
  ``tensorrpc auto (default)``: what a call gets without choosing;
* ``mp.Queue (shared)`` / ``mp.Queue (fresh)``: torch.multiprocessing queues;
* ``grpc.aio``: the tensor's bytes through a generic bytes handler;
* ``torch.distributed.rpc``: TensorPipe on CPU;
* ``Ray actor (torch)`` / ``Ray actor (numpy)``: a local Ray instance and one actor, the
  payload as a torch tensor (pickled) and as a numpy array (zero-copy from Ray's object
  store: Ray at its best); optional, only if Ray is installed.

Tensor out (small request, the server answers a tensor it already holds): the in-process
lines (the same copy), tensorrpc (frames, torch_shm from a fresh tensor, torch_shm from a
tensor the engine keeps in shared memory) and Ray (torch, numpy). The other peers are
measured in the first direction only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench._common import Progress, guarded, run_async, unavailable
from bench._measure import Budget, summarize, time_async, time_sync, time_sync_each

KIB = 1024
MIB = 1024 * 1024
SIZES = (4 * KIB, 1 * MIB, 64 * MIB)


@dataclass(frozen=True, slots=True)
class Config:
    """Budgets of the transfer section, per payload size in bytes."""

    sizes: dict[int, Budget]
    small: Budget
    case_timeout: float
    ready_timeout: float


def config(quick: bool) -> Config:
    """The full or the reduced (``--quick``) budgets."""
    if quick:
        return Config(
            sizes={
                4 * KIB: Budget(warmup=10, count=100, seconds=0.3, min_count=10),
                1 * MIB: Budget(warmup=3, count=30, seconds=0.3, min_count=5),
                64 * MIB: Budget(warmup=1, count=3, seconds=0.5, min_count=2),
            },
            small=Budget(warmup=20, count=200, seconds=0.3, min_count=10),
            case_timeout=90.0,
            ready_timeout=45.0,
        )
    return Config(
        sizes={
            4 * KIB: Budget(warmup=50, count=3000, seconds=2.5, min_count=50),
            1 * MIB: Budget(warmup=10, count=1000, seconds=2.5, min_count=20),
            # The time bound, not the count, ends a copying line (40 to 150 calls in
            # 4 s); a line that copies nothing (already shared: ~0.2 ms a call) gets
            # 1,000 samples, not 40, whose median the bimodal latency of a sequential
            # call moved by more than the 0.1 ms its target allows.
            64 * MIB: Budget(warmup=3, count=1000, seconds=4.0, min_count=5),
        },
        small=Budget(warmup=200, count=5000, seconds=2.0, min_count=100),
        case_timeout=300.0,
        ready_timeout=90.0,
    )


def make_tensor(size: int) -> torch.Tensor:
    """The payload: ``size`` bytes of float32 ``arange``."""
    return torch.arange(size // 4, dtype=torch.float32)


def _shared_tensor(size: int) -> torch.Tensor:
    """The payload, moved into shared memory by the benchmark itself."""
    t = make_tensor(size)
    t.share_memory_()  # type: ignore[no-untyped-call]
    return t


def check_tensor(value: Any, size: int) -> None:
    """Raise unless ``value`` is :func:`make_tensor`'s tensor (or its numpy array)."""
    n = size // 4
    flat = value.reshape(-1)
    count = int(flat.numel()) if isinstance(flat, torch.Tensor) else int(flat.size)
    if count != n or float(flat[0]) != 0.0 or float(flat[-1]) != n - 1:
        raise RuntimeError(f"wrong tensor for {size} bytes: {count} elements")


def _tensorrpc_shared_tensor(size: int) -> torch.Tensor:
    """The payload in tensorrpc shared memory (a sealed memfd: torch_shm sends it by alias)."""
    import tensorrpc

    return tensorrpc.share(make_tensor(size))


def check(reply: Any, size: int) -> None:
    """Raise unless ``reply`` is ``(numel, first, last)`` of :func:`make_tensor`."""
    n = size // 4
    got = tuple(reply)
    if len(got) != 3 or int(got[0]) != n or float(got[1]) != 0.0 or float(got[2]) != n - 1:
        raise RuntimeError(f"wrong reply {got!r} for {size} bytes")


def _sizes_sync(
    cfg: Config,
    send: Callable[[torch.Tensor], Any],
    tensor_for: Callable[[int], torch.Tensor],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size, budget in cfg.sizes.items():
        try:
            t = tensor_for(size)
            check(send(t), size)
            out[str(size)] = summarize(time_sync(functools.partial(send, t), budget))
            del t
        except Exception as exc:
            out[str(size)] = unavailable(exc)
    return out


async def _sizes_async(
    cfg: Config,
    send: Callable[[torch.Tensor], Any],
    tensor_for: Callable[[int], torch.Tensor],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size, budget in cfg.sizes.items():
        try:
            t = tensor_for(size)
            check(await send(t), size)
            out[str(size)] = summarize(await time_async(functools.partial(send, t), budget))
            del t
        except Exception as exc:
            out[str(size)] = unavailable(exc)
    return out


async def _sizes_out_async(cfg: Config, fetch: Callable[[int], Any]) -> dict[str, Any]:
    """Time ``fetch(size)``, a small request answered by a tensor of ``size`` bytes."""
    out: dict[str, Any] = {}
    for size, budget in cfg.sizes.items():
        try:
            check_tensor(await fetch(size), size)
            out[str(size)] = summarize(await time_async(functools.partial(fetch, size), budget))
        except Exception as exc:
            out[str(size)] = unavailable(exc)
    return out


def _in_process(cfg: Config, workdir: Path) -> dict[str, Any]:
    copy_sizes: dict[str, Any] = {}
    clone_sizes: dict[str, Any] = {}
    # One thread: a copy split over torch's intra-op pool stalls for milliseconds
    # whenever another process holds the second core, which made the floor meaningless
    # on a shared machine. One core copying is the stable floor.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for size, budget in cfg.sizes.items():
            src = make_tensor(size)
            dst = torch.empty_like(src)
            copy_sizes[str(size)] = summarize(time_sync(functools.partial(dst.copy_, src), budget))
            clone_sizes[str(size)] = summarize(time_sync(src.clone, budget))
            del src, dst
    finally:
        torch.set_num_threads(threads)
    # The floor is the same copy whichever way the bytes go.
    return {
        "Tensor.copy_ (in-process)": {"sizes": copy_sizes, "sizes_out": copy_sizes},
        "Tensor.clone (in-process)": {"sizes": clone_sizes, "sizes_out": clone_sizes},
    }


def _pyzmq(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.zmq_peer import ZmqClient

    addr = f"ipc://{workdir}/pyzmq-tx.sock"

    async def case() -> dict[str, Any]:
        client = ZmqClient(addr)
        try:
            if await client.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: client.add(1, 2), cfg.small))
            sizes = await _sizes_async(cfg, client.consume, make_tensor)
        finally:
            client.close()
        return {"pyzmq": {"small": small, "sizes": sizes}}

    with PeerProcess(
        "bench.peers.zmq_peer", [addr, "--zero-copy"], ready_timeout=cfg.ready_timeout
    ):
        result: dict[str, Any] = run_async(case, cfg.case_timeout)
    return result


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return repr(obj)


def _path(tree: Any, *keys: str) -> int | None:
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree if isinstance(tree, int) and not isinstance(tree, bool) else None


def _counters(client: Any) -> dict[str, int | None]:
    """The client's per-transport counters that tell which transport really carried
    the tensors (``None`` where the statistics do not say)."""
    stats = _stats(client)
    transports = stats.get("transports") if isinstance(stats, dict) else None
    fallbacks: int | None = None
    if isinstance(transports, dict):
        for name, figures in transports.items():
            value = _path(figures, "fallbacks")
            if value is not None and not name.endswith("_detail"):  # detail repeats them
                fallbacks = (fallbacks or 0) + value
    return {
        "frames_tensors": _path(transports, "frames", "tensors_sent"),
        "shm_tensors": _path(transports, "torch_shm", "tensors_sent"),
        "shm_aliased": _path(transports, "torch_shm_detail", "tensors_aliased"),
        "shm_received": _path(transports, "torch_shm", "tensors_received"),
        "shm_received_aliased": _path(transports, "torch_shm_detail", "tensors_received_aliased"),
        "fallbacks": fallbacks,
    }


def _transport_check(
    transport: str, key: str, before: dict[str, int | None], after: dict[str, int | None]
) -> dict[str, Any]:
    """What the client's statistics say happened during one transport's run.

    Returns the counter deltas and, when they show that the transport asked for did
    not carry the tensors (fallbacks, tensors by the other transport, shared tensors
    copied), a warning: the figures are kept but flagged, never passed off as that
    transport's.
    """
    delta = {
        name: (after[name] or 0) - (before[name] or 0) for name in after if after[name] is not None
    }
    out: dict[str, Any] = {"counters": delta}
    warnings = []
    if delta.get("fallbacks"):
        warnings.append(f"{delta['fallbacks']} tensors fell back to frames")
    if transport == "frames" and delta.get("shm_tensors"):
        warnings.append(f"{delta['shm_tensors']} tensors went by torch_shm")
    if transport == "torch_shm" and delta.get("frames_tensors"):
        warnings.append(f"{delta['frames_tensors']} tensors went as frames")
    if key == "shm_shared" and delta.get("shm_aliased", 0) < delta.get("shm_tensors", 0):
        copied = delta.get("shm_tensors", 0) - delta.get("shm_aliased", 0)
        warnings.append(f"{copied} shared tensors were copied, not aliased")
    received = delta.get("shm_received", 0)
    if key == "shm_shared" and delta.get("shm_received_aliased", received) < received:
        copied = received - delta.get("shm_received_aliased", 0)
        warnings.append(f"{copied} shared result tensors were copied, not aliased")
    if warnings:
        out["warning"] = "; ".join(warnings)
    return out


def _tensorrpc(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

    client_cls, _ = runtime()
    addr = f"ipc://{workdir}/tensorrpc-tx.sock"
    names = {
        "frames": "tensorrpc frames",
        "shm_fresh": "tensorrpc torch_shm (fresh)",
        "shm_shared": "tensorrpc torch_shm (shared)",
        "auto": "tensorrpc auto (default)",
    }

    async def case(peer: PeerProcess) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with client_cls(BenchService, bind=addr) as client:
            await wait_engine(client, peer, cfg.ready_timeout)
            plain = client.stub(engine=ENGINE_ID, transport="frames")
            if await plain.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: plain.add(1, 2), cfg.small))
            runs = [
                ("frames", "frames", make_tensor),
                ("shm_fresh", "torch_shm", make_tensor),
                ("shm_shared", "torch_shm", _tensorrpc_shared_tensor),
                ("auto", "auto", make_tensor),
            ]
            for key, transport, tensor_for in runs:
                try:
                    stub = client.stub(engine=ENGINE_ID, transport=transport)
                    before = _counters(client)
                    sizes = await _sizes_async(cfg, stub.consume, tensor_for)
                    entry: dict[str, Any] = {"small": small, "sizes": sizes}
                    # The other direction: the engine answers a tensor it holds (in
                    # tensorrpc shared memory for "shm_shared": sent by alias).
                    shared = key == "shm_shared"
                    entry["sizes_out"] = await _sizes_out_async(
                        cfg, functools.partial(_produce, stub, shared=shared)
                    )
                    entry.update(_transport_check(transport, key, before, _counters(client)))
                except Exception as exc:
                    entry = unavailable(exc)
                out[names[key]] = entry
            stats = _stats(client)
        if not peer.alive():
            raise RuntimeError(peer.failure())
        out[names["frames"]]["statistics"] = stats
        return out

    with PeerProcess("bench.peers.tensorrpc_peer", [addr], ready_timeout=cfg.ready_timeout) as peer:
        result: dict[str, Any] = run_async(lambda: case(peer), cfg.case_timeout)
    return result


async def _produce(stub: Any, size: int, *, shared: bool) -> Any:
    return await stub.produce(size, shared)


def _stats(client: Any) -> Any:
    fn = getattr(client, "statistics", None)
    if not callable(fn):
        return None
    try:
        return _jsonable(fn())
    except Exception as exc:  # statistics are a by-product: never lose the figures
        return unavailable(exc)


def _mpqueue(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers.mpqueue_peer import MpQueuePeer

    with MpQueuePeer(start_timeout=cfg.ready_timeout) as peer:
        small = summarize(time_sync(lambda: peer.add(1, 2), cfg.small))
        shared = _sizes_sync(cfg, peer.consume, _shared_tensor)
        fresh: dict[str, Any] = {}
        for size, budget in cfg.sizes.items():
            try:
                src = make_tensor(size)
                check(peer.consume(src.clone()), size)
                fresh[str(size)] = summarize(time_sync_each(src.clone, peer.consume, budget))
                del src
            except Exception as exc:
                fresh[str(size)] = unavailable(exc)
    return {
        "mp.Queue (shared)": {"small": small, "sizes": shared},
        "mp.Queue (fresh)": {"small": small, "sizes": fresh},
    }


def _grpc(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.grpc_peer import GrpcClient

    addr = f"unix://{workdir}/grpc-tx.sock"

    async def case() -> dict[str, Any]:
        client = GrpcClient(addr)
        try:
            async with asyncio.timeout(cfg.ready_timeout):
                await client.wait_ready()
            if await client.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: client.add(1, 2), cfg.small))
            sizes = await _sizes_async(cfg, client.consume, make_tensor)
        finally:
            await client.aclose()
        return {"grpc.aio": {"small": small, "sizes": sizes}}

    with PeerProcess("bench.peers.grpc_peer", [addr, "--torch"], ready_timeout=cfg.ready_timeout):
        result: dict[str, Any] = run_async(case, cfg.case_timeout)
    return result


def _torch_rpc(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers.torch_rpc_peer import run_pair

    conf = {
        "small": asdict(cfg.small),
        "pipelined": {"inflight": 64, "total": 64, "seconds": 1.0, "warmup": 0},
        "sizes": {str(size): asdict(budget) for size, budget in cfg.sizes.items()},
    }
    result = run_pair(conf, timeout=cfg.case_timeout)
    return {"torch.distributed.rpc": {"small": result["small"], "sizes": result["sizes"]}}


def _ray(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers import ray_peer

    conf = {
        "small": asdict(cfg.small),
        "pipelined": {"inflight": 64, "total": 64, "seconds": 1.0, "warmup": 0},
        "sizes": {str(size): asdict(budget) for size, budget in cfg.sizes.items()},
    }
    result = ray_peer.run(conf, workdir=str(workdir), timeout=cfg.case_timeout)
    return {
        "Ray actor (torch)": {
            "small": result["small"],
            "sizes": result["sizes"],
            "sizes_out": result["sizes_out"],
        },
        "Ray actor (numpy)": {
            "small": result["small"],
            "sizes": result["sizes_numpy"],
            "sizes_out": result["sizes_out_numpy"],
        },
    }


#: case → the systems it fills, in table order
CASES: dict[str, tuple[Callable[[Config, Path], dict[str, Any]], tuple[str, ...]]] = {
    "in-process": (_in_process, ("Tensor.copy_ (in-process)", "Tensor.clone (in-process)")),
    "tensorrpc": (
        _tensorrpc,
        (
            "tensorrpc frames",
            "tensorrpc torch_shm (fresh)",
            "tensorrpc torch_shm (shared)",
            "tensorrpc auto (default)",
        ),
    ),
    "pyzmq": (_pyzmq, ("pyzmq",)),
    "mp.Queue": (_mpqueue, ("mp.Queue (shared)", "mp.Queue (fresh)")),
    "grpc.aio": (_grpc, ("grpc.aio",)),
    "torch.distributed.rpc": (_torch_rpc, ("torch.distributed.rpc",)),
    "Ray": (_ray, ("Ray actor (torch)", "Ray actor (numpy)")),
}

#: one line per system for the report: how it was measured
NOTES = {
    "Tensor.copy_ (in-process)": "one copy into a preallocated tensor, one thread: the floor",
    "Tensor.clone (in-process)": "allocate + copy in one process, one thread",
    "tensorrpc frames": "out-of-band zero-copy ZMQ frame, ipc://",
    "tensorrpc torch_shm (fresh)": "copied into tensorrpc's shared memory; handle travels",
    "tensorrpc torch_shm (shared)": "tensorrpc.share() tensor: only the handle travels",
    "tensorrpc auto (default)": "the default policy, same (non-shared) tensor as frames",
    "pyzmq": "raw DEALER → ROUTER, one copy=False frame, ipc://",
    "mp.Queue (shared)": "torch.multiprocessing Queue, tensor already share_memory_()",
    "mp.Queue (fresh)": "torch.multiprocessing Queue, a new tensor per call (moved to shm)",
    "grpc.aio": "tensor.numpy().tobytes() through a generic bytes handler, unix socket",
    "torch.distributed.rpc": "TensorPipe on CPU, rpc_sync",
    "Ray actor (torch)": "torch.Tensor argument / result of an actor method (pickled by Ray)",
    "Ray actor (numpy)": "numpy array argument / result: Ray's object store, zero-copy reads",
}


def run(
    quick: bool = False,
    *,
    workdir: Path,
    progress: Progress = print,
    systems: list[str] | None = None,
) -> dict[str, Any]:
    """Measure every system; return ``{"config", "sizes", "notes", "systems"}``."""
    cfg = config(quick)
    out: dict[str, Any] = {}
    for label, (case, names) in CASES.items():
        if systems is not None and label not in systems:
            continue
        got = guarded(progress, f"transfer {label}", functools.partial(case, cfg, workdir))
        if "unavailable" in got:
            for name in names:
                out[name] = got
        else:
            out.update(got)
    conf = {
        "sizes": {str(k): asdict(v) for k, v in cfg.sizes.items()},
        "small": asdict(cfg.small),
        "case_timeout": cfg.case_timeout,
        "ready_timeout": cfg.ready_timeout,
    }
    return {"config": conf, "sizes": list(SIZES), "notes": dict(NOTES), "systems": out}


__all__ = ["CASES", "SIZES", "Config", "check", "check_tensor", "config", "make_tensor", "run"]
