"""grpc.aio with a generic bytes handler: what most services use today.

Setup: the server is a ``grpc.aio`` server in its own process, listening on a Unix
domain socket (``unix://``, gRPC's nearest equivalent of ``ipc://``), with no protoc:
``grpc.method_handlers_generic_handler`` maps ``Add`` and ``Consume`` to
``unary_unary_rpc_method_handler``s whose (de)serializers are the identity, so gRPC moves
plain bytes. ``Add`` takes and returns ormsgpack like the raw pyzmq peer. ``Consume``
takes a tensor's bytes (the client must turn the tensor into ``bytes``: that copy is part
of using gRPC), builds a tensor on them with ``torch.frombuffer`` and answers
``[numel, first, last]``. Message size limits are raised to 256 MiB on both ends.
"""

from __future__ import annotations

import argparse
import asyncio
import warnings
from typing import Any

import grpc
import grpc.aio
import ormsgpack

from bench.peers._child import ready, wait_stdin_eof

SERVICE = "bench.Bench"
MAX_MESSAGE = 256 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


async def _add(request: bytes, context: Any) -> bytes:
    a, b = ormsgpack.unpackb(request)
    return ormsgpack.packb(a + b)


async def _consume(request: bytes, context: Any) -> bytes:
    import torch

    t = torch.frombuffer(request, dtype=torch.float32)
    return ormsgpack.packb([t.numel(), float(t[0]), float(t[-1])])


async def serve(addr: str, with_torch: bool) -> None:
    """Serve on ``addr`` (``unix:///path``) until stdin closes."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    if with_torch:
        import torch  # noqa: F401  (imported before READY, not during the first call)
    server = grpc.aio.server(options=OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Add": grpc.unary_unary_rpc_method_handler(_add),
            "Consume": grpc.unary_unary_rpc_method_handler(_consume),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(addr)
    await server.start()
    ready(addr)
    try:
        await wait_stdin_eof()
    finally:
        await server.stop(grace=1.0)


class GrpcClient:
    """A ``grpc.aio`` channel with identity (de)serializers."""

    def __init__(self, addr: str) -> None:
        self.channel = grpc.aio.insecure_channel(addr, options=OPTIONS)
        self._add = self.channel.unary_unary(f"/{SERVICE}/Add")
        self._consume = self.channel.unary_unary(f"/{SERVICE}/Consume")

    async def aclose(self) -> None:
        """Close the channel."""
        await self.channel.close()

    async def wait_ready(self) -> None:
        """Wait until connected (the caller bounds the wait)."""
        await self.channel.channel_ready()

    async def add(self, a: int, b: int) -> int:
        """One small call."""
        return int(ormsgpack.unpackb(await self._add(ormsgpack.packb([a, b]))))

    async def consume(self, t: Any) -> list[Any]:
        """Send a tensor's bytes; return the server's ``[numel, first, last]``."""
        out: list[Any] = ormsgpack.unpackb(await self._consume(t.numpy().tobytes()))
        return out


def main() -> None:
    """Peer entry point: ``python -m bench.peers.grpc_peer unix:///PATH [--torch]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("addr")
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()
    asyncio.run(serve(args.addr, args.torch))


if __name__ == "__main__":
    main()
