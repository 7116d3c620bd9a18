"""torch_shm transfer cost: place (sender) + resolve (receiver) in two processes.

Run: ``.venv/bin/python -m bench.torch_shm_bench``. The sender (this process) places a
tensor, a receiver started as a separate process resolves the handle; each side times its
own step, the pipe between them is not counted (medians, ms). Printed beside one in-process
``Tensor.copy_`` of the same bytes into a reused buffer, into a fresh one, and one
``memmove`` into a reused buffer.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch

from tensorrpc.transports.torch_shm import TorchShmTransport

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def receiver() -> None:
    """Resolve handles read from stdin; answer the resolve time in seconds."""
    with TorchShmTransport() as shm:
        for line in sys.stdin:
            pid, handle, n = line.split()
            resolver = shm.resolver(int(pid))
            t0 = time.perf_counter()
            out = resolver.resolve("torch_shm", bytes.fromhex(handle), torch.uint8, (int(n),))
            took = time.perf_counter() - t0
            del out  # the user drops the tensor: its buffer is recycled
            sys.stdout.write(f"{took}\n")
            sys.stdout.flush()


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    """Run every case and print a table in milliseconds."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.torch_shm_bench", "--receiver"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    rows = []
    try:
        with TorchShmTransport() as shm:
            for shared in (False, True):
                for label, n in SIZES.items():
                    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
                    if shared:
                        src.share_memory_()  # type: ignore[no-untyped-call]
                    place_t, resolve_t = [], []
                    reps = 30 if n >= 64 << 20 else 300
                    for i in range(reps + 3):
                        placer = shm.placer("bench")
                        t0 = time.perf_counter()
                        placed = placer.place(src)
                        t1 = time.perf_counter()
                        assert placed is not None
                        child.stdin.write(f"{os.getpid()} {placed[1].hex()} {n}\n")
                        child.stdin.flush()
                        took = float(child.stdout.readline())
                        assert placer.lease is not None
                        shm.release(placer.lease)
                        if i >= 3:  # the first rounds create and fault in the segments
                            place_t.append(t1 - t0)
                            resolve_t.append(took)
                    dst = torch.empty_like(src)
                    dst.copy_(src)
                    copy_t, fresh_t, move_t = [], [], []
                    for _ in range(min(reps, 30)):
                        t0 = time.perf_counter()
                        dst.copy_(src)
                        t1 = time.perf_counter()
                        torch.empty_like(src).copy_(src)
                        t2 = time.perf_counter()
                        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
                        t3 = time.perf_counter()
                        copy_t.append(t1 - t0)
                        fresh_t.append(t2 - t1)
                        move_t.append(t3 - t2)
                    rows.append(
                        (
                            ("shared " if shared else "fresh ") + label,
                            _median_ms(place_t),
                            _median_ms(resolve_t),
                            _median_ms(place_t) + _median_ms(resolve_t),
                            _median_ms(copy_t),
                            _median_ms(fresh_t),
                            _median_ms(move_t),
                        )
                    )
    finally:
        child.stdin.close()
        child.wait(60)
        child.stdout.close()
    head = ("tensor", "place", "resolve", "total", "copy_", "empty+copy_", "memmove")
    print("{:<16}{:>10}{:>10}{:>10}{:>10}{:>13}{:>10}".format(*head))
    for row in rows:
        print("{:<16}{:>10.3f}{:>10.3f}{:>10.3f}{:>10.3f}{:>13.3f}{:>10.3f}".format(*row))


if __name__ == "__main__":
    if sys.argv[1:] == ["--receiver"]:
        receiver()
    else:
        main()
