"""A client program for tests/transports/test_shm_copy_threads.py (not a test module).

``python -m tests.transports._copy_client ADDRESS NBYTES`` dials the engine at ADDRESS,
asks it for a fresh tensor of NBYTES (``make``), for an echo of one (``echo``) and for an
echo whose argument the engine keeps (``echo_kept``), all by torch_shm, checks the bytes,
prints ``ok`` and exits.
"""

from __future__ import annotations

import sys

import anyio

from tensorrpc._client import Client
from tests.transports._engine import TensorService, digest, pattern


async def main(address: str, nbytes: int) -> None:
    with anyio.fail_after(60):
        async with Client(TensorService, connect=address) as client:
            await client.wait_for_engines(1, timeout=30)
            stub = client.with_options(transport="torch_shm").stub()
            made = await stub.make("uint8", [nbytes], 7)
            if digest(made) != digest(pattern("uint8", [nbytes], 7)):
                raise SystemExit("make: wrong bytes")
            x = pattern("uint8", [nbytes], 8)
            if digest(await stub.echo(x)) != digest(x):
                raise SystemExit("echo: wrong bytes")
            y = pattern("uint8", [nbytes], 9)
            if digest(await stub.echo_kept(y)) != digest(y):
                raise SystemExit("echo_kept: wrong bytes")
    print("ok", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]))
