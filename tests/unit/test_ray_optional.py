"""Ray is an optional extra: `import tensorrpc` never imports it, and tensorrpc.ray says
which extra to install when it is missing (checked in fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys

_NO_RAY = """
import sys
sys.modules["ray"] = None  # as if Ray were not installed
try:
    import tensorrpc.ray
except ImportError as exc:
    print(exc)
else:
    print("imported")
"""


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_import_tensorrpc_does_not_import_ray() -> None:
    out = _run("import sys, tensorrpc, tensorrpc.cli; print('ray' in sys.modules)")
    assert out == "False"


def test_tensorrpc_ray_without_ray_names_the_extra() -> None:
    out = _run(_NO_RAY)
    assert "pip install 'tensorrpc[ray]'" in out
