"""Test helpers and a pytest plugin: engines of a service, started and reaped for a test.

[`serve_engines`][tensorrpc.testing.serve_engines] (async) and
[`engine_processes`][tensorrpc.testing.engine_processes] (sync, subprocesses) work
without pytest; the plugin (``pytest_plugins = ["tensorrpc.testing"]``) adds the
``tensorrpc_client`` and ``tensorrpc_engines`` fixtures (docs/testing.md). Every wait is
bounded, and an engine process that exits while starting fails the start with its output."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import anyio
import pytest

from tensorrpc._client import Client
from tensorrpc._exceptions import EnginesUnavailableError
from tensorrpc._server import serve

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence

__all__ = [
    "ASYNCIO_ON_TRIO",
    "EngineProcess",
    "EngineStartError",
    "Isolation",
    "engine_processes",
    "serve_engines",
]

S = TypeVar("S")
_HUGETLB = "glibc.malloc.hugetlb=1"

#: Where engines run: tasks of the caller's event loop, or one subprocess each.
Isolation = Literal["task", "process"]

#: Seconds to wait for the engines to be live, and for them to stop.
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
#: Engine settings that ``tensorrpc serve`` takes as flags (for ``isolation="process"``).
_PROCESS_OPTIONS = {
    "grace_period": "--grace-period",
    "max_concurrency": "--workers",
    "sync_workers": "--sync-workers",
}
#: Output of a failed engine process quoted in the error.
_LOG_TAIL = 4000
#: What starts an engine process (`subprocess.Popen`'s signature and interface). A test
#: hook: tensorrpc's own suite forks its engines from a pre-imported interpreter.
_popen: Any = subprocess.Popen


class EngineStartError(RuntimeError):
    """The engines did not become live in time, or an engine process exited while starting.

    The message holds the output of the engine processes that failed.
    """


@dataclass(frozen=True, slots=True)
class EngineProcess:
    """One engine subprocess started by [`engine_processes`][tensorrpc.testing.engine_processes]."""

    engine_id: str
    process: subprocess.Popen[bytes]
    #: Its stdout and stderr (deleted when the context manager exits).
    log: Path

    def output(self) -> str:
        """The end of what the engine printed so far (its last 4000 characters)."""
        return _log_tail(self.log)


# ------------------------------------------------------------------------------- helpers


def import_path(factory: Callable[[], object]) -> tuple[str, list[str]]:
    """``module:qualname`` of a class or factory, and extra ``sys.path`` entries for it.

    A class or function defined in a script run as ``__main__`` maps to the script's module
    name, with its directory on the path (the script must then guard its top level with
    ``if __name__ == "__main__":``, as for multiprocessing's spawn).

    Raises:
        ValueError: The callable is not defined at the top level of a module.
    """
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{factory!r} is not importable: isolation='process' needs a class or factory "
            "defined at the top level of a module (the engine process imports it)"
        )
    extra: list[str] = []
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if module == "__main__" and spec is not None and spec.name not in ("__main__", None):
        module = spec.name  # run as `python -m package.module`: importable by that name
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if main_file is None:
            raise ValueError(
                f"{factory!r} is defined in an interactive session: isolation='process' "
                "needs it in a module or script file"
            )
        path = Path(main_file).resolve()
        module = path.stem
        extra.append(str(path.parent))
    return f"{module}:{qualname}", extra


def _huge_page_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the large buffers of a new process on transparent huge pages.

    glibc's ``malloc`` (which allocates libzmq's received messages) and torch's CPU
    allocator ask for huge pages for large blocks (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
    ``THP_MEM_ALLOC_ENABLE=1``), so a 64 MiB buffer is faulted in and unmapped as 32
    pages instead of 16,384: less CPU taken from the small calls beside it
    (docs/transports.md, "Huge pages"). A setting ``env`` already has is kept.
    """
    out = dict(env)
    tunables = out.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" not in tunables:
        out["GLIBC_TUNABLES"] = f"{tunables}:{_HUGETLB}" if tunables else _HUGETLB
    out.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return out


def _engine_command(
    factory: Callable[[], object],
    address: str | Sequence[str],
    engine_id: str,
    engine_options: Mapping[str, Any],
) -> tuple[list[str], dict[str, str]]:
    target, extra_path = import_path(factory)
    args = [sys.executable, "-m", "tensorrpc.cli", "serve", target]
    for one in [address] if isinstance(address, str) else address:
        args += ["--connect", one]
    args += ["--engine-id", engine_id, "--log-level", "warning"]
    for key, value in engine_options.items():
        flag = _PROCESS_OPTIONS.get(key)
        if flag is None:
            raise ValueError(
                f"engine option {key!r} is not available with isolation='process' "
                f"(only {', '.join(sorted(_PROCESS_OPTIONS))})"
            )
        args += [flag, str(value)]
    env = _huge_page_env(os.environ)
    # The child imports what this process can: the same sys.path, and the script's folder.
    path = [*extra_path, *(p for p in sys.path if p and os.path.isdir(p))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return args, env


def _stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """One SIGTERM each (they drain together), SIGKILL past ``timeout``; always reaped.

    Never a second SIGTERM: ``tensorrpc serve`` drains on the first and a second one
    would kill it mid-drain, before its BYE.
    """
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-_LOG_TAIL:]


def _engine_ids(count: int, engine_ids: Sequence[str] | None) -> list[str]:
    if count < 1:
        raise ValueError("count must be at least 1")
    ids = list(engine_ids) if engine_ids is not None else [f"engine-{i}" for i in range(count)]
    if len(ids) != count or len(set(ids)) != count:
        raise ValueError(f"need {count} distinct engine ids, got {ids!r}")
    return ids


@contextlib.contextmanager
def engine_processes(
    factory: Callable[[], object],
    address: str | Sequence[str],
    count: int = 1,
    *,
    engine_ids: Sequence[str] | None = None,
    engine_options: Mapping[str, Any] | None = None,
    stop_timeout: float = STOP_TIMEOUT,
) -> Iterator[list[EngineProcess]]:
    """Run ``count`` engine subprocesses that dial the client(s) bound at ``address``.

    Each runs ``tensorrpc serve MODULE:FACTORY --connect ADDRESS`` (the factory, a
    ``@service`` class or a function returning an instance, must be importable). The
    caller waits for them with its client's ``wait_for_engines``. On exit every process
    gets SIGTERM (it drains), SIGKILL past ``stop_timeout``, and is reaped. The engines
    get this process's environment, with their large buffers on transparent huge pages
    unless it says otherwise (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
    ``THP_MEM_ALLOC_ENABLE=1``; docs/transports.md, "Huge pages").

    Args:
        factory: The service class, or a zero-argument factory of instances.
        address: The client's bound address, or several clients' (each engine serves
            them all).
        count: How many engines.
        engine_ids: Their ids (default ``engine-0``, ``engine-1``, ...).
        engine_options: ``grace_period``, ``max_concurrency`` or ``sync_workers``.
        stop_timeout: Seconds each engine gets to stop before it is killed.

    Yields:
        The processes, with their output.

    Raises:
        ValueError: The factory is not importable, or bad ids or options.
    """
    ids = _engine_ids(count, engine_ids)
    commands = [_engine_command(factory, address, i, engine_options or {}) for i in ids]
    engines: list[EngineProcess] = []
    with tempfile.TemporaryDirectory(prefix="tensorrpc-engines-") as logs:
        try:
            for engine_id, (args, env) in zip(ids, commands, strict=True):
                path = Path(logs) / f"{engine_id}.log"
                with path.open("wb") as log:
                    proc = _popen(
                        args,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # Ctrl-C reaches us; we stop them
                    )
                engines.append(EngineProcess(engine_id, proc, path))
            yield engines
        finally:
            _stop_processes([engine.process for engine in engines], stop_timeout)


async def _wait_live(client: Client[Any], engines: Sequence[EngineProcess], seconds: float) -> None:
    """Wait until the engines are live; fail at once if an engine process exits meanwhile."""

    async def watch(engine: EngineProcess) -> None:
        # Polls the child's exit status (portable; no pidfd); bounded by the caller's scope.
        while engine.process.poll() is None:  # noqa: ASYNC110 - nothing to wait on but time
            await anyio.sleep(0.05)
        raise EngineStartError(
            f"engine process {engine.engine_id!r} (pid {engine.process.pid}) exited with "
            f"status {engine.process.returncode} while starting:\n{engine.output()}"
        )

    try:
        async with anyio.create_task_group() as tg:
            for engine in engines:
                tg.start_soon(watch, engine)
            await client.wait_for_engines(len(engines), timeout=seconds)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # One failure (a process that exited, or the timeout): raise it as itself.
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    except EnginesUnavailableError as exc:
        text = "\n".join(f"--- {e.engine_id}:\n{e.output()}" for e in engines)
        raise EngineStartError(f"{exc}\n{text}") from exc


@contextlib.asynccontextmanager
async def serve_engines(
    service: type[S],
    count: int = 1,
    *,
    factory: Callable[[], object] | None = None,
    isolation: Isolation = "task",
    engine_ids: Sequence[str] | None = None,
    engine_options: Mapping[str, Any] | None = None,
    client_options: Mapping[str, Any] | None = None,
    address: str | None = None,
    start_timeout: float = START_TIMEOUT,
    stop_timeout: float = STOP_TIMEOUT,
) -> AsyncIterator[Client[S]]:
    """Start ``count`` engines of ``service`` and yield a client connected to all of them.

    The client binds ``address`` and the engines dial in: tasks of the current event loop
    (``isolation="task"``, on loopback tcp) or ``tensorrpc serve`` subprocesses
    (``"process"``, on an ``ipc://`` socket in a private temporary directory, so that
    torch_shm works between them).

    Args:
        service: The ``@service`` class.
        count: How many engines.
        factory: Makes one engine's instance (default: ``service`` called with no
            arguments). With ``isolation="process"`` it must be importable (defined at
            the top level of a module).
        isolation: ``"task"`` or ``"process"``.
        engine_ids: The engines' ids (default ``engine-0``, ``engine-1``, ...).
        engine_options: Keyword arguments of [`serve`][tensorrpc.serve]
            (``"process"``: only ``grace_period``, ``max_concurrency``, ``sync_workers``).
        client_options: Keyword arguments of [`Client`][tensorrpc.Client].
        address: The address the client binds (default: as above).
        start_timeout: Seconds to wait for the engines to be live.
        stop_timeout: Seconds each engine process gets to stop before it is killed.

    Yields:
        The open client, with every engine live.

    Raises:
        EngineStartError: The engines were not live within ``start_timeout``, or an engine
            process exited while starting (the message has its output).
        ValueError: Bad arguments (a factory that is not importable for processes, ...).
    """
    if isolation not in ("task", "process"):
        raise ValueError(f"isolation must be 'task' or 'process', not {isolation!r}")
    ids = _engine_ids(count, engine_ids)
    make = factory if factory is not None else service
    options = dict(engine_options or {})
    started = False
    try:
        async with contextlib.AsyncExitStack() as stack:
            if address is None:
                address = _default_address(isolation, stack)
            client = await stack.enter_async_context(
                Client(service, bind=address, **dict(client_options or {}))
            )
            bound = client.addresses[0]
            if isolation == "task":
                await _start_tasks(stack, client, make, bound, ids, options, start_timeout)
            else:
                processes = engine_processes(
                    make, bound, count, engine_ids=ids, engine_options=options,
                    stop_timeout=stop_timeout,
                )  # fmt: skip
                await _wait_live(client, stack.enter_context(processes), start_timeout)
            started = True
            yield client
    except BaseExceptionGroup as group:
        # A failed start comes out of the task groups as a group of one: raise it as itself.
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if started or not isinstance(leaf, EngineStartError):
            raise
        raise leaf from None


async def _start_tasks(
    stack: contextlib.AsyncExitStack,
    client: Client[Any],
    make: Callable[[], object],
    bound: str,
    ids: list[str],
    options: dict[str, Any],
    start_timeout: float,
) -> None:
    """Start the engines as tasks of a task group on ``stack``; wait until they are live."""
    options.setdefault("grace_period", 1.0)
    tg = await stack.enter_async_context(anyio.create_task_group())
    # Registered after the task group: runs first on exit, so that the engines are
    # stopped (their scope cancelled) before the task group waits for them.
    stack.callback(tg.cancel_scope.cancel)
    for engine_id in ids:
        tg.start_soon(partial(serve, make(), connect=bound, engine_id=engine_id, **options))
    with anyio.fail_after(start_timeout + 1):
        try:
            await client.wait_for_engines(len(ids), timeout=start_timeout)
        except EnginesUnavailableError as exc:
            raise EngineStartError(str(exc)) from exc


def _default_address(isolation: Isolation, stack: contextlib.AsyncExitStack) -> str:
    """An ipc:// socket in a private temporary directory for processes, else loopback tcp."""
    if isolation != "process" or sys.platform == "win32":
        return "tcp://127.0.0.1:0"
    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tensorrpc-engines-"))
    return f"ipc://{workdir}/client.sock"


# --------------------------------------------------------------------------- pytest plugin


class EnginesFactory(Protocol):
    """The ``tensorrpc_engines`` fixture: starts engines, returns a connected client.

    It takes the arguments of [`serve_engines`][tensorrpc.testing.serve_engines]; what it
    starts is stopped (and reaped) when the test ends.
    """

    async def __call__(
        self,
        service: type[S],
        count: int = 1,
        *,
        factory: Callable[[], object] | None = None,
        isolation: Isolation = "task",
        engine_ids: Sequence[str] | None = None,
        engine_options: Mapping[str, Any] | None = None,
        client_options: Mapping[str, Any] | None = None,
        address: str | None = None,
        start_timeout: float = START_TIMEOUT,
        stop_timeout: float = STOP_TIMEOUT,
    ) -> Client[S]: ...


#: Part of trio's error when a coroutine awaits something only asyncio understands.
_TRIO_FOREIGN_AWAIT = "unrecognized yield message"
#: What the plugin adds to a failure that has trio's error in it.
ASYNCIO_ON_TRIO = (
    "trio's 'unrecognized yield message' means that code running on the trio backend "
    "awaited an asyncio-only API (asyncio.sleep, asyncio.Queue, asyncio.wait_for, an "
    "asyncio Future, a library built on asyncio). With isolation='task' (the default), "
    "engines run on the test's own event loop, so their handlers do too. Either write the "
    "handlers with anyio (anyio.sleep, anyio.create_memory_object_stream, "
    "anyio.fail_after), which runs on both backends; or run these tests on asyncio only "
    "(a fixture named anyio_backend that returns 'asyncio'); or start the engines with "
    "isolation='process' (each in a process of its own, on asyncio)."
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Say what to do when a test failed on trio because of asyncio-only code."""
    report = yield
    if report.failed and _TRIO_FOREIGN_AWAIT in str(report.longrepr):
        longrepr = report.longrepr
        if hasattr(longrepr, "addsection"):
            longrepr.addsection("tensorrpc: asyncio code on the trio backend", ASYNCIO_ON_TRIO)
        else:
            report.sections.append(("tensorrpc: asyncio code on trio", ASYNCIO_ON_TRIO))
    return report


@pytest.fixture
def tensorrpc_service() -> type[Any]:
    """The ``@service`` class ``tensorrpc_client`` serves: override it in your tests."""
    raise pytest.UsageError(
        "tensorrpc_client needs the service: define a fixture named tensorrpc_service "
        "that returns your @service class (in the test module or a conftest.py)"
    )


@pytest.fixture
def tensorrpc_factory() -> Callable[[], object] | None:
    """Makes each engine's instance for ``tensorrpc_client`` (default: the class itself)."""
    return None


@pytest.fixture
def tensorrpc_engine_count() -> int:
    """How many engines ``tensorrpc_client`` starts (default 1)."""
    return 1


@pytest.fixture
def tensorrpc_isolation() -> Isolation:
    """Where ``tensorrpc_client``'s engines run: ``"task"`` (default) or ``"process"``."""
    return "task"


@pytest.fixture
async def tensorrpc_client(
    anyio_backend: object,
    tensorrpc_service: type[Any],
    tensorrpc_factory: Callable[[], object] | None,
    tensorrpc_engine_count: int,
    tensorrpc_isolation: Isolation,
) -> AsyncIterator[Client[Any]]:
    """A client connected to ``tensorrpc_engine_count`` engines of ``tensorrpc_service``."""
    async with serve_engines(
        tensorrpc_service,
        tensorrpc_engine_count,
        factory=tensorrpc_factory,
        isolation=tensorrpc_isolation,
    ) as client:
        yield client


@pytest.fixture
async def tensorrpc_engines(anyio_backend: object) -> AsyncIterator[EnginesFactory]:
    """A factory: ``client = await tensorrpc_engines(Service, count=2)``; stopped at the end."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(service: type[S], count: int = 1, **kwargs: Any) -> Client[S]:
            return await stack.enter_async_context(serve_engines(service, count, **kwargs))

        yield start
