"""Turn the benchmark's results into ``bench.json``, ``bench.md`` and a chart.

The JSON keeps every raw figure and the machine description; the markdown shows medians
and ratios to tensorrpc, and the targets the issues set with whether they were met; the
chart plots latency against payload size (log-log), one line per system. A system that
could not be measured shows its reason instead of a number, never a made-up figure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: multiplication sign for ratios (an escape: ruff flags the literal as ambiguous)
TIMES = "\u00d7"
#: the floor every round-trip target refers to
FLOOR = "pyzmq"
#: the reference of the transfer table's ratios
TRANSFER_REF = "tensorrpc frames"
#: The batching cases with a longer ``max_delay`` than the first's 2 ms (bench.batching):
#: about the callers' turnaround on a quiet machine, and well above it.
MID_CASE = "tensorrpc, max_delay 5 ms"
WIDE_CASE = "tensorrpc, max_delay 10 ms"
SERVE_CASE = "Ray Serve"
SERVE_FAST_CASE = "Ray Serve, throughput-optimized"
#: The same callers on a plain method with no step: the CPU of a small call, beside.
SMALL_CASE = "small call, no step"
#: the torch_shm lines of bench.transfer that targets refer to
NEW = "tensorrpc torch_shm (new tensor each call)"
SAME = "tensorrpc torch_shm (same tensor each call)"
SHARED = "tensorrpc torch_shm (tensorrpc.share)"
TORCH = "tensorrpc torch_shm (share_memory_)"
LOADER = "tensorrpc torch_shm (DataLoader batch)"
SLOTS = "tensorrpc torch_shm (DataLoader batch, SharedBatches)"


def _get(d: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _num(x: Any) -> float | None:
    if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0:
        return float(x)
    return None


def fmt_us(us: float | None) -> str:
    """A latency in µs, ms or s, three significant digits."""
    if us is None:
        return "n/a"
    if us < 1_000:
        return f"{us:.3g} µs"
    if us < 1_000_000:
        return f"{us / 1e3:.3g} ms"
    return f"{us / 1e6:.3g} s"


def fmt_rate(x: float | None) -> str:
    """A rate in calls per second."""
    if x is None:
        return "n/a"
    return f"{x:,.0f}/s"


def fmt_ratio(x: float | None) -> str:
    """A ratio, as ``1.23`` followed by a multiplication sign."""
    return "n/a" if x is None else f"{x:.2f}{TIMES}"


def fmt_size(n: int) -> str:
    """A size in bytes as KiB/MiB."""
    if n >= 1 << 20:
        return f"{n >> 20} MiB"
    if n >= 1 << 10:
        return f"{n >> 10} KiB"
    return f"{n} B"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None else None


def _target(
    tid: str, description: str, value: float | None, goal: str, met: bool | None, why: str = ""
) -> dict[str, Any]:
    return {
        "id": tid,
        "description": description,
        "value": value,
        "goal": goal,
        "met": met,
        "note": why,
    }


def _why_missing(*entries: Any) -> str:
    for e in entries:
        reason = _get(e, "unavailable")
        if reason:
            return str(reason)
    return "not measured in this run"


def compute_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the targets of issues 3, 4 and the codec against the measured figures."""
    out: list[dict[str, Any]] = []
    rt = _get(results, "roundtrip", "systems") or {}
    if rt:
        ours, floor, grpc = rt.get("tensorrpc"), rt.get(FLOOR), rt.get("grpc.aio")
        small = _num(_get(ours, "small", "median_us"))
        pipe = _num(_get(ours, "pipelined", "calls_per_s"))
        f_small = _num(_get(floor, "small", "median_us"))
        f_pipe = _num(_get(floor, "pipelined", "calls_per_s"))
        g_small = _num(_get(grpc, "small", "median_us"))
        g_pipe = _num(_get(grpc, "pipelined", "calls_per_s"))

        def add(tid: str, desc: str, value: float | None, goal: str, ok: bool, *src: Any) -> None:
            met = ok if value is not None else None
            out.append(_target(tid, desc, value, goal, met, "" if value else _why_missing(*src)))

        r = _ratio(small, f_small)
        add(
            "rt_small",
            "small call median, tensorrpc ÷ raw pyzmq",
            r,
            "≤ 1.5",
            r is not None and r <= 1.5,
            ours,
            floor,
        )
        r = _ratio(pipe, f_pipe)
        add(
            "rt_pipelined",
            "64 in flight calls/s, tensorrpc ÷ raw pyzmq",
            r,
            "≥ 0.5",
            r is not None and r >= 0.5,
            ours,
            floor,
        )
        r = _ratio(small, g_small)
        add(
            "rt_small_grpc",
            "small call median, tensorrpc ÷ grpc.aio",
            r,
            "< 1",
            r is not None and r < 1,
            ours,
            grpc,
        )
        r = _ratio(pipe, g_pipe)
        add(
            "rt_pipelined_grpc",
            "64 in flight calls/s, tensorrpc ÷ grpc.aio",
            r,
            "> 1",
            r is not None and r > 1,
            ours,
            grpc,
        )

    tx = _get(results, "transfer", "systems") or {}
    if tx:
        big = str(64 << 20)
        frames = tx.get("tensorrpc frames")
        fresh = tx.get(NEW)
        same = tx.get(SAME)
        shared = tx.get(SHARED)
        pyzmq = tx.get("pyzmq")
        fr = _num(_get(frames, "sizes", big, "median_us"))
        r = _ratio(fr, _num(_get(pyzmq, "sizes", big, "median_us")))
        out.append(_target(
            "tx_frames_64m", "64 MiB, tensorrpc frames ÷ raw pyzmq", r, "≤ 1.3",
            None if r is None else r <= 1.3,
            "" if r is not None else _why_missing(_get(frames, "sizes", big), frames, pyzmq),
        ))  # fmt: skip
        for size in results["transfer"].get("sizes", []):
            cell = _get(shared, "sizes", str(size))
            r = _ratio(_num(_get(cell, "median_us")), _num(_get(cell, "small_paired", "median_us")))
            out.append(_target(
                f"tx_shm_shared_{size}",
                f"{fmt_size(size)}, torch_shm (tensorrpc.share) ÷ a small call timed "
                "between", r, "≤ 3",
                None if r is None else r <= 3,
                "" if r is not None else _why_missing(cell, shared),
            ))  # fmt: skip
        fresh_big = _num(_get(fresh, "sizes", big, "median_us"))
        r = _ratio(fresh_big, fr)
        out.append(_target(
            "tx_shm_fresh_64m", "64 MiB, torch_shm (new tensor each call) ÷ frames", r,
            "≤ 0.5 (well under)", None if r is None else r <= 0.5,
            "" if r is not None else _why_missing(_get(fresh, "sizes", big), fresh, frames),
        ))  # fmt: skip
        r = _ratio(fresh_big, _num(_get(fresh, "copy_", big, "median_us")))
        out.append(_target(
            "tx_shm_new_64m_copy", "64 MiB, torch_shm (new tensor each call) ÷ one copy_ of "
            "the same sources", r, "≤ 1.2", None if r is None else r <= 1.2,
            "" if r is not None else _why_missing(_get(fresh, "sizes", big), fresh),
        ))  # fmt: skip
        r = _ratio(_num(_get(same, "sizes", big, "median_us")),
                   _num(_get(same, "copy_", big, "median_us")))  # fmt: skip
        out.append(_target(
            "tx_shm_same_64m_copy", "64 MiB, torch_shm (same tensor each call) ÷ one copy_ "
            "of it", r, "≤ 1.5", None if r is None else r <= 1.5,
            "" if r is not None else _why_missing(_get(same, "sizes", big), same),
        ))  # fmt: skip
        mib = str(1 << 20)
        r = _ratio(_num(_get(fresh, "sizes", mib, "median_us")),
                   _num(_get(frames, "sizes", mib, "median_us")))  # fmt: skip
        out.append(_target(
            "tx_shm_fresh_1m", "1 MiB, torch_shm (new tensor each call) ÷ frames", r, "≤ 1",
            None if r is None else r <= 1,
            "" if r is not None else _why_missing(_get(fresh, "sizes", mib), fresh, frames),
        ))  # fmt: skip
        for tid, name, what in (
            ("tx_shm_shared_64m_ms", SHARED, "tensorrpc.share"),
            ("tx_shm_torch_64m_ms", TORCH, "share_memory_"),
            ("tx_shm_loader_64m_ms", LOADER, "DataLoader batch"),
            ("tx_shm_slots_64m_ms", SLOTS, "DataLoader batch, SharedBatches"),
        ):
            line = tx.get(name)
            med = _num(_get(line, "sizes", big, "median_us"))
            paired = _num(_get(line, "sizes", big, "small_paired", "median_us"))
            extra = None if med is None or paired is None else (med - paired) / 1000
            out.append(_target(
                tid, f"64 MiB, torch_shm ({what}) minus a small call timed between (ms)",
                extra, "≤ 0.1",
                None if extra is None else extra <= 0.1,
                "" if extra is not None else _why_missing(_get(line, "sizes", big), line),
            ))  # fmt: skip
        ray = tx.get("Ray actor (numpy)")
        r = _ratio(fresh_big, _num(_get(ray, "sizes", big, "median_us")))
        out.append(_target(
            "tx_shm_fresh_64m_ray", "64 MiB, torch_shm (new tensor each call) ÷ Ray actor "
            "(numpy)", r, "< 1 (below Ray by value)", None if r is None else r < 1,
            "" if r is not None else _why_missing(_get(fresh, "sizes", big), fresh, ray),
        ))  # fmt: skip
        out += _transfer_out_targets(tx)

    bt = results.get("batching")
    if isinstance(bt, dict) and "unavailable" not in bt:
        out += _batching_targets(bt)

    codec = results.get("codec")
    if isinstance(codec, dict) and isinstance(codec.get("cases"), dict):
        goal = codec.get("target_ratio", 1.5)
        for case, row in codec["cases"].items():
            # The target is codec + validation (issue 23), as msgspec's typed decode
            # validates; the codec alone is the "tensorrpc" row of the table.
            r = _num(_get(row, "tensorrpc+schema", "ratio_to_msgspec"))
            out.append(_target(
                f"codec_{case}",
                f"codec {case}: tensorrpc+schema (codec + validation) ÷ msgspec", r,
                f"≤ {goal}", None if r is None else r <= goal,
                "" if r is not None else "not measured",
            ))  # fmt: skip
    return out


def _batching_targets(bt: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of issue 22 (batching), from the ``batching`` section."""
    out: list[dict[str, Any]] = []
    ours, plain = bt.get("tensorrpc"), bt.get("unbatched")
    floor = bt.get("asyncio batcher")
    one, cont = bt.get("streams one at a time"), bt.get("streams continuous")

    def target(tid: str, desc: str, value: float | None, goal: str, ok: bool | None) -> None:
        out.append(_target(tid, desc, value, goal, ok, "" if value is not None else "not measured"))

    r = _ratio(_num(_get(ours, "per_s")), _num(_get(plain, "per_s")))
    target("batch_speedup", f"{bt.get('callers')} callers, batched ÷ unbatched calls/s", r,
           "≥ 10", None if r is None else r >= 10)  # fmt: skip
    for tid, case, delay_key in (("batch_median_ms", "tensorrpc", "max_delay_ms"),
                                 ("batch_median_mid_ms", MID_CASE, "mid_delay_ms"),
                                 ("batch_median_wide_ms", WIDE_CASE, "wide_delay_ms")):  # fmt: skip
        median = _num(_get(bt.get(case), "median_ms"))
        delay = _num(bt.get(delay_key, 0)) or 0.0
        bound = delay + (_num(bt.get("step_ms", 0)) or 0.0) + 1.0
        extra = None if median is None else median - bound
        desc = f"batched median, max_delay {delay:g} ms, minus (max_delay + one step + 1 ms)"
        target(tid, desc, extra, "≤ 0", None if extra is None else extra <= 0)
    peers = (("serve", "Ray Serve's @serve.batch", bt.get(SERVE_CASE)),
             ("serve_fast", "Ray Serve's @serve.batch, throughput-optimized",
              bt.get(SERVE_FAST_CASE)),
             ("peer", "asyncio batcher (Ray Serve's design)", floor))  # fmt: skip
    for tid, label, peer in peers:
        for key, goal_text in (("per_s", "> 1"), ("median_ms", "< 1"), ("p99_ms", "< 1")):
            r = _ratio(_num(_get(ours, key)), _num(_get(peer, key)))
            better = None if r is None else (r > 1 if key == "per_s" else r < 1)
            name = key.removesuffix("_ms")
            target(f"batch_{tid}_{name}", f"batched {name} ÷ {label}", r, goal_text, better)
    r = _ratio(_num(_get(cont, "per_s")), _num(_get(one, "per_s")))
    target("batch_tokens", f"{bt.get('streams')} streams, continuous ÷ one at a time tokens/s",
           r, "≥ 5", None if r is None else r >= 5)  # fmt: skip
    parts, step = bt.get("late_parts_ms"), _num(bt.get("running_step_ms"))
    stream_delay = _delay(bt.get("stream_delay_ms"))
    # What the rules promise: a stream that arrives while a step runs starts at the next
    # boundary (after the rest of that step, and max_delay): 1 ms for the runner's own work
    # there; a missed boundary or wake-up costs a whole step.
    extra = _num(bt.get("late_join_extra_ms"))
    desc = (
        "slowest stream joining a running batch: its first step's start minus (arrival + "
        "rest of the running step + max_delay), engine clock"
    )
    target("batch_late_join_ms", desc, extra, "≤ 1 ms", None if extra is None else extra <= 1.0)
    # The wording: the first token within one step plus max_delay of arrival. The
    # first output comes at the end of the joiner's own first step, after the rest of the
    # running one: up to two steps; one only if the running step were pre-empted.
    first = _num(_get(parts, "first_output", "max"))
    extra = (
        None
        if first is None or step is None or stream_delay is None
        else first - step - stream_delay
    )
    desc = (
        "slowest stream joining a running batch: arrival to first output minus (one running "
        "step + max_delay), engine clock (the issue's wording; the rules give rest of the "
        "running step + max_delay + its own step)"
    )
    target("batch_late_ttft_ms", desc, extra, "≤ 0", None if extra is None else extra <= 0)
    return out


def _steps(figures: object) -> str:
    if not isinstance(figures, dict):
        return "?"
    parts = [_num(figures.get(k)) for k in ("min", "median", "max")]
    return " / ".join("?" if v is None else f"{v:.2f}" for v in parts)


def _batching_md(bt: dict[str, Any]) -> list[str]:
    lines = [
        "## Batching",
        "",
    ]
    if "unavailable" in bt:
        return [*lines, f"unavailable: {_cell(bt['unavailable'])}"]
    lines += [
        f"One engine process; a handler whose cost is flat in the batch size (one "
        f"{bt.get('step_ms')} ms step on one device per call or per batch); "
        f"{bt.get('callers')} concurrent callers; `max_delay` {bt.get('max_delay_ms')} ms "
        f"(and {bt.get('mid_delay_ms')} and {bt.get('wide_delay_ms')} ms in the lines that "
        "say so). "
        f"Peer: {bt.get('peer')}.",
        "",
        "| case | calls/s | median | p99 | mean batch |",
        "|---|---:|---:|---:|---:|",
    ]
    cases = ("unbatched", "tensorrpc", MID_CASE, WIDE_CASE, SERVE_CASE, SERVE_FAST_CASE,
             "asyncio batcher")  # fmt: skip
    for name in cases:
        e = bt.get(name) or {}
        if "unavailable" in e:
            lines.append(f"| {name} | unavailable: {_cell(e['unavailable'])} | | | |")
            continue
        mean = _num(e.get("mean_batch"))
        lines.append(
            f"| {name} | {fmt_rate(_num(e.get('per_s')))} | {_ms(e.get('median_ms'))} "
            f"| {_ms(e.get('p99_ms'))} | {'' if mean is None else f'{mean:.1f}'} |"
        )
    inside = []
    for name in ("tensorrpc", MID_CASE, WIDE_CASE):
        e = bt.get(name)
        wait, run = _get(e, "engine_queue_wait_ms"), _get(e, "engine_run_ms")
        due, busy = _get(e, "due_start_ms"), _num(_get(e, "device_busy"))
        inside.append(
            f"{name}: waited {_ms(wait)} in the queue, its batch's handler ran {_ms(run)}; a "
            f"batch due when the last one ended started {_ms(_get(due, 'median'))} after it "
            f"(median; p90 {_ms(_get(due, 'p90'))}, {_get(due, 'n')} batches), the device "
            f"busy {'n/a' if busy is None else f'{busy:.0%}'} of the time"
        )
    lines += [
        "",
        "Inside the engine a batched call, on average (" + "; ".join(inside) + "); the rest "
        "of its latency is outside the batcher (receiving, replying, the client).",
    ]
    client_cpu = _num(_get(bt.get("tensorrpc"), "client_cpu_us"))
    callers = _num(bt.get("callers"))
    if client_cpu is not None and callers is not None:
        lines += [
            "",
            f"The callers' turnaround, {callers:.0f} {TIMES} the client's CPU per batched call: "
            f"{_ms(callers * client_cpu / 1e3)}. Where it exceeds `max_delay`, a batch closes "
            "with the callers that came back in time and the others wait for its whole run "
            "(mean batch below 64).",
        ]
        small = bt.get(SMALL_CASE) or {}
        small_client = _num(small.get("client_cpu_us"))
        small_engine, engine_cpu = (
            _num(small.get("engine_cpu_us")),
            _num(_get(bt.get("tensorrpc"), "engine_cpu_us")),
        )
        if None not in (small_client, small_engine, engine_cpu):
            lines[-1] += (
                f" Per call, a batched call costs the client {client_cpu:.0f} µs and the "
                f"engine {engine_cpu:.0f} µs of CPU; a small call with no step, by the same "
                f"callers, {small_client:.0f} and {small_engine:.0f} µs."
            )
    cpu = []
    for name in (*cases, SMALL_CASE):
        e = bt.get(name) or {}
        client, engine = _num(e.get("client_cpu_us")), _num(e.get("engine_cpu_us"))
        if client is None:
            continue
        if engine is None:  # Ray Serve: the driver's CPU only
            cpu.append(f"{name} {client:.0f} µs (the driver's; Ray's own processes not counted)")
            continue
        gcs = e.get("engine_full_gc")
        longest = _num(e.get("engine_full_gc_longest_ms"))
        if not gcs:
            collections = " (no full collection)"
        else:
            collections = f" ({gcs} full collections, longest {_ms(longest)})"
        cpu.append(f"{name} {client:.0f} / {engine:.0f} µs{collections}")
    if cpu:
        lines += [
            "",
            "CPU per call, client / engine, and the engine's full garbage collections "
            "during the case: " + "; ".join(cpu) + ".",
        ]
    lines += [
        "",
        f"{bt.get('streams')} streams of {bt.get('tokens')} tokens, one "
        f"{bt.get('token_step_ms')} ms step per token (for every active stream at once when "
        "batched).",
        "",
        *_late_md(bt),
        "",
        "| case | tokens/s | time to first token, median | p99 |",
        "|---|---:|---:|---:|",
    ]
    for name in ("streams one at a time", "streams continuous"):
        e = bt.get(name) or {}
        lines.append(
            f"| {name} | {fmt_rate(_num(e.get('per_s')))} | {_ms(e.get('ttft_median_ms'))} "
            f"| {_ms(e.get('ttft_p99_ms'))} |"
        )
    return lines


def _delay(value: object) -> float | None:
    """A ``max_delay`` in ms (0 is one)."""
    return float(value) if isinstance(value, int | float) and value >= 0 else None


def _late_md(bt: dict[str, Any]) -> list[str]:
    """The streams that join a running batch: where their first token's time goes."""
    parts = bt.get("late_parts_ms")
    if not isinstance(parts, dict):
        return ["Streams joining a running batch: not measured."]

    def part(key: str) -> str:
        return f"{_ms(_get(parts, key, 'median'))} / {_ms(_get(parts, key, 'max'))}"

    n = _get(bt.get("late_ttft_steps"), "n")
    return [
        f"{n} streams joining a running batch of {bt.get('late_batch')} streams "
        "(median / slowest): from the client's call to the batcher "
        f"{part('in')}; the rest of the step running at arrival {part('residual')}; from its "
        f"end to the start of the joiner's first step {part('boundary')} (`max_delay` "
        f"{_delay(bt.get('stream_delay_ms'))} ms); that step {part('own')}; its first output to "
        f"the client {part('out')}. Arrival to first output, on the engine: "
        f"{part('first_output')}; call to first token, at the client: {part('ttft')} = "
        f"{_steps(bt.get('late_ttft_steps'))} running steps (min / median / max), the running "
        f"batch's step taking {_ms(bt.get('running_step_ms'))} here (start to next start).",
    ]


def _ms(value: Any) -> str:
    v = _num(value)
    return "n/a" if v is None else f"{v:.2f} ms"


def _transfer_out_targets(tx: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets for the other direction: a small request, a tensor back."""
    big, mib = str(64 << 20), str(1 << 20)

    def med(system: str, size: str) -> float | None:
        return _num(_get(tx.get(system), "sizes_out", size, "median_us"))

    def target(tid: str, desc: str, value: float | None, goal: str, ok: bool, *src: str) -> None:
        why = "" if value is not None else _why_missing(*(tx.get(s) for s in src))
        out.append(_target(tid, desc, value, goal, ok if value is not None else None, why))

    out: list[dict[str, Any]] = []
    fresh, shared = SAME, SHARED
    copy, frames, ray = "Tensor.copy_ (in-process)", "tensorrpc frames", "Ray actor (numpy)"
    r = _ratio(med(fresh, big), med(copy, big))
    target("tx_out_shm_fresh_64m_copy", "tensor out, 64 MiB, torch_shm (a tensor the "
           "engine holds) ÷ in-process copy_", r, "≤ 1.5", r is not None and r <= 1.5,
           fresh, copy)  # fmt: skip
    r = _ratio(med(fresh, mib), med(frames, mib))
    target("tx_out_shm_fresh_1m", "tensor out, 1 MiB, torch_shm ÷ frames", r, "≤ 1",
           r is not None and r <= 1, fresh, frames)  # fmt: skip
    shared_big = med(shared, big)
    paired = _num(_get(tx.get(shared), "sizes_out", big, "small_paired", "median_us"))
    extra = None if shared_big is None or paired is None else (shared_big - paired) / 1000
    target("tx_out_shm_shared_64m_ms", "tensor out, 64 MiB, torch_shm (tensorrpc.share) minus "
           "a small call timed between", extra, "≤ 0.1", extra is not None and extra <= 0.1,
           shared)  # fmt: skip
    r = _ratio(med(fresh, big), med(ray, big))
    target("tx_out_shm_fresh_64m_ray", "tensor out, 64 MiB, torch_shm ÷ Ray actor "
           "(numpy)", r, "< 1 (below Ray)", r is not None and r < 1, fresh, ray)  # fmt: skip
    return out


def _machine_line(m: dict[str, Any]) -> str:
    parts = [
        str(m.get("cpu_model", "?")),
        f"{m.get('cpus_usable', '?')} usable CPUs",
        f"Python {m.get('python', '?')}",
        f"torch {m.get('torch', '?')}",
        f"pyzmq {m.get('pyzmq', '?')} (libzmq {m.get('libzmq', '?')})",
        f"grpcio {m.get('grpcio', '?')}",
    ]
    return ", ".join(parts)


def _roundtrip_md(rt: dict[str, Any]) -> list[str]:
    systems: dict[str, Any] = rt.get("systems", {})
    notes: dict[str, str] = rt.get("notes", {})
    ref = systems.get("tensorrpc")
    ref_small = _num(_get(ref, "small", "median_us"))
    ref_pipe = _num(_get(ref, "pipelined", "calls_per_s"))
    lines = [
        "## Round trip: small call (two ints → int)",
        "",
        "Sequential calls (median, p99) and 64 calls in flight (calls/s). Ratios are the "
        "system's figure ÷ tensorrpc's: above 1 means a slower call or a higher "
        "throughput than tensorrpc.",
        "",
        "| system | median | p99 | median ÷ tensorrpc | 64 in flight | calls/s ÷ tensorrpc "
        "| setup |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, entry in systems.items():
        note = notes.get(name, "")
        if "unavailable" in entry:
            lines.append(f"| {name} | unavailable: {_cell(entry['unavailable'])} "
                         f"| | | | | {note} |")  # fmt: skip
            continue
        small = _num(_get(entry, "small", "median_us"))
        p99 = _num(_get(entry, "small", "p99_us"))
        pipe = _num(_get(entry, "pipelined", "calls_per_s"))
        lines.append(
            f"| {name} | {fmt_us(small)} | {fmt_us(p99)} | {fmt_ratio(_ratio(small, ref_small))} "
            f"| {fmt_rate(pipe)} | {fmt_ratio(_ratio(pipe, ref_pipe))} | {note} |"
        )
    return lines


def _cell(text: Any) -> str:
    s = str(text).replace("|", "/").replace("\n", " ")
    return s if len(s) <= 160 else s[:157] + "..."


def _transfer_md(tx: dict[str, Any]) -> list[str]:
    systems: dict[str, Any] = tx.get("systems", {})
    sizes: list[int] = tx.get("sizes", [])
    notes: dict[str, str] = tx.get("notes", {})
    ref = systems.get(TRANSFER_REF)
    lines = [
        "## Transfer: a float32 tensor to the server, a small result back",
        "",
        f"Median latency per call; in brackets the system's median ÷ `{TRANSFER_REF}`'s at "
        "the same size (above 1: slower than tensorrpc frames). The small call is two ints "
        "→ int, measured in the same session.",
        "",
        "| system | small call | " + " | ".join(fmt_size(s) for s in sizes) + " | setup |",
        "|---|---:|" + "---:|" * len(sizes) + "---|",
    ]
    ref_small = _num(_get(ref, "small", "median_us"))
    for name, entry in systems.items():
        note = notes.get(name, "")
        if "unavailable" in entry:
            blank = " | " * len(sizes)
            lines.append(f"| {name} | unavailable: {_cell(entry['unavailable'])}{blank}| {note} |")
            continue
        small = _num(_get(entry, "small", "median_us"))
        cells = [fmt_us(small) + _bracket(_ratio(small, ref_small)) if small else "-"]
        for size in sizes:
            cell = _get(entry, "sizes", str(size))
            if cell is None:
                cells.append("-")
            elif "unavailable" in cell:
                cells.append(f"unavailable: {_cell(cell['unavailable'])}")
            else:
                med = _num(cell.get("median_us"))
                ref_med = _num(_get(ref, "sizes", str(size), "median_us"))
                cells.append(fmt_us(med) + _bracket(_ratio(med, ref_med)))
        counters = entry.get("counters")
        if isinstance(counters, dict) and counters:
            split = ", ".join(
                f"{counters[k]} {label}"
                for k, label in (("frames_tensors", "by frames"), ("shm_tensors", "by torch_shm"))
                if k in counters
            )
            note = f"{note}; tensors sent: {split}" if split else note
        if entry.get("warning"):
            note = f"{note} (**{entry['warning']}**)"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {note} |")
    return lines


def _transfer_copy_md(tx: dict[str, Any]) -> list[str]:
    """Each line that measured one ``copy_`` of its own sources, divided by it."""
    systems = {
        name: entry
        for name, entry in tx.get("systems", {}).items()
        if isinstance(entry, dict) and isinstance(entry.get("copy_"), dict)
    }
    if not systems:
        return []
    sizes: list[int] = tx.get("sizes", [])
    lines = [
        "## Transfer ÷ one copy_ of the same source",
        "",
        "Each tensorrpc line also timed, in the same run and process, one `Tensor.copy_` "
        "of the very tensors it sends into a preallocated tensor (one thread). Cells: the "
        "line's median ÷ that copy's median (the copy's median in brackets).",
        "",
        "| system | " + " | ".join(fmt_size(s) for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for name, entry in systems.items():
        cells = []
        for size in sizes:
            med = _num(_get(entry, "sizes", str(size), "median_us"))
            ref = _num(_get(entry, "copy_", str(size), "median_us"))
            r = _ratio(med, ref)
            cells.append("-" if r is None else f"{r:.2f}{TIMES} ({fmt_us(ref)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _transfer_out_md(tx: dict[str, Any]) -> list[str]:
    """The other direction: a small request, a tensor back (systems that measured it)."""
    systems = {
        name: entry
        for name, entry in tx.get("systems", {}).items()
        if isinstance(entry, dict) and ("sizes_out" in entry or "unavailable" in entry)
    }
    if not any("sizes_out" in entry for entry in systems.values()):
        return []
    sizes: list[int] = tx.get("sizes", [])
    ref = systems.get(TRANSFER_REF)
    lines = [
        "## Transfer, the other way: a small request, a tensor back",
        "",
        "The server answers a float32 tensor it already holds (made once per size; for "
        "`torch_shm (tensorrpc.share)` made by the engine in tensorrpc shared memory, "
        "`tensorrpc.share`), so a call times the "
        f"transfer only. Median latency per call; in brackets ÷ `{TRANSFER_REF}`'s. The "
        "other peers are measured in the first direction only.",
        "",
        "| system | " + " | ".join(fmt_size(s) for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for name, entry in systems.items():
        if "unavailable" in entry:
            blank = " | " * (len(sizes) - 1)
            lines.append(f"| {name} | unavailable: {_cell(entry['unavailable'])}{blank} |")
            continue
        cells = []
        for size in sizes:
            cell = _get(entry, "sizes_out", str(size))
            if cell is None:
                cells.append("-")
            elif "unavailable" in cell:
                cells.append(f"unavailable: {_cell(cell['unavailable'])}")
            else:
                med = _num(cell.get("median_us"))
                ref_med = _num(_get(ref, "sizes_out", str(size), "median_us"))
                cells.append(fmt_us(med) + _bracket(_ratio(med, ref_med)))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _bracket(r: float | None) -> str:
    return "" if r is None else f" ({r:.2f}{TIMES})"


def _codec_md(codec: dict[str, Any]) -> list[str]:
    lines = ["## Codec: encode + decode of an EngineCoreRequest-shaped message", ""]
    if "unavailable" in codec:
        return [*lines, f"unavailable: {_cell(codec['unavailable'])}"]
    cases = codec.get("cases")
    if not isinstance(cases, dict):
        return [*lines, "```", json.dumps(codec, indent=1)[:4000], "```"]
    lines += [
        "Medians in µs; ratio is the system's encode+decode ÷ msgspec's.",
        "",
        "| case | system | encode | decode | total | ÷ msgspec |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for case, row in cases.items():
        for system, f in row.items():
            lines.append(
                f"| {case} | {system} | {f.get('encode', 0):.2f} | {f.get('decode', 0):.2f} "
                f"| {f.get('total', 0):.2f} | {fmt_ratio(_num(f.get('ratio_to_msgspec')))} |"
            )
    return lines


def _targets_md(targets: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Targets",
        "",
        "| target | measured | goal | met |",
        "|---|---:|---|---|",
    ]
    for t in targets:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        if t["value"] is None:
            value = f"n/a ({_cell(t['note'])})"
        elif t["id"].endswith("_ms"):  # a difference in milliseconds, not a ratio
            value = f"{t['value']:+.3f} ms"
        else:
            value = fmt_ratio(t["value"])
        lines.append(f"| {t['description']} | {value} | {t['goal']} | {met} |")
    return lines


def _scale_md(scale: dict[str, Any]) -> list[str]:
    inflight = scale.get("busy_inflight", "?")
    lines = [
        "## Scale: one client, many engines",
        "",
        "Engines dial in over `ipc://` from up to 8 processes. Latency and client CPU are "
        f"per call; *busy* keeps {inflight} calls in flight; `select()` is the balancing "
        "decision alone with every engine busy.",
        "",
        "| engines | join (all at once) | client RSS / engine | call median | call p99 "
        "| client CPU / call | busy calls/s | busy CPU / call | broadcast median "
        "| select() |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, e in scale.get("engines", {}).items():
        if "unavailable" in e:
            lines.append(f"| {n} | {_cell(e['unavailable'])} |||||||||")
            continue
        lines.append(
            f"| {n} | {e['join_ms']:.0f} ms | {e['rss_per_engine_kib']:.0f} KiB "
            f"| {fmt_us(e['call']['median_us'])} | {fmt_us(e['call']['p99_us'])} "
            f"| {fmt_us(e['call']['client_cpu_us'])} | {fmt_rate(e['busy']['calls_per_s'])} "
            f"| {fmt_us(e['busy']['client_cpu_us'])} | {fmt_us(e['broadcast']['median_us'])} "
            f"| {e['select_us']:.2f} µs |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The markdown report of one run."""
    m = results.get("machine", {})
    lines = [
        "# tensorrpc benchmark",
        "",
        f"Run {m.get('started', '?')} in {results.get('duration_s', 0):.0f} s"
        f"{' (quick)' if results.get('quick') else ''}; {_machine_line(m)}; load average "
        f"{m.get('loadavg_start', '?')} at the start. Every server runs in its own process "
        "on this machine.",
        "",
    ]
    if "roundtrip" in results:
        lines += [*_roundtrip_md(results["roundtrip"]), ""]
    if "transfer" in results:
        lines += [*_transfer_md(results["transfer"]), ""]
        copies = _transfer_copy_md(results["transfer"])
        if copies:
            lines += [*copies, ""]
        out = _transfer_out_md(results["transfer"])
        if out:
            lines += [*out, ""]
    if "codec" in results:
        lines += [*_codec_md(results["codec"]), ""]
    if "scale" in results:
        lines += [*_scale_md(results["scale"]), ""]
    if "batching" in results:
        lines += [*_batching_md(results["batching"]), ""]

    if "mixed" in results:
        from bench.mixed import report

        lines += [*report(results["mixed"]), ""]
    if "compression" in results:
        from bench.compression import report as compression_report

        lines += [*compression_report(results["compression"]), ""]
    targets = results.get("targets", [])
    if targets:
        lines += [*_targets_md(targets), ""]
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> str | None:
    """Plot latency against payload size (log-log), one line per system.

    Returns None when written, else why not (no transfer figures, no matplotlib).
    """
    tx = results.get("transfer")
    if not isinstance(tx, dict):
        return "no transfer figures in this run"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib unavailable: {exc}"
    sizes: list[int] = tx.get("sizes", [])
    systems = tx.get("systems", {})
    directions = [("sizes", "tensor to the server, small result back")]
    if any(isinstance(e, dict) and "sizes_out" in e for e in systems.values()):
        directions.append(("sizes_out", "small request, tensor back"))
    series: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for key, _ in directions:
        for name, entry in systems.items():
            xs: list[float] = []
            ys: list[float] = []
            for size in sizes:
                med = _num(_get(entry, key, str(size), "median_us"))
                if med is not None:
                    xs.append(size)
                    ys.append(med / 1e3)
            if xs:
                series[key, name] = (xs, ys)
    if not series:
        return "no transfer figures to plot"
    # A few lines per panel, legends in large type under each: one chart with a dozen
    # entries is unreadable once scaled into a page. Left: tensorrpc's transports; right:
    # the other systems, with tensorrpc's default beside them; one row per direction. The
    # in-process copy (the physical floor) is drawn in grey on every panel.
    names = list(systems)
    floor = [n for n in names if "in-process" in n]
    ours = [n for n in names if n.startswith("tensorrpc")]
    others = [n for n in names if n not in ours and n not in floor]
    reference = [n for n in ours if "auto" in n][:1]
    groups = [("tensorrpc transports", ours + floor), ("other systems", reference + others + floor)]
    colors = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    rows = len(directions)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 7 * rows), sharey=True, squeeze=False)
    for row, (key, direction) in enumerate(directions):
        for ax, (group, members) in zip(axes[row], groups, strict=True):
            for index, name in enumerate(members):
                if (key, name) not in series:
                    continue
                xs, ys = series[key, name]
                grey = name in floor
                ax.plot(
                    xs,
                    ys,
                    (":" if "copy_" in name else "--") if grey else "-",
                    marker="o",
                    linewidth=2.6 if name.startswith("tensorrpc") else 1.6,
                    color="0.45" if grey else colors[index % 10],
                    label=name,
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
            ax.set_xlabel("tensor size", fontsize=11)
            ax.set_title(f"{group}: {direction}", fontsize=12)
            ax.grid(True, which="both", linewidth=0.3)
            ax.tick_params(labelsize=10)
            if ax.lines:  # under the plot, outside the lines
                ax.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
        axes[row][0].set_ylabel("median latency per call (ms)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and ``latency_vs_size.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results["targets"] = compute_targets(results)
    paths = {
        "json": out_dir / "bench.json",
        "markdown": out_dir / "bench.md",
        "chart": out_dir / "latency_vs_size.png",
    }
    why = chart(results, paths["chart"])
    results["chart"] = {"path": paths["chart"].name} if why is None else {"unavailable": why}
    if why is not None:
        # a chart left by an earlier run would not match this run's figures
        paths.pop("chart").unlink(missing_ok=True)
    paths["markdown"].write_text(markdown(results) + "\n", encoding="utf-8")
    paths["json"].write_text(
        json.dumps(results, indent=1, allow_nan=False, default=repr) + "\n", encoding="utf-8"
    )
    return paths
