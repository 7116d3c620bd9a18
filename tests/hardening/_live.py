"""Helpers for the hardening tests: a live in-process engine with a scripted raw peer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tensorrpc._server import Server
from tensorrpc._service import describe
from tests.integration.server_peer import Peer, open_peer
from tests.integration.server_services import Probe

SPEC = describe(Probe)


@contextlib.asynccontextmanager
async def live_engine(
    tmp_path: Path, *, listen: bool = False, **options: Any
) -> AsyncIterator[tuple[Server, Peer, Probe]]:
    """A running in-process engine serving a :class:`Probe`, and a raw peer after WELCOME.

    Dial-in by default (the peer binds an ipc socket, the engine's DEALER connects);
    ``listen=True``: the engine binds ``tcp://127.0.0.1:0`` and the peer dials it.
    """
    probe = Probe()
    options.setdefault("engine_id", "fuzzed")
    options.setdefault("grace_period", 0.5)
    if listen:
        async with Server(probe, bind="tcp://127.0.0.1:0", **options) as server:
            assert server.endpoint is not None
            async with open_peer(SPEC, connect=server.endpoint) as (peer, _):
                await peer.handshake(listen=True)
                yield server, peer, probe
    else:
        local = f"ipc://{tmp_path}/peer-{os.getpid()}.sock"
        async with (
            open_peer(SPEC, bind=local) as (peer, address),
            Server(probe, connect=address, **options) as server,
        ):
            await peer.handshake()
            yield server, peer, probe


def fd_count() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
