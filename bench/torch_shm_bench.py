"""torch_shm transfer cost: place (sender) + resolve (receiver) in two processes.

Run: ``.venv/bin/python -m bench.torch_shm_bench``. The sender (this process) places a
tensor, a receiver started as a separate process resolves the handle; each side times its
own step, the pipe between them is not counted (medians, ms). Three kinds of tensor:
``fresh`` (copied into the pool once; the receiver builds its tensor on the region, as the
runtime does), ``copy-out`` (the same, but the receiver copies it out, as before one-copy
receive) and ``shared`` (``tensorrpc.share``: by alias). ``read`` is the receiver's first
full read of the tensor (``sum``: page faults on a fresh mapping show here). Printed beside
one in-process ``Tensor.copy_`` of the same bytes into a reused buffer, into a fresh one,
and one ``memmove`` into a reused buffer.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch

import tensorrpc
from tensorrpc.transports.torch_shm import TorchShmTransport

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def receiver() -> None:
    """Resolve handles read from stdin; answer resolve and read times and leases to release."""
    with TorchShmTransport() as shm:
        for line in sys.stdin:
            pid, handle, n, mode = line.split()
            hold = None if mode == "copy-out" else "sender"
            resolver = shm.resolver(int(pid), hold=hold)
            t0 = time.perf_counter()
            out = resolver.resolve("torch_shm", bytes.fromhex(handle), torch.uint8, (int(n),))
            t1 = time.perf_counter()
            out.sum()
            t2 = time.perf_counter()
            del out  # the user drops the tensor: its lease can go back
            leases = resolver.close()
            sys.stdout.write(f"{t1 - t0} {t2 - t1} {','.join(map(str, leases)) or '-'}\n")
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
            for mode in ("fresh", "copy-out", "shared"):
                for label, n in SIZES.items():
                    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
                    if mode == "shared":
                        src = tensorrpc.share(src)
                    place_t, resolve_t, read_t = [], [], []
                    reps = 30 if n >= 64 << 20 else 300
                    for i in range(reps + 3):
                        placer = shm.placer("bench")
                        t0 = time.perf_counter()
                        placed = placer.place(src)
                        t1 = time.perf_counter()
                        assert placed is not None
                        child.stdin.write(f"{os.getpid()} {placed[1].hex()} {n} {mode}\n")
                        child.stdin.flush()
                        took, read, leases = child.stdout.readline().split()
                        for lease in leases.split(",") if leases != "-" else ():
                            shm.release(int(lease))
                        if placer.lease is not None:
                            shm.release(placer.lease)
                        if i >= 3:  # the first rounds create and fault in the segments
                            place_t.append(t1 - t0)
                            resolve_t.append(float(took))
                            read_t.append(float(read))
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
                            f"{mode} {label}",
                            _median_ms(place_t),
                            _median_ms(resolve_t),
                            _median_ms(read_t),
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
    head = ("tensor", "place", "resolve", "read", "total", "copy_", "empty+copy_", "memmove")
    print("{:<18}{:>9}{:>9}{:>9}{:>9}{:>9}{:>13}{:>9}".format(*head))
    for row in rows:
        print("{:<18}{:>9.3f}{:>9.3f}{:>9.3f}{:>9.3f}{:>9.3f}{:>13.3f}{:>9.3f}".format(*row))


if __name__ == "__main__":
    if sys.argv[1:] == ["--receiver"]:
        receiver()
    else:
        main()
