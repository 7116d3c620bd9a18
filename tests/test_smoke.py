from __future__ import annotations

import anyio

import tensorrpc


async def test_event_loop_runs(anyio_backend: str) -> None:
    with anyio.fail_after(5):
        await anyio.sleep(0)
    assert tensorrpc.__doc__
