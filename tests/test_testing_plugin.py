"""tensorrpc.testing: the fixtures (enabled in tests/conftest.py) and the helpers behind them.

Async tests run on asyncio and trio (tests/conftest.py's ``anyio_backend``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

import tensorrpc
from tensorrpc import rpc, service
from tensorrpc.testing import (
    ASYNCIO_ON_TRIO,
    EnginesFactory,
    EngineStartError,
    engine_processes,
    import_path,
    serve_engines,
)

ROOT = Path(__file__).resolve().parent.parent


@service
class Greeter:
    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting

    @rpc
    async def greet(self, name: str) -> str:
        return f"{self.greeting} {name}"

    @rpc
    async def pid(self) -> int:
        return os.getpid()

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


def make_hi() -> Greeter:
    return Greeter("hi")


def make_broken() -> Greeter:
    raise RuntimeError("no weights here")


# The fixtures a user overrides to pick the service of `tensorrpc_client`.
@pytest.fixture
def tensorrpc_service() -> type[Greeter]:
    return Greeter


@pytest.fixture
def tensorrpc_engine_count() -> int:
    return 2


async def test_client_fixture_serves_engines_in_process(
    tensorrpc_client: tensorrpc.Client[Greeter],
) -> None:
    assert sorted(tensorrpc_client.engines) == ["engine-0", "engine-1"]
    assert await tensorrpc_client.call(Greeter.greet, "x") == "hello x"
    assert await tensorrpc_client.call(Greeter.pid) == os.getpid()  # isolation="task"
    assert [i async for i in tensorrpc_client.stream(Greeter.count, 3)] == [0, 1, 2]


async def test_engines_factory_starts_several_sets(tensorrpc_engines: EnginesFactory) -> None:
    plain = await tensorrpc_engines(Greeter)
    custom = await tensorrpc_engines(Greeter, 2, factory=make_hi, engine_ids=["a", "b"])
    assert await plain.call(Greeter.greet, "x") == "hello x"
    assert await custom.broadcast("greet", "y") == {"a": "hi y", "b": "hi y"}


# One backend is enough here: the process path's only async code is shared with the tests
# above, and every engine process costs seconds of start-up (torch's import).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_process_engines_are_separate_and_reaped() -> None:
    async with serve_engines(
        Greeter, factory=make_hi, isolation="process", engine_options={"grace_period": 0.5}
    ) as client:
        pid = await client.call(Greeter.pid)
        assert pid != os.getpid()
        assert client.engines["engine-0"].pid == pid
        assert await client.call(Greeter.greet, "z") == "hi z"
    assert not os.path.exists(f"/proc/{pid}"), "not reaped"  # noqa: ASYNC240


def test_an_engine_that_cannot_start_fails_the_start_with_its_output() -> None:
    async def main() -> None:
        async with serve_engines(Greeter, factory=make_broken, isolation="process"):
            raise AssertionError("unreachable: the engine cannot start")

    with pytest.raises(EngineStartError, match="exited with status") as info:
        anyio.run(main)
    assert "no weights here" in str(info.value)


def test_engines_not_live_in_time() -> None:
    async def main() -> None:
        # No time at all: the engines cannot have finished their handshake.
        async with serve_engines(Greeter, start_timeout=0):
            raise AssertionError("unreachable")

    with pytest.raises(EngineStartError, match="0 of 1 engines live"):
        anyio.run(main)


def test_process_isolation_needs_an_importable_factory() -> None:
    @service
    class Local:
        @rpc
        async def ping(self) -> None:
            return None

    with pytest.raises(ValueError, match="not importable"):
        import_path(Local)
    with pytest.raises(ValueError, match="not importable"):
        import_path(lambda: Greeter())
    assert import_path(Greeter) == (f"{__name__}:Greeter", [])
    with (
        pytest.raises(ValueError, match="not available with isolation='process'"),
        engine_processes(Greeter, "tcp://127.0.0.1:1", engine_options={"max_queued": 1}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="distinct engine ids"),
        engine_processes(Greeter, "tcp://127.0.0.1:1", 2, engine_ids=["a", "a"]),
    ):
        pass


def test_serve_engines_refuses_an_unknown_isolation_before_starting_anything() -> None:
    async def main() -> None:
        async with serve_engines(Greeter, isolation="thread"):  # type: ignore[arg-type]
            raise AssertionError("unreachable")

    with pytest.raises(ValueError, match="isolation must be 'task' or 'process', not 'thread'"):
        anyio.run(main)


ASYNCIO_HANDLER_MODULE = """
import asyncio

import pytest

from tensorrpc import rpc, service


@service
class Napper:
    @rpc
    async def nap(self) -> str:
        await asyncio.sleep(0)  # asyncio only: trio cannot run it
        return "rested"


@pytest.fixture
def tensorrpc_service():
    return Napper


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_nap(tensorrpc_client):
    assert await tensorrpc_client.stub().nap() == "rested"
"""


def test_asyncio_handler_on_trio_fails_with_what_to_do(tmp_path: Path) -> None:
    # A user's test module, run by pytest with the plugin: the handler works on asyncio,
    # and on trio the failure says why and what to do.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_napper.py").write_text(ASYNCIO_HANDLER_MODULE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tensorrpc.testing", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "1 failed, 1 passed" in out
    assert "FAILED test_napper.py::test_nap[trio]" in out
    assert "unrecognized yield message" in out
    assert "tensorrpc: asyncio code on the trio backend" in out
    assert " ".join(ASYNCIO_ON_TRIO.split()) in " ".join(out.split())
