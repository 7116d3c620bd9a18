"""Does freeing a large buffer hold the GIL? (``python -m bench.release_gil``).

tensorrpc drops large buffers on its release thread (`tensorrpc._release`). That keeps
the free off the event loop's own path, but the loop still waits if the free holds the
GIL: then the release thread's munmap is the loop's pause too. This measures, for each
kind of buffer tensorrpc (or its user) drops, how long dropping one takes on a thread
of its own, and whether the GIL stays held meanwhile.

Method, with no timing threshold in it: a spinner thread counts in a Python loop (it
needs the GIL for every step) while another thread drops the buffer. The switch
interval is raised to ``--switch`` seconds (0.5 by default), so the spinner gets the
GIL during the drop only if the free gives it up of its own accord (a C function that
releases it around ``free``/``munmap``). Spinner steps during the drop: none in every
drop, and the GIL was held for the whole free (its duration is the other threads'
pause); many, and it was released. (A free of well under a millisecond may end before
the spinner is scheduled at all, so none there proves nothing.) The free time is
measured in other drops with no spinner: the cost of the free itself.

Kinds: a tensor from torch's CPU allocator (``torch.ones``), a ZMQ frame
received zero-copy over ``ipc://`` (libzmq's ``malloc``), a tensor on such a frame
(what tensorrpc decodes: ``torch.frombuffer``), a ``bytearray``, a ``bytearray``
whose pages are given back with ``madvise(MADV_DONTNEED)`` through ctypes (the GIL is
released for the call) just before the drop, and a numpy array (numpy asks for
transparent huge pages for large arrays). What it leaves out: the loop's own work, and
the CPU the free takes from the other threads on a small host whether or not it holds
the GIL.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MADV_DONTNEED = 4
PAGE = 4096


def _madvise_interior(address: int, size: int) -> None:
    """Give back the whole pages inside ``[address, address + size)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-address // PAGE) * PAGE  # rounded up: the allocator's header page stays
    end = (address + size) // PAGE * PAGE
    if end > start and libc.madvise(start, end - start, MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise failed")


def _makers(size: int, workdir: Path, sockets: list[Any]) -> dict[str, Callable[[], object]]:
    import numpy as np
    import torch
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sender = ctx.socket(zmq.PAIR)
    receiver = ctx.socket(zmq.PAIR)
    sockets += [sender, receiver]
    address = f"ipc://{workdir}/release-gil.sock"
    sender.bind(address)
    receiver.connect(address)
    payload = memoryview(bytearray(b"\1" * size))

    def frame() -> object:
        sender.send(payload, copy=False)
        got: zmq.Frame = receiver.recv(copy=False)
        return got

    def tensor_on_frame() -> object:
        got = frame()
        return torch.frombuffer(got.buffer, dtype=torch.uint8)  # type: ignore[attr-defined]

    def filled_bytearray() -> object:
        return bytearray(b"\1" * size)

    def madvised_bytearray() -> object:
        buf = bytearray(b"\1" * size)
        holder = (ctypes.c_char * size).from_buffer(buf)
        address = ctypes.addressof(holder)
        del holder
        return (buf, address)

    return {
        "torch tensor (torch's allocator)": lambda: torch.ones(size, dtype=torch.uint8),
        "ZMQ frame (received)": frame,
        "torch tensor on a received frame": tensor_on_frame,
        "bytearray": filled_bytearray,
        "bytearray, madvise(DONTNEED) first": madvised_bytearray,
        "numpy array (huge pages)": lambda: np.ones(size, dtype=np.uint8),
    }


def _drop(box: list[object]) -> float:
    """Drop the buffer in ``box``; the seconds its final ``del`` took."""
    obj = box.pop()
    if type(obj) is tuple:  # a bytearray to give back first, and its address
        buf, address = obj
        del obj
        _madvise_interior(address, len(buf))
        obj = buf
        del buf
    start = time.perf_counter()
    del obj
    return time.perf_counter() - start


def _one(make: Callable[[], object], spin: bool) -> tuple[float, float, int]:
    """Drop one buffer on a thread of its own: seconds in all, seconds of its final
    ``del``, and the spinner's steps meanwhile."""
    box: list[object] = [make()]
    steps = [0]
    stop = threading.Event()
    result: list[tuple[float, float, int]] = []

    def spinner() -> None:
        while not stop.is_set():
            steps[0] += 1

    def dropper() -> None:
        time.sleep(0.05)  # the spinner holds the GIL now; take it back, then drop
        before = steps[0]
        start = time.perf_counter()
        last = _drop(box)
        result.append((time.perf_counter() - start, last, steps[0] - before))

    threads = [threading.Thread(target=dropper)]
    if spin:
        threads.append(threading.Thread(target=spinner))
    for t in threads:
        t.start()
    threads[0].join(timeout=60)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    if not result:
        raise RuntimeError("the drop did not finish in 60 s")
    return result[0]


def main() -> None:
    """Print a markdown table: each kind's free time and whether it holds the GIL."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="buffer size (default 64)")
    parser.add_argument("--runs", type=int, default=5, help="drops per kind and mode")
    parser.add_argument("--switch", type=float, default=0.5, help="switch interval, s")
    args = parser.parse_args()
    size = args.mib << 20
    print(f"{args.mib} MiB buffers, {args.runs} drops each on a thread of its own.\n")
    print(
        "| buffer | drop, median (ms) | its final `del` (ms) | spinner steps meanwhile "
        "| drops the spinner ran in |"
    )
    print("|---|---:|---:|---|---|")
    old_interval = sys.getswitchinterval()
    sockets: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="trpc-gil-") as tmp:
        for name, make in _makers(size, Path(tmp), sockets).items():
            sys.setswitchinterval(old_interval)
            alone = [_one(make, spin=False) for _ in range(args.runs)]
            sys.setswitchinterval(args.switch)
            steps = [_one(make, spin=True)[2] for _ in range(args.runs)]
            verdict = f"{sum(1 for s in steps if s)} of {len(steps)}"
            print(
                f"| {name} | {statistics.median(a[0] for a in alone) * 1e3:.2f} "
                f"| {statistics.median(a[1] for a in alone) * 1e3:.2f} "
                f"| {', '.join(str(s) for s in steps)} | {verdict} |"
            )
        for sock in sockets:
            sock.close(linger=0)
    sys.setswitchinterval(old_interval)


if __name__ == "__main__":
    main()
