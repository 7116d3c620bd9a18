"""Raw pyzmq: the floor every ZMQ-based RPC is measured against.

Setup: the server is a ``zmq.asyncio`` ROUTER bound on ``ipc://`` in its own process;
the client is a ``zmq.asyncio`` DEALER in the benchmark process. There is no framework
at all: a call is ``[call id, op, payload, *data]`` and the reply ``[call id, result]``.
The two ints of a small call and its int result are packed with ormsgpack, as any RPC
must encode its arguments somehow. A tensor goes as one extra frame sent with
``copy=False`` (zero-copy from the tensor's memory); the server receives with
``copy=False`` and builds a tensor on the frame's buffer (``torch.frombuffer``), then
answers ``[numel, first, last]``, touching the data at both ends without scanning it.

Client shapes measured:

* :meth:`ZmqClient.ping` is a plain ping-pong (send, then receive on the same
  coroutine): the minimum for one sequential call.
* :meth:`ZmqClient.window` keeps N requests outstanding from one coroutine (send N, then
  receive one and send one): the minimum for pipelined calls.
* :class:`ZmqFutureClient` is the smallest *usable* RPC client: a call-id → future table
  resolved by one reader task, so that many caller tasks can share the socket, as any
  RPC library (tensorrpc included) must do.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import struct
import time
import warnings
from typing import Any

import ormsgpack
import zmq
import zmq.asyncio

from bench.peers._child import ready, wait_stdin_eof

OP_ADD = b"a"
OP_TENSOR = b"t"
OP_ECHO = b"e"  # the tensor frame goes back as it came (zero-copy both ways)
OP_PRODUCE = b"p"  # a tensor of the asked size, held by the server, sent zero-copy
_ID = struct.Struct("<Q")


async def _serve_copy(sock: zmq.asyncio.Socket) -> None:
    while True:
        ident, cid, _op, payload = await sock.recv_multipart()
        a, b = ormsgpack.unpackb(payload)
        await sock.send_multipart([ident, cid, ormsgpack.packb(a + b)])


async def _serve_zero_copy(sock: zmq.asyncio.Socket) -> None:
    import torch

    dtypes = {"float32": torch.float32, "uint8": torch.uint8}
    produced: dict[int, torch.Tensor] = {}
    while True:
        frames = await sock.recv_multipart(copy=False)
        ident, cid, op = frames[0].bytes, frames[1].bytes, frames[2].bytes
        if op == OP_ADD:
            a, b = ormsgpack.unpackb(frames[3].bytes)
            reply = ormsgpack.packb(a + b)
        elif op == OP_ECHO:
            await sock.send_multipart([ident, cid, frames[3], frames[4]], copy=False)
            del frames
            continue
        elif op == OP_PRODUCE:
            nbytes = ormsgpack.unpackb(frames[3].bytes)
            t = produced.get(nbytes)
            if t is None:
                t = produced[nbytes] = torch.arange(nbytes // 4, dtype=torch.float32)
            await sock.send_multipart([ident, cid, *_tensor_frames(t)[1:]], copy=False)
            continue
        else:
            dtype, shape = ormsgpack.unpackb(frames[3].bytes)
            t = torch.frombuffer(frames[4].buffer, dtype=dtypes[dtype]).reshape(shape)
            reply = ormsgpack.packb([t.numel(), float(t[0]), float(t[-1])])
            del t
        await sock.send_multipart([ident, cid, reply])


async def serve(addr: str, zero_copy: bool) -> None:
    """Serve on ``addr`` until stdin closes."""
    # frombuffer over a read-only zmq frame warns; the server only reads it
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    loop_task = asyncio.create_task(_serve_zero_copy(sock) if zero_copy else _serve_copy(sock))
    ready(addr)
    stop = asyncio.create_task(wait_stdin_eof())
    try:
        done, _ = await asyncio.wait({loop_task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if loop_task in done:
            loop_task.result()  # the serve loop failed: let its error end the process
    finally:
        loop_task.cancel()
        stop.cancel()
        await asyncio.gather(loop_task, stop, return_exceptions=True)
        sock.close(linger=0)
        ctx.term()


def _tensor_frames(t: Any) -> list[Any]:
    dtype = str(t.dtype).removeprefix("torch.")
    meta = ormsgpack.packb([dtype, list(t.shape)])
    return [OP_TENSOR, meta, memoryview(t.numpy()).cast("B")]


class ZmqClient:
    """Ping-pong and windowed client on one DEALER (see the module docstring)."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self._ids = itertools.count(1)

    def close(self) -> None:
        """Close the socket and the context."""
        self.sock.close(linger=0)
        self.ctx.term()

    async def add(self, a: int, b: int) -> int:
        """One small call, ping-pong."""
        cid = _ID.pack(next(self._ids))
        await self.sock.send_multipart([cid, OP_ADD, ormsgpack.packb([a, b])])
        rid, result = await self.sock.recv_multipart()
        assert rid == cid
        return int(ormsgpack.unpackb(result))

    async def consume(self, t: Any) -> list[Any]:
        """Send a tensor zero-copy; return the server's ``[numel, first, last]``."""
        cid = _ID.pack(next(self._ids))
        await self.sock.send_multipart([cid, *_tensor_frames(t)], copy=False)
        rid, result = await self.sock.recv_multipart()
        assert rid == cid
        out: list[Any] = ormsgpack.unpackb(result)
        return out

    async def window(self, total: int, inflight: int, seconds: float) -> int:
        """Make up to ``total`` small calls (for at most about ``seconds``) keeping
        ``inflight`` outstanding; return how many completed."""
        payload = ormsgpack.packb([1, 2])
        stop_at = time.perf_counter() + seconds
        sent = received = 0
        while sent < min(inflight, total):
            sent += 1
            await self.sock.send_multipart([_ID.pack(sent), OP_ADD, payload])
        while received < sent:
            await self.sock.recv_multipart()
            received += 1
            if sent < total and time.perf_counter() < stop_at:
                sent += 1
                await self.sock.send_multipart([_ID.pack(sent), OP_ADD, payload])
        return received


class ZmqFutureClient:
    """The smallest multiplexing RPC client: call id → future, one reader task.

    Args:
        addr: The peer's address.
        copy: Receive replies as bytes (True: small calls) or as zero-copy frames
            (False: large ones; then only `call` is usable).
    """

    def __init__(self, addr: str, *, copy: bool = True) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self._copy = copy
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future[list[Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ZmqFutureClient:
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()

    async def _read(self) -> None:
        copy = self._copy
        while True:
            frames: list[Any] = await self.sock.recv_multipart(copy=copy)
            cid = frames[0] if copy else frames[0].bytes
            fut = self._pending.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result(frames[1:])
            del frames, fut

    async def call(self, *parts: Any) -> list[Any]:
        """Send ``[call id, *parts]`` zero-copy; the reply's frames after the call id."""
        cid = _ID.pack(next(self._ids))
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        await self.sock.send_multipart([cid, *parts], copy=False)
        return await fut

    async def add(self, a: int, b: int) -> int:
        """One small call through the future table."""
        cid = _ID.pack(next(self._ids))
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        await self.sock.send_multipart([cid, OP_ADD, ormsgpack.packb([a, b])])
        (result,) = await fut
        return int(ormsgpack.unpackb(result))


def main() -> None:
    """Peer entry point: ``python -m bench.peers.zmq_peer ADDR [--zero-copy]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("addr")
    parser.add_argument("--zero-copy", action="store_true")
    args = parser.parse_args()
    asyncio.run(serve(args.addr, args.zero_copy))


if __name__ == "__main__":
    main()
