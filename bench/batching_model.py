"""A closed loop of callers on the engine's batcher, on a fake clock (no sockets, no load).

    python -m bench.batching_model [--callers 64] [--step-ms 5] [--delay-ms 2]

`bench.batching`'s 64 callers each call again as soon as they get a result. This model
runs the same loop on `tensorrpc._batching.Batcher` itself (its closing rules, nothing
else) with the rest reduced to two numbers: the handler's step, and the client's CPU per
call ``c`` (it turns the replies of a batch around one after the other, so the k-th
caller of a batch sends its next call ``k * c`` after the batch ends; the turnaround of
64 callers is ``64 * c``). The engine's own CPU is left out. It prints, per ``c``, the
mean batch and the median latency in the steady state, from a start with every caller
at once and from a loop that one caller once leaves late (by ``max_delay`` + 1 ms, so
that it misses its batch), against the bound
``max_delay + one step + 1 ms``: where the bound holds on an ideal machine, and where the
rules themselves keep it out of reach.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
from dataclasses import dataclass

from tensorrpc._batching import Batcher, Batching

#: Seconds of the loop before the steady state is measured, and in all.
SETTLE_S = 0.5
HORIZON_S = 3.0


@dataclass(frozen=True, slots=True)
class Loop:
    """The steady state of one closed loop: mean batch size and median latency (s)."""

    mean_batch: float
    median_s: float


def closed_loop(callers: int, step: float, delay: float, c: float, *, late: float = 0.0) -> Loop:
    """Run the loop (callers start ``c`` apart); ``late``: caller 0's first call after a
    result goes that many seconds late, once."""
    batcher: Batcher[int] = Batcher(Batching(max_size=callers, max_delay=delay))
    events: list[tuple[float, int, int, tuple[int, ...]]] = []  # time, seq, kind, items
    seq = 0

    def at(t: float, kind: int, items: tuple[int, ...] = ()) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, items))

    send, end, tick = 0, 1, 2
    for i in range(callers):
        at(i * c, send, (i,))
    sent: dict[int, float] = {}
    sizes: list[int] = []
    latencies: list[float] = []
    running = False
    now = 0.0
    while events and now < HORIZON_S:
        now, _, kind, items = heapq.heappop(events)
        if kind == send:
            sent[items[0]] = now
            batcher.offer(items[0], now)
        elif kind == end:
            batcher.finished()
            running = False
            for rank, i in enumerate(items, start=1):
                back = now + rank * c
                if now > SETTLE_S:
                    latencies.append(back - sent[i])
                if i == 0 and late:
                    back, late = back + late, 0.0
                at(back, send, (i,))
        if not running:
            poll = batcher.poll(now)
            if poll.batch:
                running = True
                if now > SETTLE_S:
                    sizes.append(len(poll.batch))
                at(now + step, end, tuple(poll.batch))
            elif poll.wake_at != float("inf"):
                at(poll.wake_at, tick)
    return Loop(statistics.mean(sizes), statistics.median(latencies))


def main() -> None:
    """Print the model's table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    args = parser.parse_args()
    step, delay = args.step_ms / 1e3, args.delay_ms / 1e3
    bound = (delay + step + 0.001) * 1e3
    print(f"{args.callers} callers, step {args.step_ms:g} ms, max_delay {args.delay_ms:g} ms:")
    print(f"median bound (max_delay + one step + 1 ms) {bound:g} ms")
    print("| client CPU per call | turnaround | start | mean batch | median |")
    print("|---:|---:|---|---:|---:|")
    for c_us in (10, 20, 30, 40, 60):
        c = c_us / 1e6
        for start, late in (("together", 0.0), ("one caller late once", delay + 0.001)):
            loop = closed_loop(args.callers, step, delay, c, late=late)
            print(
                f"| {c_us} µs | {args.callers * c * 1e3:.2f} ms | {start} "
                f"| {loop.mean_batch:.1f} | {loop.median_s * 1e3:.2f} ms |"
            )


if __name__ == "__main__":
    main()
