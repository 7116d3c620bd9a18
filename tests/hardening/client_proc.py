"""A client in a subprocess, for the fault tests: it calls ``sleep(60, token)`` and waits.

Run as ``python -m tests.hardening.client_proc ADDRESS TOKEN``; the test kills it with
``kill -9`` while the call runs and checks that the engine cancels the handler.
"""

from __future__ import annotations

import sys

import anyio

from tensorrpc._client import Client
from tests.integration.services import Calculator


async def _main(address: str, token: str) -> None:
    async with Client(Calculator, connect=address, heartbeat_interval=0.1, dead_after=1.0) as c:
        await c.wait_for_engines(1, timeout=30)
        print("calling", flush=True)
        await c.stub().sleep(60.0, token)


if __name__ == "__main__":
    anyio.run(_main, sys.argv[1], sys.argv[2])
