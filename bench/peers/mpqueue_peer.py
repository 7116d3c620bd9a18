"""``torch.multiprocessing`` queues: PyTorch's own way to hand tensors to another process.

Setup: a server process started with the ``spawn`` context of ``torch.multiprocessing``
reads requests from one ``Queue`` and answers on another. A tensor put on the queue is
moved into shared memory by torch's reductions (``file_descriptor`` strategy, the Linux
default: the receiver fetches the fd over a Unix socket) and only a handle is pickled.
The server reads the tensor and answers ``(numel, first, last)``. Two cases:

* already shared: the benchmark's tensor had ``share_memory_()`` before timing, so a
  put sends only the handle;
* fresh: each call puts a new (non-shared) tensor, cloned outside the timed region, so
  the put pays for a new shared segment and the copy into it, as a new tensor would.

The client API is blocking, so it is timed with blocking calls. Pipelined calls keep N
requests in the queue (put N, then get one and put one).
"""

from __future__ import annotations

import queue
import time
from typing import Any

import torch
import torch.multiprocessing as tmp


def server_main(requests: Any, replies: Any) -> None:
    """The server process: answer every request until a ``None`` arrives."""
    while True:
        item = requests.get()
        if item is None:
            return
        if isinstance(item, tuple):
            replies.put(item[0] + item[1])
        else:
            replies.put((item.numel(), float(item[0]), float(item[-1])))
            del item


class MpQueuePeer:
    """The server process and its two queues, used as a context manager."""

    def __init__(self, *, start_timeout: float = 60.0, reply_timeout: float = 60.0) -> None:
        ctx = tmp.get_context("spawn")
        self.requests: Any = ctx.Queue()
        self.replies: Any = ctx.Queue()
        self.proc: Any = ctx.Process(
            target=server_main, args=(self.requests, self.replies), daemon=True
        )
        self.start_timeout = start_timeout
        self.reply_timeout = reply_timeout

    def __enter__(self) -> MpQueuePeer:
        self.proc.start()
        try:
            self.requests.put((1, 2))
            if self.replies.get(timeout=self.start_timeout) != 3:
                raise RuntimeError("mp.Queue server answered wrongly")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop and reap the server process; close the queues."""
        try:
            if self.proc.is_alive():
                self.requests.put(None)
                self.proc.join(timeout=10)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
            for q in (self.requests, self.replies):
                q.close()
                q.join_thread()

    def _get(self) -> Any:
        try:
            return self.replies.get(timeout=self.reply_timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply within {self.reply_timeout}s") from None

    def add(self, a: int, b: int) -> int:
        """One small call."""
        self.requests.put((a, b))
        return int(self._get())

    def consume(self, t: torch.Tensor) -> tuple[int, float, float]:
        """Send a tensor; return the server's ``(numel, first, last)``."""
        self.requests.put(t)
        result: tuple[int, float, float] = self._get()
        return result

    def window(self, total: int, inflight: int, seconds: float) -> int:
        """Make up to ``total`` small calls (for at most about ``seconds``) keeping
        ``inflight`` in the queue; return how many completed."""
        stop_at = time.perf_counter() + seconds
        sent = received = 0
        while sent < min(inflight, total):
            self.requests.put((1, 2))
            sent += 1
        while received < sent:
            self._get()
            received += 1
            if sent < total and time.perf_counter() < stop_at:
                self.requests.put((1, 2))
                sent += 1
        return received
