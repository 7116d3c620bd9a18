"""Helpers for the peer side of :mod:`bench.peers._proc`: announce readiness, await stop."""

from __future__ import annotations

import asyncio
import os
import sys


def ready(info: str = "") -> None:
    """Tell the benchmark this peer serves (the one line it writes on stdout)."""
    sys.stdout.write(f"READY {info}\n")
    sys.stdout.flush()


async def wait_stdin_eof() -> None:
    """Return once stdin reaches end of file: the benchmark asked this peer to stop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    fd = sys.stdin.fileno()

    def on_readable() -> None:
        try:
            data = os.read(fd, 4096)
        except OSError:
            data = b""
        if not data and not done.done():
            done.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)


def wait_stdin_eof_blocking() -> None:
    """Blocking twin of :func:`wait_stdin_eof`, for peers without an event loop."""
    fd = sys.stdin.fileno()
    while os.read(fd, 4096):
        pass
