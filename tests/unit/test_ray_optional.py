"""Ray is an optional extra: `import tensorrpc` never imports it, and tensorrpc.ray says
which extra to install when it is missing (checked in a fresh interpreter, shared with the
other optional-import checks: tests/_fresh_imports.py)."""

from __future__ import annotations

from .._fresh_imports import report


def test_import_tensorrpc_does_not_import_ray() -> None:
    assert [m for m in report()["optional imported"] if m.split(".")[0] == "ray"] == []


def test_tensorrpc_ray_without_ray_names_the_extra() -> None:
    assert "pip install 'tensorrpc[ray]'" in str(report()["tensorrpc.ray"])
