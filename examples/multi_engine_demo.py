"""The multi-engine demo: one client, several engine processes, a mixed load.

    python -m examples.multi_engine_demo [--engines 3] [--requests 120]

It starts N engine processes that each serve a tiny transformer (``examples/tiny_lm.py``),
binds one client socket they dial into, and sends a mixed load through it:

* text requests (prompt token ids), balanced across engines, tokens streamed back;
* image requests: a 768 KiB image tensor to ``encode_image`` (over torch shared memory or
  zero-copy frames, alternately), then generation from the returned prompt embeddings on
  the same engine (targeted);
* calls that time out on purpose (a deadline shorter than the work), calls cancelled by
  the caller, and streams the caller leaves early;
* broadcasts: ``reset`` before the run and ``stats`` after it;
* then continuous batching: ``--streams`` generation requests sent at once to one engine,
  served one stream at a time (``generate``) and then with continuous batching
  (``generate_batched``: one batched forward pass per step, new streams join at the next
  step); it shows tokens/s and time to first token of both, and checks that both gave
  every stream the same tokens.

It says what it is about to do at once (before the seconds of importing torch), then
draws with ``rich`` (the ``demo`` extra): a progress bar with live tokens/s while it
works, then per-engine, outcome and per-transport tables and a latency histogram per
engine. When stdout is not a terminal everything is plain text (no colours, no live
redraw, tables without borders). The last line is the verdict: ``verdict: PASS`` and exit
status 0 when every request ended as planned (the timeouts, cancellations and early exits
included: they are on purpose), ``verdict: FAIL`` and exit status 1 otherwise. It leaves
no process, socket file or /dev/shm segment behind (Ctrl-C included). docs/quickstart.md
reads its output line by line.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The command line (only argparse: ``--help`` answers before torch is imported)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.multi_engine_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engines", type=int, default=3, help="engine processes (default 3)")
    parser.add_argument("--requests", type=int, default=120, help="requests (default 120)")
    parser.add_argument("--seed", type=int, default=0, help="the load's random seed")
    parser.add_argument(
        "--streams", type=int, default=32, help="streams of the continuous batching comparison"
    )
    return parser


def announce(args: argparse.Namespace) -> None:
    """The first line, at once: importing torch and starting engines takes seconds."""
    print(
        f"tensorrpc multi-engine demo: {args.engines} engine processes, one client, "
        f"{args.requests} requests; starting (takes a few seconds)...",
        file=sys.stderr,
        flush=True,
    )


_ARGS: argparse.Namespace | None = None
if __name__ == "__main__":
    _ARGS = build_parser().parse_args()
    announce(_ARGS)

# The heavy imports come after the first line on purpose (torch alone takes seconds).
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import torch  # noqa: E402
from rich import box  # noqa: E402
from rich.bar import Bar  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import (  # noqa: E402
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table  # noqa: E402

import tensorrpc  # noqa: E402
from examples.lm_service import EngineStats, LMEngine  # noqa: E402

ENGINE_START_TIMEOUT = 60.0
CONCURRENCY = 8  # requests in flight at once


@dataclass
class Tally:
    """What the client saw, per engine and overall."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    tokens: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    done: int = 0


#: What the load is made of, printed before it starts.
LEGEND = (
    "what it sends: text prompts balanced over the engines (tokens streamed back); images "
    "(768 KiB tensors) over torch_shm or frames, then generation on the same engine; and, "
    "on purpose, calls whose deadline is shorter than their work (they time out: the "
    "'timeouts' column), calls the caller cancels, and streams it leaves early. Those are "
    "planned outcomes, not failures. Then the same streams on one engine, one at a time "
    "and with continuous batching. The last line says whether every request ended as "
    "planned."
)

#: Upper bounds (ms) of the latency histogram's buckets; the last one is open.
BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


@dataclass
class Screen:
    """Where the demo draws: stdout for results, stderr for progress and status lines.

    On a terminal, colours, rounded tables and a live progress bar; otherwise plain text:
    no colours or escape codes, tables without borders, the progress bar drawn once at
    the end.
    """

    out: Console = field(default_factory=Console)
    err: Console = field(default_factory=lambda: Console(stderr=True))

    @property
    def box(self) -> box.Box | None:
        return box.ROUNDED if self.out.is_terminal else None

    def table(self, title: str, *columns: str) -> Table:
        table = Table(title=title, box=self.box, title_justify="left", pad_edge=False)
        for i, name in enumerate(columns):
            table.add_column(name, justify="left" if i == 0 else "right")
        return table


def progress_bar(screen: Screen) -> Progress:
    """The bar: requests done of the total, tokens so far and tokens/s, elapsed time."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TextColumn("{task.fields[tokens]} tokens"),
        TextColumn("[cyan]{task.fields[rate]:.0f} tok/s"),
        TimeElapsedColumn(),
        console=screen.err,
    )


@contextmanager
def engine_processes(address: str, count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start ``count`` engine processes dialing ``address``; always stop and reap them."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(count):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "examples.demo_engine",
                        "--connect",
                        address,
                        "--engine-id",
                        f"engine-{i}",
                    ],
                    cwd=Path(__file__).resolve().parent.parent,
                    start_new_session=True,  # Ctrl-C reaches the demo, which stops them in order
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def run_load(
    client: tensorrpc.Client[LMEngine],
    requests: int,
    tally: Tally,
    seed: int,
    progress: Progress,
    task: TaskID,
) -> None:
    rng = random.Random(seed)
    engines = sorted(client.engines)
    start = time.perf_counter()

    def record(engine: str, started: float, outcome: str, tokens: int = 0) -> None:
        tally.latencies[engine].append(time.perf_counter() - started)
        tally.calls[engine] += 1
        tally.tokens[engine] += tokens
        tally.outcomes[outcome] += 1
        tally.done += 1
        total = sum(tally.tokens.values())
        rate = total / max(time.perf_counter() - start, 1e-9)
        progress.update(task, completed=tally.done, tokens=total, rate=rate)

    async def text_request(i: int) -> None:
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(8, 64))]
        started = time.perf_counter()
        tokens = 0
        # Balanced: the client picks the engine with the fewest calls in flight.
        view = client.with_options(transport="frames" if i % 2 else "auto")
        stream = view.stream(LMEngine.generate, prompt, max_tokens=rng.randrange(8, 24))
        async with stream:
            async for _ in stream:
                tokens += 1
        record(stream.engine or "?", started, "text (balanced)", tokens)

    async def image_request(i: int) -> None:
        engine = engines[i % len(engines)]
        transport: tensorrpc.TransportName = "torch_shm" if i % 2 else "frames"
        image = torch.rand(3, 256, 256)
        started = time.perf_counter()
        embeds = await client.with_options(engine=engine, transport=transport).call(
            LMEngine.encode_image, image
        )
        tokens = 0
        async for _ in (
            client.with_options(engine=engine)
            .stub()
            .generate([1, 2, 3], max_tokens=12, prompt_embeds=embeds)
        ):
            tokens += 1
        record(engine, started, f"image/{transport}", tokens)

    async def deadline_request(i: int) -> None:
        engine = engines[i % len(engines)]
        started = time.perf_counter()
        try:
            await client.with_options(engine=engine, timeout=0.05).stub().sleep(2.0)
        except tensorrpc.CallTimeoutError:
            tally.errors[engine] += 1
            record(engine, started, "timed out (on purpose)")
        else:
            tally.unexpected.append("a call meant to time out returned")

    async def cancelled_request(i: int) -> None:
        engine = engines[i % len(engines)]
        started = time.perf_counter()
        with anyio.move_on_after(0.05) as scope:
            await client.with_options(engine=engine).stub().sleep(2.0)
        if not scope.cancelled_caught:
            tally.unexpected.append("a call meant to be cancelled returned")
        record(engine, started, "cancelled (on purpose)")

    async def early_break_request(i: int) -> None:
        engine = engines[i % len(engines)]
        started = time.perf_counter()
        tokens = 0
        stream = client.with_options(engine=engine).stream(
            LMEngine.generate, [5, 6, 7], max_tokens=200
        )
        async for _ in stream:
            tokens += 1
            if tokens == 3:
                break
        await stream.aclose()  # the engine's generator is cancelled at once
        record(engine, started, "stream left early", tokens)

    kinds = ["text"] * 6 + ["image"] * 2 + ["deadline", "cancel", "early_break"]
    plan = [rng.choice(kinds) for _ in range(requests)]

    async def one(i: int, kind: str) -> None:
        try:
            if kind == "text":
                await text_request(i)
            elif kind == "image":
                await image_request(i)
            elif kind == "deadline":
                await deadline_request(i)
            elif kind == "cancel":
                await cancelled_request(i)
            else:
                await early_break_request(i)
        except tensorrpc.TensorRPCError as exc:
            tally.unexpected.append(f"{kind}: {type(exc).__name__}: {exc}")

    # A fixed pool of workers takes the requests in order, CONCURRENCY in flight at a time.
    # (One task per request, gated by a semaphore, made a 100,000-request run hold 100,000
    # tasks: Ctrl-C then took ~47 s to cancel them all.)
    pending = iter(enumerate(plan))

    async def worker() -> None:
        for i, kind in pending:
            await one(i, kind)

    planned = Counter(plan)
    progress.console.print(
        f"load: {requests} requests, {CONCURRENCY} in flight: {planned['text']} text, "
        f"{planned['image']} image, and on purpose {planned['deadline']} that time out, "
        f"{planned['cancel']} cancelled, {planned['early_break']} streams left early"
    )
    async with anyio.create_task_group() as tg:
        for _ in range(CONCURRENCY):
            tg.start_soon(worker)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main_async(args: argparse.Namespace) -> int:
    screen = Screen()
    with tempfile.TemporaryDirectory(prefix="tensorrpc-demo-") as tmp:
        address = f"ipc://{tmp}/client.sock"
        async with tensorrpc.Client(LMEngine, bind=address) as client:
            with engine_processes(address, args.engines):
                await client.wait_for_engines(args.engines, timeout=ENGINE_START_TIMEOUT)
                screen.err.print(
                    f"{len(client.engines)} engines up: {', '.join(sorted(client.engines))}"
                )
                screen.err.print(LEGEND)
                await client.broadcast("reset")
                tally = Tally()
                started = time.perf_counter()
                with progress_bar(screen) as progress:
                    task = progress.add_task("load", total=args.requests, tokens=0, rate=0.0)
                    await run_load(client, args.requests, tally, args.seed, progress, task)
                elapsed = time.perf_counter() - started
                engine_stats: dict[str, EngineStats] = await client.broadcast("stats")
                summary(screen, client, tally, engine_stats, elapsed)
                await batching_comparison(screen, client, args.streams, tally)
                if tally.unexpected:
                    screen.out.print("Unexpected:", *tally.unexpected, sep="\n  ")
                # The last line: the verdict over the load and the comparison.
                screen.out.print(verdict(tally, batched=args.streams > 0), soft_wrap=True)
        return 1 if tally.unexpected else 0


def summary(
    screen: Screen,
    client: tensorrpc.Client[LMEngine],
    tally: Tally,
    engine_stats: dict[str, EngineStats],
    elapsed: float,
) -> None:
    engines = screen.table("Per engine", "engine", "pid", "requests", "tokens", "p50 ms", "p99 ms")
    engines.add_column("timeouts", justify="right")
    engines.caption = (
        "timeouts: the calls that timed out on purpose (a 50 ms deadline on 2 s of work); "
        "any other error is listed under Unexpected"
    )
    engines.caption_justify = "left"
    for engine in sorted(client.engines):
        lat = tally.latencies.get(engine, [])
        engines.add_row(
            engine,
            str(engine_stats[engine].pid),
            str(tally.calls[engine]),
            str(tally.tokens[engine]),
            f"{percentile(lat, 0.5) * 1e3:.1f}",
            f"{percentile(lat, 0.99) * 1e3:.1f}",
            str(tally.errors[engine]),
        )
    outcomes = screen.table("Outcomes", "outcome", "count")
    for name, count in sorted(tally.outcomes.items()):
        outcomes.add_row(name, str(count))
    transports = screen.table(
        "Per transport (client side; tensors small enough to ride inline are not counted)",
        "transport",
        "tensors out",
        "MiB out",
        "tensors in",
        "MiB in",
        "fallbacks",
    )
    stats = client.statistics().transports
    for name in ("frames", "torch_shm"):
        c = getattr(stats, name)
        transports.add_row(
            name,
            str(c.tensors_sent),
            f"{c.bytes_sent / 2**20:.1f}",
            str(c.tensors_received),
            f"{c.bytes_received / 2**20:.1f}",
            str(c.fallbacks),
        )
    for table in (engines, outcomes, transports, *histograms(screen, tally)):
        screen.out.print()
        screen.out.print(table)
    screen.out.print()
    screen.out.print(f"{tally.done} requests in {elapsed:.1f} s")


def verdict(tally: Tally, *, batched: bool) -> str:
    """The last line: PASS when every request ended as planned, else FAIL and how many."""
    planned = (
        f"{tally.outcomes['timed out (on purpose)']} timed out, "
        f"{tally.outcomes['cancelled (on purpose)']} cancelled and "
        f"{tally.outcomes['stream left early']} streams left early, all on purpose"
    )
    if tally.unexpected:
        return (
            f"verdict: FAIL: {len(tally.unexpected)} unexpected outcomes (listed above); "
            "exit status 1"
        )
    same = "; continuous batching gave every stream the tokens of one at a time" if batched else ""
    return (
        f"verdict: PASS: all {tally.done} requests ended as planned ({planned}); "
        f"{sum(tally.tokens.values())} tokens streamed{same}; exit status 0"
    )


def histograms(screen: Screen, tally: Tally) -> list[Table]:
    """One latency histogram per engine: calls per bucket, drawn as bars.

    The buckets shown are those from the fastest to the slowest call of any engine, so
    that the engines' histograms line up.
    """
    counts = {
        engine: Counter(bucket(seconds * 1e3) for seconds in latencies)
        for engine, latencies in sorted(tally.latencies.items())
    }
    used = [i for c in counts.values() for i in c]
    if not used:
        return []
    labels = bucket_labels()
    tables = []
    for engine, count in counts.items():
        most = max(count.values(), default=1)
        table = screen.table(f"Latency histogram: {engine}", "ms", "calls")
        table.add_column("", width=32)
        for i in range(min(used), max(used) + 1):
            table.add_row(labels[i], str(count[i]), Bar(most, 0, count[i], width=32))
        tables.append(table)
    return tables


def bucket(ms: float) -> int:
    """The histogram bucket of a latency in milliseconds."""
    for i, upper in enumerate(BUCKETS_MS):
        if ms < upper:
            return i
    return len(BUCKETS_MS)


def bucket_labels() -> list[str]:
    lower = (0, *BUCKETS_MS)
    return [f"{lo}-{hi}" for lo, hi in zip(lower, BUCKETS_MS, strict=False)] + [
        f"≥{BUCKETS_MS[-1]}"
    ]


COMPARE_TOKENS = 16  # tokens per stream in the batching comparison


async def _streams_at_once(
    client: tensorrpc.Client[LMEngine], engine: str, prompts: list[list[int]], batched: bool
) -> tuple[float, list[float], list[list[int]]]:
    """Send every prompt at once; return tokens/s, each stream's time to first token
    (from the moment all were sent) and each stream's tokens."""
    stub = client.with_options(engine=engine).stub()
    started = time.perf_counter()
    ttft = [0.0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    one_at_a_time = anyio.Lock()

    async def stream(k: int) -> None:
        if batched:
            items = stub.generate_batched(prompts[k], COMPARE_TOKENS)
        else:
            items = stub.generate(prompts[k], COMPARE_TOKENS)
        async with items:
            async for token in items:
                if not tokens[k]:
                    ttft[k] = time.perf_counter() - started
                tokens[k].append(token)

    async def one(k: int) -> None:
        if batched:
            await stream(k)
        else:
            async with one_at_a_time:  # the engine serves these one stream at a time
                await stream(k)

    async with anyio.create_task_group() as tg:
        for k in range(len(prompts)):
            tg.start_soon(one, k)
    elapsed = time.perf_counter() - started
    return sum(len(t) for t in tokens) / elapsed, ttft, tokens


async def batching_comparison(
    screen: Screen, client: tensorrpc.Client[LMEngine], streams: int, tally: Tally
) -> None:
    """One engine, ``streams`` requests at once: one stream at a time, then continuous
    batching; a table of tokens/s and time to first token."""
    if streams <= 0:
        return
    engine = sorted(client.engines)[0]
    rng = random.Random(streams)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 32))] for _ in range(streams)]
    screen.err.print(f"batching: {streams} streams at once on {engine}")
    rows = []
    outputs = []
    for name, batched in (("one stream at a time", False), ("continuous batching", True)):
        rate, ttft, tokens = await _streams_at_once(client, engine, prompts, batched)
        rows.append((name, rate, ttft))
        outputs.append(tokens)
    if outputs[0] != outputs[1]:
        tally.unexpected.append("continuous batching generated other tokens than one at a time")
    table = screen.table(
        f"Continuous batching: {streams} streams of {COMPARE_TOKENS} tokens sent at once to "
        f"{engine} (time to first token from the moment all were sent)",
        "",
        "tokens/s",
        "first token p50 ms",
        "first token p99 ms",
    )
    for name, rate, ttft in rows:
        table.add_row(
            name,
            f"{rate:,.0f}",
            f"{percentile(ttft, 0.5) * 1e3:.1f}",
            f"{percentile(ttft, 0.99) * 1e3:.1f}",
        )
    screen.out.print()
    screen.out.print(table)
    screen.out.print(f"continuous batching: {rows[1][1] / rows[0][1]:.1f}x the tokens/s")


def main() -> None:
    args = _ARGS if _ARGS is not None else build_parser().parse_args()
    torch.set_num_threads(1)
    try:
        code = anyio.run(main_async, args)
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted: engines stopped")
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
