"""TypedStub: typed stubs that mypy (without the plugin) and pyright check alike.

``snippets/typed_stub_cases.py`` holds accepted calls (``assert_type``) and rejected ones
(each marked ``# E``). Each checker must report exactly one error on each marked line and
none elsewhere. pyright is run when it is installed (``pyright`` on ``PATH`` or
``$PYRIGHT``: the npm package, which works offline once installed; the PyPI ``pyright``
wrapper downloads Node.js at run time, so it is not a dev dependency); otherwise that
case is skipped and says so. The calls themselves run against a real engine below.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

import tensorrpc
from tensorrpc import TypedStub, rpc, service, streaming, unary
from tests.typing.snippets.typed_stub_cases import Calc, CalcStub

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = Path(__file__).parent / "snippets" / "typed_stub_cases.py"
#: mypy as a pyright user's project would run it: strict, and no tensorrpc plugin.
MYPY_CONFIG = "[mypy]\nstrict = True\npython_version = 3.11\nwarn_unreachable = True\n"


def marked_lines() -> list[int]:
    lines = SNIPPET.read_text(encoding="utf-8").splitlines()
    return [n for n, line in enumerate(lines, start=1) if line.rstrip().endswith("# E")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _error_lines(output: str, pattern: str) -> list[int]:
    return sorted(int(m["line"]) for m in re.finditer(pattern, output, re.M))


def test_mypy_without_the_plugin_checks_a_typed_stub(tmp_path: Path) -> None:
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--config-file", str(config)),
            # A cache of its own: other options than the project's (no plugin).
            *("--cache-dir", str(ROOT / ".mypy_cache" / "no-plugin")),
            str(SNIPPET.relative_to(ROOT)),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert "tensorrpc.mypy_plugin" not in MYPY_CONFIG
    errors = _error_lines(output, r"^[^:\n]*typed_stub_cases\.py:(?P<line>\d+): error:")
    assert errors == marked_lines(), output
    assert len(errors) == 7


def _pyright() -> str | None:
    return os.environ.get("PYRIGHT") or shutil.which("pyright")


@pytest.mark.skipif(_pyright() is None, reason="pyright is not installed (npm i pyright)")
def test_pyright_checks_a_typed_stub() -> None:
    pyright = _pyright()
    assert pyright is not None
    proc = subprocess.run(
        [pyright, "--pythonpath", sys.executable, str(SNIPPET)],
        cwd=SNIPPET.parent,  # no pyproject.toml there: pyright's defaults, as a user's
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = proc.stdout + proc.stderr
    errors = _error_lines(output, r"typed_stub_cases\.py:(?P<line>\d+):\d+ - error:")
    assert errors == marked_lines(), output


async def test_typed_stub_calls_run_as_typed(tmp_path: Path, anyio_backend: str) -> None:
    address = f"ipc://{tmp_path}/calc.sock"
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg, tensorrpc.Client(Calc, bind=address) as client:
            tg.start_soon(lambda: tensorrpc.serve(Calc(), connect=address, engine_id="e1"))
            await client.wait_for_engines(1, timeout=30)
            calc = CalcStub(client)
            assert await calc.add(1, 2) == 3
            assert await calc.add(1, b=5) == 6
            assert torch.equal(await calc.scale(torch.ones(2), 2.0), torch.full((2,), 2.0))
            stream = calc.count(3)
            assert isinstance(stream, tensorrpc.CallStream)
            assert [i async for i in stream] == [0, 1, 2]
            view = CalcStub(client.with_options(engine="e1"))
            assert await view.add(2) == 3
            tg.cancel_scope.cancel()


@service
class Other:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    async def ticks(self) -> AsyncIterator[int]:
        yield 1


def test_a_typed_stub_is_checked_against_its_service_when_defined() -> None:
    with pytest.raises(TypeError, match=r"Wrong\.add: 'add' is not an @rpc method of Calc"):

        class Wrong(TypedStub[Calc]):
            add = unary(Other.add)

    with pytest.raises(TypeError, match=r"Kinds\.count: Calc\.count is streaming"):

        class Kinds(TypedStub[Calc]):
            count = unary(Calc.count)  # a type checker accepts it: refused at run time

    with pytest.raises(TypeError, match=r"Kinds2\.add: Calc\.add is unary"):

        class Kinds2(TypedStub[Calc]):
            add = streaming(Calc.add)  # type: ignore[arg-type, var-annotated]

    with pytest.raises(TypeError, match="must name its service"):

        class Nameless(TypedStub):  # type: ignore[type-arg]
            add = unary(Calc.add)
