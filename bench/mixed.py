"""Small calls under a mixed load (``python -m bench --only mixed``, or ``python -m bench.mixed``).

A service that moves large tensors also answers small control calls (vLLM's shape:
prompts and embeddings beside aborts and utility calls). Each case here makes small calls
(``add(1, 2)``) at a steady rate from one task while another task of the same client
moves large tensors through the same client and engine, one call at a time, cycling
through the directions ``in`` (the client sends the tensor), ``out`` (the engine sends
one it holds) and ``echo`` (both ways). It reports the small calls' p50/p99/p999 under
that load beside the same small calls alone, and the large calls' throughput per
direction. Per size, slices of small calls alone alternate with slices under the load
(three of each), and the ratio is against that size's own slices alone: on a shared
host whose other load comes and goes, both sides of the ratio see the same machine.

Systems (one engine process each, ``ipc://``): tensorrpc with ``transport="frames"``
and ``"torch_shm"``, each in both topologies (the engine dials in to the client's bind,
vLLM's shape; the client dials the engine's bind); raw pyzmq (a ROUTER server, a DEALER
client with one reader task and a future per call id, tensors as zero-copy frames) doing
the same mix, once on one connection and once with the large calls on a second DEALER of
their own (``pyzmq bulk socket``: what a bulk connection gives, measured raw); Ray
actors (an async actor, numpy arrays through Ray's shared-memory object store, on
loopback: `bench.peers.ray_mixed`) doing the same mix. The client drops each large
result through `tensorrpc.release_later`, as docs/transports.md recommends (a plain
``del`` where tensorrpc has none).

A small call's latency is from just before the call to its result. Its wake-up lag
(how late the steady-rate task woke for it, a stalled client event loop shows there) is
reported on its own. Then, per size, a small call made right after each large call with
nothing else in flight (the case of issue 26: what freeing the large call's buffers costs
the next call). Every loop is bounded by a count and a time budget.

Run on its own: ``python -m bench.mixed [--quick] [--seconds S] [--system NAME]
[--size MIB] [--huge-pages] [--background-nice N|idle] [--copy-threads N]``.
``--background-nice`` lowers tensorrpc's bulk threads in the client and the engines
(`tensorrpc.set_background_nice`), ``--copy-threads`` sets how many threads a large
torch_shm copy uses there (`tensorrpc.set_copy_threads`).
``--huge-pages`` runs the client (this process, started
again) and the engines with their large buffers on transparent huge pages (``GLIBC_TUNABLES=
glibc.malloc.hugetlb=1 THP_MEM_ALLOC_ENABLE=1``, what ``tensorrpc.testing`` gives the
engines it starts; docs/transports.md, "Huge pages").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import Progress, background_nice_arg, guarded, run_async

SIZES = (1 << 20, 16 << 20, 64 << 20)
QUICK_SIZES = (1 << 20, 16 << 20)
DIRECTIONS = ("in", "out", "echo")
TOPOLOGIES = ("engine dials in", "client dials")


@dataclass(frozen=True, slots=True)
class Config:
    """Budgets of the mixed-load section."""

    sizes: tuple[int, ...]
    seconds: float  # per size: small calls alone, and as long under load
    rate: float  # small calls per second
    max_small: int  # small calls per slice, at most
    max_large: int  # large calls per size, at most
    max_after: int  # large calls each followed by one small call, at most
    case_timeout: float
    ready_timeout: float
    slices: int = 3  # per size: alternating slices alone and under load, each


def config(
    quick: bool, seconds: float | None = None, sizes: tuple[int, ...] | None = None
) -> Config:
    """The full or the reduced (``--quick``) budgets (``sizes``: only these, in bytes)."""
    if quick:
        cfg = Config(QUICK_SIZES, seconds or 0.4, 500.0, 1_000, 50, 12, 120.0, 60.0, 2)
    else:
        cfg = Config(SIZES, seconds or 2.0, 500.0, 5_000, 400, 60, 240.0, 60.0)
    return cfg if not sizes else dataclasses.replace(cfg, sizes=sizes)


def _percentile(sorted_s: list[float], q: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1e6


def small_summary(lat: list[float], lag: list[float]) -> dict[str, Any]:
    """p50/p99/p999 of the small calls (µs), and their wake-up lag's p99."""
    if not lat:
        raise RuntimeError("no small call completed")
    s = sorted(lat)
    return {
        "n": len(s),
        "p50_us": _percentile(s, 0.5),
        "p99_us": _percentile(s, 0.99),
        "p999_us": _percentile(s, 0.999),
        "max_us": s[-1] * 1e6,
        "lag_p99_us": _percentile(sorted(lag), 0.99) if lag else 0.0,
    }


@dataclass(slots=True)
class Small:
    """The small calls' latencies and wake-up lags (s) of one condition, over its slices."""

    lat: list[float] = dataclasses.field(default_factory=list)
    lag: list[float] = dataclasses.field(default_factory=list)


async def small_loop(
    call: Callable[[], Awaitable[Any]], cfg: Config, stop: asyncio.Event, into: Small
) -> None:
    """Small calls every ``1/rate`` s into ``into`` until ``stop`` (or the budgets)."""
    interval = 1.0 / cfg.rate
    end_at = time.perf_counter() + cfg.seconds + 30.0  # a hard stop if `stop` never comes
    next_at = time.perf_counter()
    made = 0
    while not stop.is_set() and made < cfg.max_small and time.perf_counter() < end_at:
        now = time.perf_counter()
        if next_at > now:
            await asyncio.sleep(next_at - now)
        start = time.perf_counter()
        if await call() != 3:
            raise RuntimeError("wrong reply to add(1, 2)")
        done = time.perf_counter()
        into.lat.append(done - start)
        into.lag.append(max(0.0, start - next_at))
        made += 1
        next_at = max(next_at + interval, done)


@dataclass(slots=True)
class Large:
    """The large calls of one size over its slices: calls and seconds per direction."""

    ops: dict[str, Callable[[], Awaitable[Any]]]
    order: Iterator[str]
    calls: dict[str, int]
    spent: dict[str, float]

    @classmethod
    def of(cls, ops: dict[str, Callable[[], Awaitable[Any]]]) -> Large:
        return cls(ops, itertools.cycle(ops), dict.fromkeys(ops, 0), dict.fromkeys(ops, 0.0))

    def total(self) -> int:
        return sum(self.calls.values())


async def large_loop(large: Large, seconds: float, cfg: Config, *, last: bool) -> None:
    """Large calls one at a time, cycling through the directions, for ``seconds`` (the
    ``last`` slice of a size goes on until every direction has had a call)."""
    stop_at = time.perf_counter() + seconds
    while large.total() < cfg.max_large:
        short = last and not all(large.calls.values())
        if time.perf_counter() >= stop_at and not short:
            break
        direction = next(large.order)
        start = time.perf_counter()
        await large.ops[direction]()
        large.spent[direction] += time.perf_counter() - start
        large.calls[direction] += 1


def large_summary(large: Large, size: int) -> dict[str, Any]:
    """Calls, ms per call and MiB/s per direction (echo moves ``size`` both ways)."""
    out: dict[str, Any] = {}
    for direction, calls in large.calls.items():
        moved = size * calls * (2 if direction == "echo" else 1)
        secs = large.spent[direction]
        out[direction] = {
            "calls": calls,
            "ms_per_call": secs / calls * 1e3 if calls else None,
            "mib_per_s": moved / secs / (1 << 20) if secs > 0 else None,
        }
    return out


async def _alone_slice(small: Callable[[], Awaitable[Any]], cfg: Config, into: Small) -> None:
    stop = asyncio.Event()
    task = asyncio.ensure_future(small_loop(small, cfg, stop, into))
    await asyncio.sleep(cfg.seconds / cfg.slices)
    stop.set()
    await task


async def _loaded_slice(
    small: Callable[[], Awaitable[Any]], large: Large, cfg: Config, into: Small, last: bool
) -> None:
    stop = asyncio.Event()
    task = asyncio.ensure_future(small_loop(small, cfg, stop, into))
    try:
        await large_loop(large, cfg.seconds / cfg.slices, cfg, last=last)
    finally:
        stop.set()
        await task


async def measure(
    small: Callable[[], Awaitable[Any]],
    large_ops: Callable[[int], dict[str, Callable[[], Awaitable[Any]]]],
    cfg: Config,
) -> dict[str, Any]:
    """Per size, slices of small calls alone alternating with slices under that size's
    large load (``cfg.slices`` of each), so that both see the same machine: a load that
    comes and goes on a shared host lands on both sides of the ratio."""
    for _ in range(200):  # warm-up
        await small()
    every_alone = Small()
    result: dict[str, Any] = {"sizes": {}}
    for size in cfg.sizes:
        ops = large_ops(size)
        first: dict[str, float] = {}
        for direction, op in ops.items():  # the first call of a size: pool growth, faults
            start = time.perf_counter()
            await op()
            first[direction] = (time.perf_counter() - start) * 1e3
        alone, under, large = Small(), Small(), Large.of(ops)
        for n in range(cfg.slices):
            await _alone_slice(small, cfg, alone)
            await _loaded_slice(small, large, cfg, under, last=n == cfg.slices - 1)
        every_alone.lat += alone.lat
        every_alone.lag += alone.lag
        alone_s = small_summary(alone.lat, alone.lag)
        under_s = small_summary(under.lat, under.lag)
        result["sizes"][str(size)] = {
            "alone": alone_s,
            "small": under_s,
            "p99_vs_alone": under_s["p99_us"] / alone_s["p99_us"],
            "large": large_summary(large, size),
            "first_call_ms": first,
            "after_large": await after_large(small, ops, cfg),
        }
    result["alone"] = small_summary(every_alone.lat, every_alone.lag)
    return result


async def after_large(
    small: Callable[[], Awaitable[Any]],
    ops: dict[str, Callable[[], Awaitable[Any]]],
    cfg: Config,
) -> dict[str, Any]:
    """A small call made right after each large call (one at a time, nothing concurrent):
    what freeing the large call's buffers costs the next call, per direction (µs)."""
    lat: dict[str, list[float]] = {direction: [] for direction in ops}
    stop_at = time.perf_counter() + cfg.seconds
    for n, direction in enumerate(itertools.cycle(ops)):
        if n >= cfg.max_after or time.perf_counter() >= stop_at:
            break
        await ops[direction]()
        start = time.perf_counter()
        if await small() != 3:
            raise RuntimeError("wrong reply to add(1, 2)")
        lat[direction].append(time.perf_counter() - start)
    return {
        d: {"n": len(v), "p50_us": statistics.median(v) * 1e6, "max_us": max(v) * 1e6}
        for d, v in lat.items()
        if v
    }


# -- tensorrpc ----------------------------------------------------------------------------


def _drop_later() -> Callable[[Any], None]:
    import tensorrpc

    release = getattr(tensorrpc, "release_later", None)

    def drop(value: Any) -> None:
        if release is not None:
            release(value)

    return drop


def _tensorrpc(
    cfg: Config, workdir: Path, transport: str, topology: str, idle: bool = False
) -> dict[str, Any]:
    """tensorrpc with ``transport``; ``idle``: its bulk threads (copies, release) under
    ``SCHED_IDLE`` in the client and the engine (``tensorrpc.set_background_nice("idle")``;
    the release thread stays so for the rest of this process: these cases run last)."""
    import torch

    import tensorrpc
    from bench.peers._proc import PeerProcess
    from bench.peers.tensorrpc_peer import (
        BACKGROUND_NICE_ENV,
        ENGINE_ID,
        BenchService,
        runtime,
        wait_engine,
    )

    client_cls, _ = runtime()
    listen = topology == "client dials"
    where = "listen" if listen else "dialin"
    addr = f"ipc://{workdir}/mixed-{transport}-{where}{'-idle' if idle else ''}.sock"
    if idle:
        tensorrpc.set_background_nice("idle")
        os.environ[BACKGROUND_NICE_ENV] = "idle"  # (the engine it starts inherits it)
    drop = _drop_later()

    async def case(peer: PeerProcess) -> dict[str, Any]:
        where = {"connect": addr} if listen else {"bind": addr}
        async with client_cls(BenchService, **where) as client:
            await wait_engine(client, peer, cfg.ready_timeout)
            plain = client.with_options(engine=ENGINE_ID).stub()
            stub = client.with_options(engine=ENGINE_ID, transport=transport).stub()

            def large_ops(size: int) -> dict[str, Callable[[], Awaitable[Any]]]:
                t = torch.ones(size // 4, dtype=torch.float32)

                async def send_in() -> None:
                    if (await stub.consume(t))[0] != t.numel():
                        raise RuntimeError("wrong reply to consume")

                async def get_out() -> None:
                    r = await stub.produce(size, False)
                    if r.numel() != size // 4:
                        raise RuntimeError("wrong tensor from produce")
                    drop(r)

                async def echo() -> None:
                    r = await stub.echo(t)
                    if r.numel() != t.numel():
                        raise RuntimeError("wrong tensor from echo")
                    drop(r)

                return {"in": send_in, "out": get_out, "echo": echo}

            return await measure(lambda: plain.add(1, 2), large_ops, cfg)

    args = [addr, "--listen"] if listen else [addr]
    try:
        with PeerProcess(
            "bench.peers.tensorrpc_peer", args, ready_timeout=cfg.ready_timeout
        ) as peer:
            result: dict[str, Any] = run_async(lambda: case(peer), cfg.case_timeout)
    finally:
        if idle:
            tensorrpc.set_background_nice(None)
            os.environ.pop(BACKGROUND_NICE_ENV, None)
    return result


# -- raw pyzmq ----------------------------------------------------------------------------


def _pyzmq(cfg: Config, workdir: Path, *, bulk: bool = False) -> dict[str, Any]:
    import ormsgpack
    import torch

    from bench.peers._proc import PeerProcess
    from bench.peers.zmq_peer import (
        OP_ADD,
        OP_ECHO,
        OP_PRODUCE,
        ZmqFutureClient,
        _tensor_frames,
    )

    addr = f"ipc://{workdir}/mixed-pyzmq{'-bulk' if bulk else ''}.sock"
    add_payload = ormsgpack.packb([1, 2])

    async def case() -> dict[str, Any]:
        async with (
            ZmqFutureClient(addr, copy=False) as small_mux,
            ZmqFutureClient(addr, copy=False) as bulk_mux,
        ):
            # bulk: large calls on a connection of their own, small calls never queue
            # behind their bytes (the design of issue 26's bulk path, measured raw)
            mux = bulk_mux if bulk else small_mux

            async def small() -> int:
                (reply,) = await small_mux.call(OP_ADD, add_payload)
                return int(ormsgpack.unpackb(reply.bytes))

            def large_ops(size: int) -> dict[str, Callable[[], Awaitable[Any]]]:
                t = torch.ones(size // 4, dtype=torch.float32)
                frames = _tensor_frames(t)

                async def send_in() -> None:
                    (reply,) = await mux.call(*frames)
                    if ormsgpack.unpackb(reply.bytes)[0] != t.numel():
                        raise RuntimeError("wrong reply to consume")

                async def get_out() -> None:
                    _, data = await mux.call(OP_PRODUCE, ormsgpack.packb(size))
                    if len(data) != size:
                        raise RuntimeError("wrong tensor from produce")

                async def echo() -> None:
                    _, data = await mux.call(OP_ECHO, *frames[1:])
                    if len(data) != size:
                        raise RuntimeError("wrong tensor from echo")

                return {"in": send_in, "out": get_out, "echo": echo}

            return await measure(small, large_ops, cfg)

    with PeerProcess(
        "bench.peers.zmq_peer", [addr, "--zero-copy"], ready_timeout=cfg.ready_timeout
    ):
        result: dict[str, Any] = run_async(case, cfg.case_timeout)
    return result


# -- Ray actors -----------------------------------------------------------------------------


def _ray(cfg: Config, workdir: Path) -> dict[str, Any]:
    import importlib.util

    from bench.peers._suite import run_json_child

    if importlib.util.find_spec("ray") is None:
        raise RuntimeError("ray is not installed (optional: pip install 'tensorrpc[bench-ray]')")
    args = ["--config", json.dumps(dataclasses.asdict(cfg)), "--temp-dir", str(workdir / "ray")]
    # Ray's own start-up (a local instance, an actor process) comes on top of the case.
    return run_json_child("bench.peers.ray_mixed", args, timeout=cfg.case_timeout + 120.0)


# -- the section --------------------------------------------------------------------------


def system_names() -> list[str]:
    """Every system this section measures, as named in its results."""
    names = [f"tensorrpc {tr} ({topo})" for tr in ("frames", "torch_shm") for topo in TOPOLOGIES]
    # (last: the idle setting leaves this process's release thread under SCHED_IDLE)
    idle = [f"tensorrpc {tr} idle ({t})" for tr in ("frames", "torch_shm") for t in TOPOLOGIES]
    return [*names, "pyzmq", "pyzmq bulk socket", "ray", *idle]


def _case(name: str, cfg: Config, workdir: Path) -> dict[str, Any]:
    if name.startswith("pyzmq"):
        return _pyzmq(cfg, workdir, bulk=name != "pyzmq")
    if name == "ray":
        return _ray(cfg, workdir)
    words = name.split(" (")[0].split()  # tensorrpc TRANSPORT [idle]
    topology = name.split(" (")[1].rstrip(")")
    return _tensorrpc(cfg, workdir, words[1], topology, idle=words[2:] == ["idle"])


def run(
    quick: bool,
    *,
    workdir: Path,
    progress: Progress,
    systems: list[str] | None = None,
    seconds: float | None = None,
    sizes: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Measure every system (or those named in ``systems``); failures become entries."""
    cfg = config(quick, seconds, sizes)
    results: dict[str, Any] = {
        "sizes": list(cfg.sizes),
        "seconds": cfg.seconds,
        "rate_per_s": cfg.rate,
        "systems": {},
    }
    for name in system_names():
        if systems and name not in systems and name.split(" (")[0] not in systems:
            continue
        results["systems"][name] = guarded(
            progress, f"mixed: {name}", functools.partial(_case, name, cfg, workdir)
        )
    return results


def report(mixed: dict[str, Any]) -> list[str]:
    """The markdown of this section."""
    rate = mixed.get("rate_per_s", "?")
    lines = [
        "## Small calls under a mixed load",
        "",
        f"`add(1, 2)` at {rate}/s from one task while another task of the same client moves "
        "large tensors one call at a time (cycling in, out, echo). Small-call latency under "
        "load beside the same calls alone (per size: its own slices alone, alternating "
        "with those under load; the alone row pools them); large throughput in MiB/s per "
        "direction (echo counts both ways).",
        "",
        "| system | size | small p50 | p99 | p999 | p99 / alone | wake lag p99 "
        "| in MiB/s | out MiB/s | echo MiB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in mixed.get("systems", {}).items():
        if "unavailable" in entry:
            lines.append(f"| {name} | {entry['unavailable']} |||||||||")
            continue
        a = entry["alone"]
        lines.append(
            f"| {name} | alone | {a['p50_us']:.0f} µs | {a['p99_us']:.0f} µs "
            f"| {a['p999_us']:.0f} µs | 1.0 | {a['lag_p99_us']:.0f} µs ||||"
        )
        for size, cell in entry["sizes"].items():
            s = cell["small"]
            large = cell["large"]
            rates = [large.get(d, {}).get("mib_per_s") for d in DIRECTIONS]
            ratio = f"{cell['p99_vs_alone']:.1f}"
            if "alone" in cell:  # against this size's own slices alone
                ratio += f" (of {cell['alone']['p99_us']:.0f} µs)"
            lines.append(
                f"| {name} | {int(size) >> 20} MiB | {s['p50_us']:.0f} µs | {s['p99_us']:.0f} µs "
                f"| {s['p999_us']:.0f} µs | {ratio} | {s['lag_p99_us']:.0f} µs | "
                + " | ".join("-" if r is None else f"{r:.0f}" for r in rates)
                + " |"
            )
    lines += [
        "",
        "A small call made right after a large one (nothing else in flight): its median "
        "latency per direction of the large call, beside the small call alone.",
        "",
        "| system | size | alone p50 | after in | after out | after echo |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, entry in mixed.get("systems", {}).items():
        if "unavailable" in entry:
            continue
        for size, cell in entry["sizes"].items():
            after = cell.get("after_large", {})
            figures = [after.get(d, {}).get("p50_us") for d in DIRECTIONS]
            lines.append(
                f"| {name} | {int(size) >> 20} MiB | {entry['alone']['p50_us']:.0f} µs | "
                + " | ".join("-" if f is None else f"{f:.0f} µs" for f in figures)
                + " |"
            )
    return lines


_HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "THP_MEM_ALLOC_ENABLE": "1"}


def _restart_with_huge_pages() -> None:
    """Start this process again with `_HUGE_PAGES` set (malloc reads them at start-up)."""
    if all(os.environ.get(k) == v for k, v in _HUGE_PAGES.items()):
        return
    env = {**os.environ, **_HUGE_PAGES}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "bench.mixed", *sys.argv[1:]], env)


def main() -> None:
    """Run the section alone; print its markdown (and ``--json`` the raw results)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=None, help="per case (default 2)")
    parser.add_argument("--system", action="append", help="only this system (repeatable)")
    parser.add_argument(
        "--size", type=int, action="append", help="only this tensor size in MiB (repeatable)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    parser.add_argument(
        "--huge-pages", action="store_true", help="large buffers on transparent huge pages"
    )
    parser.add_argument(
        "--background-nice",
        type=background_nice_arg,
        default=None,
        help="tensorrpc.set_background_nice(N or idle) in the client and the engines",
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=None,
        help="tensorrpc.set_copy_threads(N) in the client and the engines",
    )
    args = parser.parse_args()
    if args.copy_threads is not None:
        from bench.peers.tensorrpc_peer import apply_copy_threads

        apply_copy_threads(args.copy_threads)
    if args.huge_pages:
        _restart_with_huge_pages()
    if args.background_nice is not None:
        from bench.peers.tensorrpc_peer import apply_background_nice

        apply_background_nice(args.background_nice)

    def progress(msg: str) -> None:
        print(f"[mixed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="trpc-mixed-") as tmp:
        results = run(
            args.quick,
            workdir=Path(tmp),
            progress=progress,
            systems=args.system,
            seconds=args.seconds,
            sizes=tuple(mib << 20 for mib in args.size) if args.size else None,
        )
    results["huge_pages"] = args.huge_pages
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    print("\n".join(report(results)))
    pages = "transparent huge pages" if args.huge_pages else "the processes' default pages"
    print(f"\nlarge buffers on {pages}")
    if args.background_nice is not None:
        print(f"tensorrpc's bulk threads at nice {args.background_nice}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
