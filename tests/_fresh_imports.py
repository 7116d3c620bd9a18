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

#: Top-level names of the optional integrations (extras) that ``import tensorrpc`` must not load.
OPTIONAL = ("opentelemetry", "prometheus_client", "ray", "rich")

_PROGRAM = f"""
import json, sys
import tensorrpc, tensorrpc._client, tensorrpc._server, tensorrpc.cli
out = {{"optional imported": sorted(
    m for m in sys.modules if m.split(".")[0] in {set(OPTIONAL)!r}
)}}
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
