"""Ray is an optional extra: `import tensorrpc` never imports it, and tensorrpc.ray says
which extra to install when it is missing (checked in a fresh interpreter: one, since
each costs a torch import)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHECKS = """
import json, sys
import tensorrpc, tensorrpc.cli
out = {"ray imported": "ray" in sys.modules}
sys.modules["ray"] = None  # as if Ray were not installed
try:
    import tensorrpc.ray
except ImportError as exc:
    out["tensorrpc.ray"] = str(exc)
else:
    out["tensorrpc.ray"] = "imported"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh() -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _CHECKS], capture_output=True, text=True, timeout=120, check=True
    )
    out: dict[str, object] = json.loads(done.stdout)
    return out


def test_import_tensorrpc_does_not_import_ray(fresh: dict[str, object]) -> None:
    assert fresh["ray imported"] is False


def test_tensorrpc_ray_without_ray_names_the_extra(fresh: dict[str, object]) -> None:
    assert "pip install 'tensorrpc[ray]'" in str(fresh["tensorrpc.ray"])
