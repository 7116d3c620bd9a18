"""A small TCP chaos proxy for tests: delay, bandwidth cap, cut, blackhole; it records bytes.

It listens on 127.0.0.1 (or any address given) and forwards every accepted connection to
one target. Faults apply to traffic in both directions and can be changed at any time:

* ``delay``: each chunk waits this many seconds before it is forwarded;
* ``rate``: bytes per second per direction (a bandwidth cap);
* ``cut()``: closes every open connection at once (the peers see a reset and reconnect);
* ``blackhole``: connections stay open but nothing is forwarded any more (a host that
  vanished without a FIN or RST: only timeouts notice).

It also keeps every byte it forwarded (``seen``), which makes it a passive relay that
shows what an on-path observer sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import anyio.abc


class ChaosProxy:
    """Forward TCP connections to ``target_host:target_port`` with injectable faults."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.delay = 0.0
        self.rate: float | None = None
        self.blackhole = False
        self.seen = bytearray()
        self.connections = 0
        self._scopes: set[anyio.CancelScope] = set()
        self.port = 0

    async def _pump(self, src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream) -> None:
        with contextlib.suppress(
            anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError
        ):
            while True:
                data = await src.receive(65536)
                if self.blackhole:
                    continue  # swallowed: nothing reaches the other side
                if self.delay:
                    await anyio.sleep(self.delay)
                if self.rate:
                    await anyio.sleep(len(data) / self.rate)
                self.seen += data
                await dst.send(data)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.connections += 1
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                upstream = await anyio.connect_tcp(*self.target)
            except OSError:
                await client.aclose()
                return
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._pump, client, upstream)
                    await self._pump(upstream, client)
                    tg.cancel_scope.cancel()
            finally:
                self._scopes.discard(scope)
                with anyio.CancelScope(shield=True):
                    for stream in (client, upstream):
                        with contextlib.suppress(Exception):
                            await stream.aclose()

    def cut(self) -> None:
        """Close every open connection now (new ones are accepted again)."""
        for scope in list(self._scopes):
            scope.cancel()

    @contextlib.asynccontextmanager
    async def running(self, host: str = "127.0.0.1") -> AsyncIterator[ChaosProxy]:
        """Serve until the block ends; ``port`` is the listening port."""
        listener = await anyio.create_tcp_listener(local_host=host, local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self._handle)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()
