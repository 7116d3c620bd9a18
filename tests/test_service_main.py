"""A service's fingerprint is the same whether its module is imported or run as __main__
(checked against a program of its own: not a unit test)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

from tensorrpc._service import describe

from . import _forkserver


def test_fingerprint_matches_between_import_and_main(tmp_path: Path) -> None:
    module = tmp_path / "fp_service.py"
    module.write_text(
        textwrap.dedent(
            """
            from __future__ import annotations

            import dataclasses
            import enum
            from collections.abc import AsyncIterator

            from tensorrpc._service import describe, rpc, service


            class Mode(enum.Enum):
                A = 1


            @dataclasses.dataclass
            class Req:
                tokens: list[int]
                mode: Mode = Mode.A


            @service
            class Engine:
                @rpc
                async def generate(self, req: Req, n: int = 2) -> AsyncIterator[Req]:
                    yield req


            if __name__ == "__main__":
                print(describe(Engine).fingerprint)
            """
        )
    )
    repo = Path(__file__).resolve().parents[1]
    env_path = f"{tmp_path}{':'}{repo}"
    # Run as __main__ by a program of its own, forked from a pre-imported interpreter
    # (tests/_forkserver.py: no torch import to wait for).
    as_main = _forkserver.run(
        [sys.executable, str(module)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": env_path},
    )
    assert as_main.returncode == 0, as_main.stderr
    # The imported side in this process.
    spec = importlib.util.spec_from_file_location("fp_service", module)
    assert spec is not None
    assert spec.loader is not None
    imported = importlib.util.module_from_spec(spec)
    sys.modules["fp_service"] = imported
    try:
        spec.loader.exec_module(imported)
        imported_fingerprint = describe(imported.Engine).fingerprint
    finally:
        del sys.modules["fp_service"]
    fingerprint = as_main.stdout.strip()
    assert len(fingerprint) == 64
    assert fingerprint == imported_fingerprint
