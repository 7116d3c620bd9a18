"""Transfer: a tensor of 4 KiB, 1 MiB and 64 MiB sent to a server, a small result back;
and the other direction, a small request and a tensor back (``sizes_out``).

The tensor is ``float32``, filled with ``arange`` so that the reply ``(numel, first,
last)`` proves the bytes arrived; every system's reply is checked once per size before
any timing. Each server runs in its own process on the same machine and only reads the
tensor at both ends (scanning all of it would add the same cost to every system and hide
the transports' differences). Latency is the median of sequential calls after warm-up,
bounded by count and time. A small call (two ints) is measured beside it in the same
session. The tensorrpc torch_shm lines also time small calls between their own, in
alternating blocks of eight (``small_paired`` in each cell, the "first call" line
aside; in ``sizes_out`` too): what their targets against a small call compare with,
taken under the same machine state as the line's own samples.

Systems (each one's peer module says how it is set up):

* ``Tensor.copy_ (in-process)``: one copy of the same bytes into a preallocated tensor,
  the physical floor; ``Tensor.clone (in-process)``: allocate and copy, what any fresh
  buffer costs;
* ``pyzmq``: raw DEALER → ROUTER, the tensor as one zero-copy frame;
* ``tensorrpc frames``: the same tensor each call as an out-of-band frame;
  ``tensorrpc auto (default)``: what a call gets without choosing, a new tensor each call;
* the ``tensorrpc torch_shm (...)`` lines, one per kind of source (`TORCH_SHM_LINES`):
  a **new tensor each call** (pre-made tensors, more bytes of them than the pool keeps,
  cycled, every one held until the line ends: the caller's own allocation and free stay
  out of the timing); the **same tensor** each call; a tensor in torch's shared memory
  (``share_memory_()``); a **``DataLoader`` batch** (one worker; each call sends a batch
  not sent before, fetched untimed between calls, the worker idle while calls are
  timed, two untimed small calls after each fetch: see `_next_batch`); a
  ``tensorrpc.share()`` tensor; and the **first call of a new size** (64 MiB
  column only: each sample a size the pool has no segment for). Each line also times,
  in the same run and the same process, one ``Tensor.copy_`` of the very sources it
  sends into a preallocated tensor in shared memory (a memfd's pages, already faulted
  in: what the pool copies into), on one thread, and the report divides by it. The
  transport's own copy of 8 MiB or more is split over up to four threads (the cores
  the client may use): on an idle machine with more than one core a line that copies
  can come out faster than that one-thread ``copy_``;
* ``mp.Queue (shared)`` / ``mp.Queue (fresh)``: torch.multiprocessing queues;
* ``grpc.aio``: the tensor's bytes through a generic bytes handler;
* ``torch.distributed.rpc``: TensorPipe on CPU;
* ``Ray actor (torch)`` / ``Ray actor (numpy)``: a local Ray instance and one actor, the
  payload as a torch tensor (pickled) and as a numpy array (zero-copy from Ray's object
  store: Ray at its best); optional, only if Ray is installed.

Run on its own: ``python -m bench.transfer [--quick] [--line KEY] [--size BYTES]``, the
chosen tensorrpc lines (keys of `TORCH_SHM_LINES`) at the chosen sizes, each divided by
its own ``copy_`` (for old and new builds alternating on a quiet machine).

Tensor out (small request, the server answers a tensor it already holds): the in-process
lines (the same copy), tensorrpc (frames, torch_shm from a fresh tensor, torch_shm from a
tensor the engine keeps in shared memory) and Ray (torch, numpy). The other peers are
measured in the first direction only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

from bench._common import Progress, guarded, run_async, unavailable
from bench._measure import (
    Budget,
    summarize,
    time_async,
    time_async_paired,
    time_sync,
    time_sync_each,
)

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
    #: Keys of the `TORCH_SHM_LINES` to run (None: all of them).
    lines: tuple[str, ...] | None = None


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


async def _sizes_out_async(
    cfg: Config, fetch: Callable[[int], Any], small: Callable[[], Awaitable[Any]]
) -> dict[str, Any]:
    """Time ``fetch(size)``, a small request answered by a tensor of ``size`` bytes, with
    blocks of ``small`` timed between (as `_line`)."""
    out: dict[str, Any] = {}
    for size, budget in cfg.sizes.items():
        try:
            check_tensor(await fetch(size), size)

            async def same_size(size: int = size) -> int:
                return size

            out[str(size)] = _paired_cell(*await time_async_paired(same_size, fetch, small, budget))
        except Exception as exc:
            out[str(size)] = unavailable(exc)
    return out


def _paired_cell(samples: list[int], paired: list[int]) -> dict[str, Any]:
    """A cell of a line's samples, with the small calls timed between them."""
    cell = summarize(samples)
    cell["small_paired"] = summarize(paired)
    return cell


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
    transport: str, kind: str, before: dict[str, int | None], after: dict[str, int | None]
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
    aliased = transport == "torch_shm" and kind in ALIASED_KINDS
    if aliased and delta.get("shm_aliased", 0) < delta.get("shm_tensors", 0):
        copied = delta.get("shm_tensors", 0) - delta.get("shm_aliased", 0)
        warnings.append(f"{copied} shared tensors were copied, not aliased")
    received = delta.get("shm_received", 0)
    if aliased and delta.get("shm_received_aliased", received) < received:
        copied = received - delta.get("shm_received_aliased", 0)
        warnings.append(f"{copied} shared result tensors were copied, not aliased")
    if warnings:
        out["warning"] = "; ".join(warnings)
    return out


#: The tensorrpc lines: key, name in the tables, transport, source of the tensors sent.
TORCH_SHM_LINES: tuple[tuple[str, str, str, str], ...] = (
    ("frames", "tensorrpc frames", "frames", "same"),
    ("shm_new", "tensorrpc torch_shm (new tensor each call)", "torch_shm", "new"),
    ("shm_same", "tensorrpc torch_shm (same tensor each call)", "torch_shm", "same"),
    ("shm_torch", "tensorrpc torch_shm (share_memory_)", "torch_shm", "torch_shared"),
    ("shm_loader", "tensorrpc torch_shm (DataLoader batch)", "torch_shm", "loader"),
    (
        "shm_slots",
        "tensorrpc torch_shm (DataLoader batch, SharedBatches)",
        "torch_shm",
        "loader_slots",
    ),
    ("shm_shared", "tensorrpc torch_shm (tensorrpc.share)", "torch_shm", "share"),
    ("shm_first", "tensorrpc torch_shm (first call of a new size)", "torch_shm", "first"),
    ("auto", "tensorrpc auto (default)", "auto", "new"),
)
#: Bytes of distinct pre-made tensors a "new tensor each call" line cycles through: more
#: than the sender's pool keeps idle (``pool_keep_bytes``, 512 MiB).
NEW_TENSOR_BYTES = 640 * MIB
#: Lines whose source is already in shared memory: sent by alias, or flagged.
ALIASED_KINDS = ("share", "torch_shared", "loader", "loader_slots")
#: Lines whose tensors are a DataLoader's batches (`Batches`).
LOADER_KINDS = ("loader", "loader_slots")


class _SizedArange(torch.utils.data.Dataset[torch.Tensor]):
    """A dataset whose item ``size`` is `make_tensor`'s tensor of ``size`` bytes."""

    def __getitem__(self, size: int) -> torch.Tensor:
        return make_tensor(size)

    def __len__(self) -> int:
        return 1 << 40


class _Sizes(torch.utils.data.Sampler[int]):
    """The loader's sampler (it runs in this process): the indices of the next epoch."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def __iter__(self) -> Any:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


class Batches:
    """Batches of a ``DataLoader`` with one worker, fetched a window at a time.

    Each window is one epoch of ``window`` items, so that once it is fetched the worker
    is idle (nothing prefetched) while the calls are timed; the batches arrive the way a
    training loop gets them, in torch's shared memory (a new file each), or with
    ``slots`` through `tensorrpc.loader.SharedBatches` (written into its slots, each
    batch sent before now held until the next fetch). `close` shuts the worker down.
    """

    def __init__(self, window: int, *, slots: bool = False) -> None:
        from tensorrpc.loader import SharedBatches

        self.window = window
        self._sampler = _Sizes()
        # (the window in hand, the one sent, and a call whose release is still on its way)
        self._slots = SharedBatches(max(SIZES), hold=2 * window + 1) if slots else None
        self._loader = torch.utils.data.DataLoader(
            _SizedArange(),
            batch_size=None,
            sampler=self._sampler,
            num_workers=1,
            persistent_workers=True,
            prefetch_factor=1,
            multiprocessing_context="spawn",
            collate_fn=None if self._slots is None else self._slots.collate,
        )
        self._ready: list[torch.Tensor] = []
        self._sent: list[torch.Tensor] = []

    def needs_fetch(self, size: int) -> bool:
        """Whether `take` of ``size`` fetches a new window."""
        return not self._ready or self._ready[0].nbytes != size

    def take(self, size: int) -> torch.Tensor:
        """The next batch of ``size`` bytes, never handed out before (fetched untimed
        when the window is used up; the batches of the last window are freed then)."""
        if self.needs_fetch(size):
            self._ready.clear()  # (what is left of a window of another size)
            self._sent.clear()
            self._sampler.indices = [size] * self.window
            if self._slots is None:
                self._ready = list(self._loader)
            else:
                self._ready = list(self._slots.iterate(self._loader))
                if self._slots.fallbacks:
                    raise RuntimeError(f"{self._slots.fallbacks} batches missed a slot")
            if not _in_shared_memory(self._ready[0]):
                raise RuntimeError("a DataLoader batch is not in shared memory")
        batch = self._ready.pop()
        self._sent.append(batch)  # held past its call: its free is never timed
        return batch

    def close(self) -> None:
        """Free the batches and stop the worker."""
        self._ready.clear()
        self._sent.clear()
        iterator = getattr(self._loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
        del self._loader
        if self._slots is not None:
            self._slots.close()


def _in_shared_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is in torch's shared memory or in tensorrpc's."""
    from tensorrpc.transports._shared import lookup

    return bool(t.is_shared()) or lookup(t.untyped_storage()) is not None  # type: ignore[no-untyped-call]


def _first_sizes(size: int, count: int) -> list[int]:
    """``count`` sizes just above ``size``, each needing a pool segment of its own."""
    return [size + (k + 1) * (2 * MIB) for k in range(count)]


def _copy_ref(sources: list[torch.Tensor], budget: Budget) -> dict[str, Any]:
    """One ``Tensor.copy_`` of the line's own sources (cycled) into a preallocated tensor,
    on one thread (see `_in_process`). The destination is what the pool copies into:
    pages of a memfd, shared, already faulted in (`tensorrpc.share` of a tensor)."""
    import tensorrpc

    dst = tensorrpc.share(torch.zeros_like(sources[0]))
    it = iter(range(1 << 62))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return summarize(time_sync(lambda: dst.copy_(sources[next(it) % len(sources)]), budget))
    finally:
        torch.set_num_threads(threads)


def _sources(kind: str, size: int, budget: Budget) -> list[torch.Tensor]:
    """The tensors a line sends at ``size`` (see `TORCH_SHM_LINES`; not "loader")."""
    import tensorrpc

    if kind == "first":
        return [make_tensor(n) for n in _first_sizes(size, max(budget.min_count, 2))]
    if kind == "new":
        n = min(-(-NEW_TENSOR_BYTES // size), budget.warmup + budget.count + 1)
        return [make_tensor(size) for _ in range(max(n, 2))]
    if kind == "share":
        return [tensorrpc.share(make_tensor(size))]
    if kind == "torch_shared":
        return [_shared_tensor(size)]
    return [make_tensor(size)]


#: Untimed small calls made after each window is fetched (see `_next_batch`).
WAKE_CALLS = 2


async def _next_batch(
    batches: Batches,
    size: int,
    wake: Callable[[], Awaitable[Any]] | None,
    fetched: list[bool] | None = None,
) -> torch.Tensor:
    """The next batch; a fetch runs in a thread, and `WAKE_CALLS` untimed small calls
    follow it. ``fetched`` gets, for each batch, whether a fetch came just before it.

    A fetch leaves the client's loop and the engine idle for 100 ms or more (the worker
    writes the window); on this VM the first call after 50 ms of idle takes about 1 ms
    and the second 0.4 ms, a small call as much as a batch (``bench.idle_wake``), while
    the small calls this line is compared with are timed between its batches, on ends
    that are awake. The wake-up calls keep that idle cost out of both sides of the
    comparison.
    """
    fetch = batches.needs_fetch(size)
    if fetched is not None:
        fetched.append(fetch)
    if not fetch:
        return batches.take(size)  # (no thread hop: the other lines pay none either)
    batch = await asyncio.to_thread(batches.take, size)
    if wake is not None:
        for _ in range(WAKE_CALLS):
            await wake()
    return batch


def _by_fetch(samples: list[int], fetched: list[bool]) -> dict[str, Any]:
    """A loader line's samples split: the first batch after each fetch (its caches
    emptied by the worker's writes) and the others."""
    first = [s for s, f in zip(samples, fetched, strict=True) if f]
    others = [s for s, f in zip(samples, fetched, strict=True) if not f]
    if not first or not others:
        return {}
    return {"first_after_fetch": summarize(first), "others": summarize(others)}


async def _next_source(sources: list[torch.Tensor], it: Any) -> torch.Tensor:
    i: int = next(it)
    return sources[i % len(sources)]


async def _line(
    cfg: Config,
    send: Callable[[torch.Tensor], Any],
    kind: str,
    batches: Batches | None,
    small: Callable[[], Awaitable[Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time one tensorrpc line at every size; return its cells and its ``copy_`` cells.

    ``small``: the small call. Blocks of it are timed between blocks of the line's
    calls (a cell's ``small_paired``: what the line is compared with, under the same
    machine state; `time_async_paired`), and it is the untimed wake-up call after each
    window of batches is fetched.

    Everything that blocks (making the sources, fetching batches, timing the ``copy_``)
    runs in a thread, so that the client's event loop keeps answering the engine's
    heartbeats meanwhile.
    """
    out: dict[str, Any] = {}
    ref: dict[str, Any] = {}
    for size, budget in cfg.sizes.items():
        if kind == "first" and size < 64 * MIB:
            continue
        sources: list[torch.Tensor] = []
        try:
            if kind in LOADER_KINDS:
                assert batches is not None
                sources = [await asyncio.to_thread(batches.take, size)]
            else:
                sources = await asyncio.to_thread(_sources, kind, size, budget)
            if kind == "first":
                samples = []
                for t in sources:  # each a size the pool has no segment for yet
                    t0 = time.perf_counter_ns()
                    reply = await send(t)
                    samples.append(time.perf_counter_ns() - t0)
                    # (past 2**24 a float32 arange rounds: compare with its own last)
                    if tuple(reply) != (t.numel(), 0.0, float(t[-1])):
                        raise RuntimeError(f"wrong reply {reply!r} for {t.nbytes} bytes")
                out[str(size)] = summarize(samples)
                ref[str(size)] = await asyncio.to_thread(_copy_ref, sources[:1], budget)
                continue
            check(await send(sources[0]), size)
            fetched: list[bool] = []
            prepare = (
                functools.partial(_next_batch, batches, size, small, fetched)
                if kind in LOADER_KINDS and batches is not None
                else functools.partial(_next_source, sources, iter(range(1 << 62)))
            )
            samples, paired = await time_async_paired(prepare, send, small, budget)
            out[str(size)] = _paired_cell(samples, paired)
            if fetched:
                out[str(size)].update(_by_fetch(samples, fetched[-len(samples) :]))
            ref[str(size)] = await asyncio.to_thread(_copy_ref, sources, budget)
        except Exception as exc:
            out[str(size)] = unavailable(exc)
        finally:
            del sources
    return out, ref


def _tensorrpc(cfg: Config, workdir: Path) -> dict[str, Any]:
    from bench.peers._proc import PeerProcess
    from bench.peers.tensorrpc_peer import ENGINE_ID, BenchService, runtime, wait_engine

    client_cls, _ = runtime()
    addr = f"ipc://{workdir}/tensorrpc-tx.sock"

    async def case(peer: PeerProcess, loaders: dict[str, Batches]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with client_cls(BenchService, bind=addr) as client:
            await wait_engine(client, peer, cfg.ready_timeout)
            plain = client.with_options(engine=ENGINE_ID, transport="frames").stub()
            if await plain.add(1, 2) != 3:
                raise RuntimeError("wrong reply")
            small = summarize(await time_async(lambda: plain.add(1, 2), cfg.small))
            for key, name, transport, kind in TORCH_SHM_LINES:
                if cfg.lines is not None and key not in cfg.lines:
                    continue
                try:
                    stub = client.with_options(engine=ENGINE_ID, transport=transport).stub()
                    before = _counters(client)
                    sizes, ref = await _line(
                        cfg, stub.consume, kind, loaders.get(kind), lambda: plain.add(1, 2)
                    )
                    entry: dict[str, Any] = {"small": small, "sizes": sizes, "copy_": ref}
                    if key in ("frames", "shm_same", "shm_shared"):
                        # The other direction: the engine answers a tensor it holds (in
                        # tensorrpc shared memory for "shm_shared": sent by alias).
                        shared = key == "shm_shared"
                        entry["sizes_out"] = await _sizes_out_async(
                            cfg,
                            functools.partial(_produce, stub, shared=shared),
                            lambda: plain.add(1, 2),
                        )
                    entry.update(_transport_check(transport, kind, before, _counters(client)))
                except Exception as exc:
                    entry = unavailable(exc)
                out[name] = entry
            stats = _stats(client)
        if not peer.alive():
            raise RuntimeError(peer.failure())
        first = next(iter(out.values()), None)
        if isinstance(first, dict) and "unavailable" not in first:
            first["statistics"] = stats
        return out

    loaders = {"loader": Batches(window=4), "loader_slots": Batches(window=4, slots=True)}
    try:
        with PeerProcess(
            "bench.peers.tensorrpc_peer", [addr], ready_timeout=cfg.ready_timeout
        ) as peer:
            result: dict[str, Any] = run_async(lambda: case(peer, loaders), cfg.case_timeout)
    finally:
        for batches in loaders.values():
            batches.close()
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
    "tensorrpc": (_tensorrpc, tuple(name for _, name, _, _ in TORCH_SHM_LINES)),
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
    "tensorrpc frames": "the same tensor each call, an out-of-band zero-copy ZMQ frame, ipc://",
    "tensorrpc torch_shm (new tensor each call)": "a tensor not sent before (pre-made, 640 MiB "
    "of them or one per call, cycled, all held: their allocation and free are not timed): "
    "copied into tensorrpc's pool, from 8 MiB on by up to 4 threads",
    "tensorrpc torch_shm (same tensor each call)": "one tensor sent again and again: copied "
    "into tensorrpc's pool each call",
    "tensorrpc torch_shm (share_memory_)": "a share_memory_() tensor (torch's shared memory), "
    "the same each call: by alias where the receiver's gate allows, else copied",
    "tensorrpc torch_shm (DataLoader batch)": "a batch from a DataLoader with one worker, a "
    "new batch each call (fetched untimed, a window of 4; two untimed small calls after a "
    "fetch wake both ends): by alias where the gate allows, else copied",
    "tensorrpc torch_shm (DataLoader batch, SharedBatches)": "as the line above, the loader's "
    "collate_fn tensorrpc.loader.SharedBatches: each batch written into one of its slots, "
    "which the engine has mapped since the slot's first batch",
    "tensorrpc torch_shm (tensorrpc.share)": "a tensorrpc.share() tensor: only the handle travels",
    "tensorrpc torch_shm (first call of a new size)": "64 MiB + 2k MiB, each sample a size "
    "the pool has no segment for: a new segment made and filled",
    "tensorrpc auto (default)": "the default policy, a new tensor each call (as above)",
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


def _cell_ms(cell: Any) -> str:
    value = cell.get("median_us") if isinstance(cell, dict) else None
    return "-" if not isinstance(value, int | float) else f"{value / 1000:.3f} ms"


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.transfer``: chosen tensorrpc lines at chosen sizes, each divided by
    its own ``copy_`` (for reruns on a quiet machine, old and new builds alternating)."""
    import argparse
    import os
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.transfer", description=main.__doc__)
    parser.add_argument("--quick", action="store_true", help="reduced budgets")
    keys = [key for key, _, _, _ in TORCH_SHM_LINES]
    parser.add_argument("--line", action="append", choices=keys, help="only this line")
    parser.add_argument("--size", action="append", type=int, choices=SIZES, help="bytes")
    args = parser.parse_args(argv)
    cfg = config(args.quick)
    sizes = args.size or list(SIZES)
    cfg = dataclasses.replace(
        cfg,
        sizes={size: budget for size, budget in cfg.sizes.items() if size in sizes},
        lines=tuple(args.line) if args.line else None,
    )
    with tempfile.TemporaryDirectory(prefix="trpc-transfer-") as tmp:
        out = _tensorrpc(cfg, Path(tmp))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for name, entry in out.items():
        if "unavailable" in entry:
            print(f"{name}: unavailable: {entry['unavailable']}")
            continue
        print(f"{name} (small call {_cell_ms(entry.get('small'))})")
        for size in cfg.sizes:
            cell = entry["sizes"].get(str(size))
            ref = entry["copy_"].get(str(size))
            if cell is None:
                continue
            if isinstance(cell, dict) and "unavailable" in cell:
                print(f"  {size} B: unavailable: {cell['unavailable']}")
                continue
            med, one = (c.get("median_us") if isinstance(c, dict) else None for c in (cell, ref))
            ratio = f"{med / one:.2f}x" if med and one else "-"
            print(f"  {size} B: {_cell_ms(cell)}; one copy_ {_cell_ms(ref)}; ratio {ratio}")
            paired = cell.get("small_paired")
            if isinstance(paired, dict) and med:
                extra = (med - paired["median_us"]) / 1000
                print(f"    small calls between {_cell_ms(paired)}; minus them {extra:+.3f} ms")
            if "others" in cell:
                first, others = _cell_ms(cell["first_after_fetch"]), _cell_ms(cell["others"])
                print(f"    first batch after a fetch {first}; the others {others}")
        if entry.get("warning"):
            print(f"  warning: {entry['warning']}")
    print(f"load average at the end: {load}")
    return 0


__all__ = [
    "CASES",
    "SIZES",
    "TORCH_SHM_LINES",
    "Batches",
    "Config",
    "check",
    "check_tensor",
    "config",
    "make_tensor",
    "run",
]


if __name__ == "__main__":
    raise SystemExit(main())
