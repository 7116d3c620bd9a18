"""What importing tensorrpc loads, seen from a fresh interpreter: one per test process.

A check that ``import tensorrpc`` never imports an optional integration needs an
interpreter that has imported nothing else (not this one, not a fork of the pre-imported
zygote of tests/_forkserver.py). Each such interpreter costs a torch import (seconds of
CPU on a 2-core machine), so every such check reads one report, made once per test
process by [`report`][]: the modules loaded by the package and its entry points, then
what the integration modules do (tensorrpc.metrics loads prometheus_client;
tensorrpc.ray, with Ray made unimportable, raises an ImportError naming the extra).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

#: Top-level names of the optional integrations (extras) and of the record types' packages
#: (msgspec, pydantic) that ``import tensorrpc`` must not load.
OPTIONAL = ("msgspec", "opentelemetry", "prometheus_client", "pydantic", "ray", "rich", "zstandard")

#: Modules that only a value with a tensor (or array) in it may import: seconds of start-up.
HEAVY = ("torch", "numpy")

_PROGRAM = f"""
import contextlib, io, json, sys
def loaded(names):
    return sorted(m for m in sys.modules if m.split(".")[0] in names)
import tensorrpc
out = {{"import tensorrpc loads": sorted(m for m in sys.modules if m.startswith("tensorrpc"))}}
import tensorrpc.cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    tensorrpc.cli.main(["--version"])
out["tensorrpc --version imports"] = loaded({set(HEAVY)!r})
import tensorrpc._client, tensorrpc._server
out["optional imported"] = loaded({set(OPTIONAL)!r})

# An engine and a client in this process: first plain values (no tensor involved), then,
# once the caller has imported torch, tensors (the codec and validators load it then).
import tempfile, anyio
from tensorrpc import Client, rpc, serve, service

@service
class Plain:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

async def one_call(cls, call):
    with anyio.fail_after(60), tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{{tmp}}/engine.sock"
        async with anyio.create_task_group() as tg, Client(cls, bind=address) as client:
            tg.start_soon(lambda: serve(cls(), connect=address, engine_id="e1"))
            await client.wait_for_engines(1, timeout=30)
            result = await call(client.stub())
            tg.cancel_scope.cancel()
    return result

out["plain call"] = anyio.run(one_call, Plain, lambda calc: calc.add(2, 5))
out["a plain call imports"] = loaded({set(HEAVY)!r})

import torch

@service
class Tensors:
    @rpc
    async def double(self, x: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x * 2, *xs]

got = anyio.run(one_call, Tensors, lambda t: t.double(torch.arange(3), [torch.ones(2)]))
out["tensor call"] = [t.tolist() for t in got]
async def refused(t):
    try:
        await t.double([1], [])
    except tensorrpc.ValidationError as exc:
        return str(exc)

out["tensor refused"] = anyio.run(one_call, Tensors, refused)

import tensorrpc.metrics
out["tensorrpc.metrics imports prometheus_client"] = "prometheus_client" in sys.modules
sys.modules["ray"] = None  # as if Ray were not installed
try:
    import tensorrpc.ray
except ImportError as exc:
    out["tensorrpc.ray"] = str(exc)
else:
    out["tensorrpc.ray"] = "imported"
print(json.dumps(out))
"""


@functools.cache
def report() -> dict[str, Any]:
    """The fresh interpreter's findings (see the module docstring), computed once."""
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out
