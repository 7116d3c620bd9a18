"""Per-message overhead of ``tensorrpc._zmq.AsyncSocket`` against ``zmq.asyncio``.

A DEALER/ROUTER ping-pong of small messages over ``ipc://`` inside one process (both ends
on the same event loop), so the figure is the cost of the async layers, not of a second
process. Run: ``.venv/bin/python -m bench.bench_zmq_layer [--rounds N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from tensorrpc._zmq import create_socket

PAYLOAD = [b"TR\x01\x04" + bytes(16) + b"add", b"\x92\x01\x02"]


async def _raw_pyzmq(endpoint: str, rounds: int) -> list[float]:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    router.bind(endpoint)
    dealer.connect(endpoint)

    async def echo() -> None:
        while True:
            frames = await router.recv_multipart(copy=False)
            await router.send_multipart(frames, copy=False)

    task = asyncio.get_running_loop().create_task(echo())
    samples = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            await dealer.send_multipart(PAYLOAD, copy=False)
            await dealer.recv_multipart(copy=False)
            samples.append(time.perf_counter() - start)
    finally:
        task.cancel()
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
    return samples


async def _tensorrpc(endpoint: str, rounds: int) -> list[float]:
    async with (
        create_socket(zmq.ROUTER) as router,
        create_socket(zmq.DEALER) as dealer,
        anyio.create_task_group() as tg,
    ):
        router.bind(endpoint)
        dealer.connect(endpoint)

        async def echo() -> None:
            while True:
                frames = await router.recv()
                await router.send(frames)

        tg.start_soon(echo)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            await dealer.send(PAYLOAD)
            await dealer.recv()
            samples.append(time.perf_counter() - start)
        tg.cancel_scope.cancel()
    return samples


async def _raw_pyzmq_pipelined(endpoint: str, count: int, window: int) -> float:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    router.bind(endpoint)
    dealer.connect(endpoint)

    async def echo() -> None:
        while True:
            frames = await router.recv_multipart(copy=False)
            await router.send_multipart(frames, copy=False)

    task = asyncio.get_running_loop().create_task(echo())
    try:
        start = time.perf_counter()
        for _ in range(window):
            await dealer.send_multipart(PAYLOAD, copy=False)
        for i in range(count):
            await dealer.recv_multipart(copy=False)
            if i + window < count:
                await dealer.send_multipart(PAYLOAD, copy=False)
        elapsed = time.perf_counter() - start
    finally:
        task.cancel()
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
    return count / elapsed


async def _tensorrpc_pipelined(endpoint: str, count: int, window: int) -> float:
    async with (
        create_socket(zmq.ROUTER) as router,
        create_socket(zmq.DEALER) as dealer,
        anyio.create_task_group() as tg,
    ):
        router.bind(endpoint)
        dealer.connect(endpoint)

        async def echo() -> None:
            while True:
                frames = await router.recv()
                await router.send(frames)

        tg.start_soon(echo)
        start = time.perf_counter()
        for _ in range(window):
            await dealer.send(PAYLOAD)
        for i in range(count):
            await dealer.recv()
            if i + window < count:
                await dealer.send(PAYLOAD)
        elapsed = time.perf_counter() - start
        tg.cancel_scope.cancel()
    return count / elapsed


def _report(name: str, samples: list[float]) -> float:
    body = samples[len(samples) // 10 :]  # drop warm-up
    median = statistics.median(body) * 1e6
    p99 = sorted(body)[int(len(body) * 0.99)] * 1e6
    print(f"{name:<28} median {median:7.1f} us   p99 {p99:7.1f} us   ({len(body)} round trips)")
    return median


def main() -> None:
    """Run the ping-pong on every layer and print medians."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        raw = _report(
            "zmq.asyncio (asyncio)",
            asyncio.run(_raw_pyzmq(f"ipc://{base}/raw", args.rounds)),
        )
        ours = _report(
            "tensorrpc._zmq (asyncio)",
            anyio.run(_tensorrpc, f"ipc://{base}/a", args.rounds, backend="asyncio"),
        )
        trio = _report(
            "tensorrpc._zmq (trio)",
            anyio.run(_tensorrpc, f"ipc://{base}/t", args.rounds, backend="trio"),
        )
        print(f"ratio asyncio {ours / raw:.2f}x, trio {trio / raw:.2f}x of zmq.asyncio")
        count, window = args.rounds * 2, 64
        for name, rate in (
            (
                "zmq.asyncio (asyncio)",
                asyncio.run(_raw_pyzmq_pipelined(f"ipc://{base}/rp", count, window)),
            ),
            (
                "tensorrpc._zmq (asyncio)",
                anyio.run(
                    _tensorrpc_pipelined, f"ipc://{base}/ap", count, window, backend="asyncio"
                ),
            ),
            (
                "tensorrpc._zmq (trio)",
                anyio.run(_tensorrpc_pipelined, f"ipc://{base}/tp", count, window, backend="trio"),
            ),
        ):
            print(f"{name:<28} pipelined ({window} in flight) {rate:9.0f} msg/s round trips")


if __name__ == "__main__":
    main()
