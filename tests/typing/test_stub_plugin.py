"""Client stubs tell the truth: what mypy accepts runs, and what mypy rejects fails.

The accepted side: ``test_client_typing.py`` pins the stub's types with ``assert_type``
(checked by the project's mypy run, which loads ``tensorrpc.mypy_plugin``), and
``test_stub_calls_run_as_typed`` below makes those same calls against a real engine. The
rejected side: ``snippets/stub_rejected.py`` holds calls that fail at run time, each
marked with a comment ``E: <start of mypy's message>``; mypy must report exactly those errors.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

import tensorrpc
from tensorrpc import rpc, service

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = Path(__file__).parent / "snippets" / "stub_rejected.py"
_EXPECTED = re.compile(r"#\s*E:\s*(?P<message>.+?)\s*$")
_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*?)(?:  \[[\w-]+\])?$")


@service
class Calc:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    def helper(self) -> int:
        return 1


def expected_errors(text: str) -> dict[int, str]:
    """``{line: message start}`` for every ``# E:`` comment of a snippet."""
    found: dict[int, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        match = _EXPECTED.search(line)
        if match is not None:
            found[number] = match["message"]
    return found


def test_expected_errors_are_read_from_comments() -> None:
    assert expected_errors("x = 1\ny = f()  # E: Incompatible types\n") == {2: "Incompatible types"}


def test_mypy_rejects_stub_calls_that_fail_at_run_time() -> None:
    expected = expected_errors(SNIPPET.read_text(encoding="utf-8"))
    assert len(expected) >= 15
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(ROOT)
    # The project's configuration (which loads the plugin) and cache: torch's analysis
    # is shared with the `make check` run that precedes the tests.
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")),
            *("--cache-dir", str(ROOT / ".mypy_cache"), str(SNIPPET.relative_to(ROOT))),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = proc.stdout + proc.stderr
    errors: dict[int, list[str]] = {}
    for text in output.splitlines():
        error = _ERROR.match(text)
        if error is not None:
            assert Path(error["path"]).name == SNIPPET.name, output
            errors.setdefault(int(error["line"]), []).append(error["message"])
    assert sorted(errors) == sorted(expected), output
    for number, message in expected.items():
        # One error per line, the one that says what is wrong (no second one beside it).
        (found,) = errors[number]
        assert found.startswith(message), f"line {number}: {found!r}"
    assert proc.returncode == 1, output


async def test_stub_calls_run_as_typed(tmp_path: Path, anyio_backend: str) -> None:
    """The calls that ``test_client_typing.py`` types, made against a real engine."""
    address = f"ipc://{tmp_path}/calc.sock"
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg, tensorrpc.Client(Calc, bind=address) as client:
            tg.start_soon(lambda: tensorrpc.serve(Calc(), connect=address, engine_id="e1"))
            await client.wait_for_engines(1, timeout=30)
            calc = client.stub()
            # A sync handler: the stub's call is a coroutine, as mypy is told.
            pending = calc.scale(torch.ones(2), 2.0)
            assert inspect.iscoroutine(pending)
            assert torch.equal(await pending, torch.full((2,), 2.0))
            assert await calc.add(1, 2) == 3
            assert await calc.add(1, b=5) == 6
            stream = calc.count(3)
            assert isinstance(stream, tensorrpc.CallStream)
            assert [i async for i in stream] == [0, 1, 2]
            # Rejected by mypy, and refused at run time.
            with pytest.raises(AttributeError, match="helper"):
                calc.helper()  # type: ignore[misc]
            with pytest.raises(tensorrpc.ValidationError, match="unexpected keyword argument 'c'"):
                await calc.add(1, c=2)  # type: ignore[call-arg]
            tg.cancel_scope.cancel()
