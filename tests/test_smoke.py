from __future__ import annotations

import anyio
import anyio.lowlevel

import tensorrpc


async def test_event_loop_runs(anyio_backend: str) -> None:
    with anyio.fail_after(5):
        await anyio.lowlevel.checkpoint()
    assert tensorrpc.__doc__
