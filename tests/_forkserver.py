"""Start test programs by forking a pre-imported interpreter (not a test module).

Every test program (an engine, a client, a docs example) used to be a fresh interpreter
that spent seconds of CPU importing torch before doing anything. [`popen`][] starts the
same program as a child of a *zygote*: a long-lived interpreter, started once per set of
interpreter flags (``-X dev -W error`` stays ``-X dev -W error``), that has already
imported torch, numpy, zmq, anyio, trio and tensorrpc, and forks one child per request.
Under pytest-xdist the workers share the controller's zygotes ([`Broker`][], started by
tests/_xdist.py): one start per flags for the whole run, not one per worker.

The child is a real, separate process: its own pid (``kill -9`` works on it), its own
session when asked (``start_new_session=True``; with ``controlling_terminal=True`` its stdin,
a terminal, becomes the session's controlling terminal), the stdin/stdout/stderr the caller gave
(files, pipes, ``/dev/null``; passed over a unix socket), the caller's ``env`` (as
``os.environ``), ``cwd`` and ``sys.path`` built as a fresh interpreter builds it (the
script's directory or the working directory for ``-m``, then ``PYTHONPATH``). It runs the
script or ``-m`` module as ``__main__`` and exits the normal way (``atexit`` handlers,
exit status, a traceback on an uncaught exception). The zygote reaps it and reports the
status; [`Forked`][] is the caller's `subprocess.Popen`-like handle.

What a fork cannot give: a check of what *importing* does in a fresh interpreter (which
modules ``import tensorrpc`` pulls in, warnings at import) is not run here; tests of
those keep using `subprocess` (tests/test_exports.py). Imports the zygote does at start
run under the same flags, so a warning at import time still fails (the zygote does not
start, and `popen` raises with its output).

Run as ``python [flags] -m tests._forkserver`` by [`Zygote`][]; not by hand.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
#: What the zygote imports before it forks anything (the seconds a fresh interpreter spends).
PRELOAD = ("numpy", "torch", "zmq", "anyio", "trio", "tensorrpc", "tensorrpc._server")
#: Bound on the zygote's start (torch's import on a loaded 2-core machine).
START_TIMEOUT_S = 120.0
_MAX_MESSAGE = 1 << 20
_STATUS = struct.Struct("!i")


# -- the caller's side ------------------------------------------------------------------------


class Forked:
    """A program forked by a zygote; the subset of `subprocess.Popen` the tests use."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        conn: socket.socket,
        pidfd: int,
        stdin: IO[Any] | None,
        stdout: IO[Any] | None,
        stderr: IO[Any] | None,
    ) -> None:
        self.args = args
        self.pid = pid
        #: None while running; typed as typeshed types Popen's (``int | Any``).
        self.returncode: int | Any = None
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._conn = conn
        self._pidfd = pidfd
        self._lock = threading.Lock()  # returncode and the pidfd
        self._wait_lock = threading.Lock()  # one reader of the status at a time

    def _receive_status(self, timeout: float | None) -> int | None:
        with self._wait_lock:
            if self.returncode is not None:
                return self.returncode
            self._conn.settimeout(timeout)
            try:
                data = self._conn.recv(_STATUS.size)
            except (TimeoutError, BlockingIOError):
                return None
            if len(data) != _STATUS.size:
                raise RuntimeError(f"the zygote went away before pid {self.pid} was reaped")
            with self._lock:
                self.returncode = os.waitstatus_to_exitcode(_STATUS.unpack(data)[0])
                self._conn.close()
                os.close(self._pidfd)
            return self.returncode

    def poll(self) -> int | None:
        """The exit status if the program has ended (and been reaped), else None."""
        return self._receive_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end of the program; `subprocess.TimeoutExpired` after ``timeout``."""
        code = self._receive_status(timeout)
        if code is None:
            assert timeout is not None
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        """Signal the program (through its pidfd: never a recycled pid); no-op once reaped."""
        with self._lock:
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(
        self, input: bytes | str | None = None, timeout: float | None = None
    ) -> tuple[Any, Any]:
        """Send ``input``, read stdout and stderr pipes to their end, wait for the exit."""
        results: dict[str, Any] = {}

        def drain(name: str, stream: IO[Any]) -> None:
            results[name] = stream.read()
            stream.close()

        readers = [
            threading.Thread(target=drain, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(timeout)
        return results.get("stdout"), results.get("stderr")

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.wait()


class Zygote:
    """One pre-imported interpreter with given flags, forking programs on request."""

    def __init__(self, flags: Sequence[str]) -> None:
        self.flags = tuple(flags)
        self._dir = tempfile.mkdtemp(prefix="tensorrpc-zygote-")
        self.address = os.path.join(self._dir, "sock")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, *self.flags, "-m", "tests._forkserver", self.address],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,  # the lifeline: the zygote ends at its EOF
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        assert self.proc.stdout is not None
        ready = _readline_within(self.proc.stdout, START_TIMEOUT_S)
        if ready != b"ready\n":
            self._log.seek(0)
            log = self._log.read().decode(errors="replace")
            self.close()
            raise RuntimeError(f"the zygote {self.flags} did not start:\n{log}")

    def popen(
        self,
        args: list[str],
        script: tuple[str, str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        start_new_session: bool = False,
        controlling_terminal: bool = False,
        text: bool = False,
    ) -> Forked:
        """Fork ``script`` (``("path", file)`` or ``("module", name)``) with ``args[1:]``."""
        ours: dict[str, IO[Any] | None] = {"stdin": None, "stdout": None, "stderr": None}
        theirs: list[int] = []
        to_close: list[int] = []
        for number, (name, spec) in enumerate(
            (("stdin", stdin), ("stdout", stdout), ("stderr", stderr))
        ):
            if spec is None:
                theirs.append(number)
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                to_close.append(fd)
                theirs.append(fd)
            elif spec == subprocess.STDOUT:
                assert name == "stderr"
                theirs.append(theirs[1])
            elif spec == subprocess.PIPE:
                read_end, write_end = os.pipe()
                mine, child = (write_end, read_end) if name == "stdin" else (read_end, write_end)
                to_close.append(child)
                theirs.append(child)
                mode = "w" if name == "stdin" else "r"
                if text:
                    ours[name] = open(mine, mode, encoding="utf-8")  # noqa: SIM115
                else:
                    ours[name] = open(mine, mode + "b", buffering=0 if name == "stdin" else -1)  # noqa: SIM115
            elif isinstance(spec, int):
                theirs.append(spec)
            else:
                theirs.append(spec.fileno())
        request = {
            "kind": script[0],
            "target": script[1],
            "argv": args[1:],
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": dict(os.environ if env is None else env),
            "new_session": start_new_session,
            "controlling_terminal": controlling_terminal,
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(START_TIMEOUT_S)
            conn.connect(self.address)
            socket.send_fds(conn, [json.dumps(request).encode()], theirs)
            data, fds, _flags, _addr = socket.recv_fds(conn, 64, 1)
        except BaseException:
            conn.close()
            raise
        finally:
            for fd in to_close:
                os.close(fd)
        if not data or len(fds) != 1:
            conn.close()
            raise RuntimeError(f"the zygote did not fork {args}")
        return Forked(args, int(data), conn, fds[0], ours["stdin"], ours["stdout"], ours["stderr"])

    def close(self) -> None:
        """End the zygote (its children run on: they are the callers' to reap)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        os.rmdir(self._dir)


def _readline_within(stream: IO[bytes], timeout: float) -> bytes:
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(timeout):
            return b""
    return stream.readline()


class SharedZygote(Zygote):
    """A zygote that another process of this test run started (see [`Broker`][])."""

    def __init__(self, flags: Sequence[str], address: str) -> None:
        self.flags = tuple(flags)
        self.address = address

    def close(self) -> None:
        """Nothing to end: the zygote is its starter's."""


#: Set (to a `Broker`'s socket) in the processes that share zygotes: pytest-xdist's
#: workers ask the controller's broker instead of each starting zygotes of their own.
BROKER_ENV = "TENSORRPC_TEST_ZYGOTE_BROKER"
_STARTED: dict[tuple[str, ...], Zygote] = {}  # by this process
_SHARED: dict[tuple[str, ...], SharedZygote] = {}  # by a broker's process
_STARTED_LOCK = threading.Lock()
_SHARED_LOCK = threading.Lock()


def zygote(flags: Sequence[str] = ()) -> Zygote:
    """The session's zygote for these interpreter flags, started on first use.

    Where [`BROKER_ENV`][] names a broker, the broker's process starts it (once for
    every process that asks).
    """
    key = tuple(flags)
    broker = os.environ.get(BROKER_ENV)
    if not broker:
        return _start(key)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = SharedZygote(key, _ask_broker(broker, key))
        return _SHARED[key]


def _start(key: tuple[str, ...]) -> Zygote:
    with _STARTED_LOCK:
        if key not in _STARTED:
            if not _STARTED:
                atexit.register(close_all)
            _STARTED[key] = Zygote(key)
        return _STARTED[key]


def close_all() -> None:
    """End every zygote this process started."""
    with _STARTED_LOCK:
        while _STARTED:
            _STARTED.popitem()[1].close()


class Broker:
    """Starts zygotes for other processes of a test run, which fork programs from them.

    pytest-xdist's workers each run part of the suite; started by the controller, they
    find its broker through [`BROKER_ENV`][] and ask it for the zygote of their flags: one
    zygote per flags for the whole run (each start is seconds of CPU), ended with the
    controller (`close`).
    """

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="tensorrpc-broker-")
        self.address = os.path.join(self._dir, "sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self.address)
        self._listener.listen(16)
        self._thread = threading.Thread(target=self._serve, name="zygote-broker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                flags = json.loads(conn.recv(_MAX_MESSAGE))
                reply = {"address": _start(tuple(flags)).address}
            except Exception as exc:  # the asker raises it; the broker keeps serving
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(OSError):
                conn.send(json.dumps(reply).encode())

    def close(self) -> None:
        """Stop answering and end the zygotes started for the askers."""
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(10)
        close_all()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        os.rmdir(self._dir)


def _ask_broker(address: str, flags: tuple[str, ...]) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(START_TIMEOUT_S)
        conn.connect(address)
        conn.send(json.dumps(list(flags)).encode())
        reply = json.loads(conn.recv(_MAX_MESSAGE) or b"{}")
    if "address" not in reply:
        raise RuntimeError(f"the zygote {flags} did not start: {reply.get('error', 'no answer')}")
    return str(reply["address"])


def parse_args(args: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, str]]:
    """Split ``[python, flags..., script | -m module, ...]`` into flags and what to run.

    Raises:
        ValueError: An option this launcher does not reproduce (``-c``, ``-u``, ...).
    """
    if not args or args[0] != sys.executable:
        raise ValueError(f"not this interpreter: {args[:1]}")
    flags: list[str] = []
    i = 1
    while i < len(args):
        arg = args[i]
        if arg in ("-X", "-W"):
            flags += args[i : i + 2]
            i += 2
        elif arg == "-m":
            return tuple(flags), ("module", args[i + 1])
        elif arg.startswith("-"):
            raise ValueError(f"option {arg!r} is not supported by the zygote")
        else:
            return tuple(flags), ("path", arg)
    raise ValueError(f"nothing to run in {args}")


def popen(args: Sequence[str], **kwargs: Any) -> Forked:
    """`subprocess.Popen` for ``[sys.executable, [-X opt | -W arg]..., script | -m mod, ...]``.

    Keyword arguments: ``cwd``, ``env``, ``stdin``, ``stdout``, ``stderr`` (None, a file,
    a descriptor, `subprocess.PIPE`, `subprocess.DEVNULL`, `subprocess.STDOUT`),
    ``start_new_session``, ``controlling_terminal`` (with a new session: stdin, a terminal,
    becomes its controlling terminal) and ``text``.
    """
    flags, script = parse_args(args)
    argv = list(args)
    argv_tail = argv[argv.index(script[1]) + 1 :]
    return zygote(flags).popen([script[1], *argv_tail], script, **kwargs)


def run(
    args: Sequence[str],
    *,
    timeout: float,
    capture_output: bool = False,
    stdin: Any = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` through [`popen`][]: killed (and reaped) past ``timeout``."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = popen(args, stdin=stdin, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


# -- the zygote's side --------------------------------------------------------------------------


def _serve(address: str) -> dict[str, Any]:
    """Fork a child per request until the lifeline (stdin) closes; in a child, its request."""
    for name in PRELOAD:
        __import__(name)
    base_path = sys.path[1:]  # after the zygote's own directory: no PYTHONPATH was set
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    os.set_blocking(wake_read, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, tuple[socket.socket, int]] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_read, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "lifeline")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            if key.data == "lifeline":
                return {}
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                _reap(children)
                continue
            conn, _ = listener.accept()
            try:
                data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MESSAGE, 3)
                request = json.loads(data)
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                # The child: nothing of the zygote's plumbing stays open.
                sel.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_read, wake_write, listener.detach(), conn.detach()):
                    os.close(fd)
                for other, pidfd in children.values():
                    other.close()
                    os.close(pidfd)
                for number, fd in enumerate(fds):
                    os.dup2(fd, number)
                for fd in set(fds):
                    if fd > 2:
                        os.close(fd)
                request["base_path"] = base_path
                return dict(request)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            with contextlib.suppress(OSError):  # a caller gone: the child is reaped below
                socket.send_fds(conn, [str(pid).encode()], [pidfd])
            children[pid] = (conn, pidfd)


def _reap(children: dict[int, tuple[socket.socket, int]]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in children:
            continue
        conn, pidfd = children.pop(pid)
        os.close(pidfd)
        with contextlib.suppress(OSError):
            conn.send(_STATUS.pack(status))
        conn.close()


def _run(request: dict[str, Any]) -> None:
    """Become the requested program, as ``python [flags] script|-m module args`` would."""
    if request["new_session"]:
        os.setsid()
        if request["controlling_terminal"]:
            import fcntl
            import termios

            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is read again
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by torch at its import, in the zygote
        import torch

        torch.set_num_threads(int(threads))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kind, target = request["kind"], request["target"]
    first = os.path.dirname(os.path.abspath(target)) if kind == "path" else os.getcwd()
    sys.path[:] = [first, *(os.path.abspath(p) for p in python_path), *request["base_path"]]
    # Streams were opened on the zygote's descriptors 0-2, now the child's: drop the
    # text layer's idea of a terminal and start from empty buffers.
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        setattr(sys, name, _reopen(number, getattr(sys, name)))
        setattr(sys, f"__{name}__", getattr(sys, name))
    sys.argv = [target, *request["argv"]]
    try:
        if kind == "module":
            import runpy

            runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # what -m does
        else:
            main = types.ModuleType("__main__")
            main.__file__ = target
            main.__builtins__ = builtins  # type: ignore[attr-defined]
            sys.modules["__main__"] = main
            with open(os.path.abspath(target), "rb") as source:
                code = compile(source.read(), target, "exec")
            exec(code, main.__dict__)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException as exc:  # what the interpreter does with an uncaught exception
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    _exit(status)


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _exit(status: int) -> None:
    """End the way the interpreter does, less the teardown of every module.

    The interpreter waits for non-daemon threads, runs ``atexit`` handlers (which include
    `weakref.finalize` and multiprocessing's cleanup) and flushes the standard streams; then
    it would free every object of torch's import, touching each page the fork shares with
    the zygote (a second of CPU per child for nothing the program can observe).
    """
    threading._shutdown()  # type: ignore[attr-defined]
    try:
        import atexit as _atexit

        _atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    if status == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


def _reopen(number: int, old: IO[str]) -> IO[str]:
    """A fresh text stream on descriptor ``number``, like the interpreter's own at start."""
    mode = "r" if number == 0 else "w"
    raw = io.FileIO(number, mode + "b", closefd=False)
    tty = raw.isatty()
    buffered: io.BufferedIOBase
    buffered = io.BufferedReader(raw) if number == 0 else io.BufferedWriter(raw)
    line_buffering = tty or (number == 2)
    errors = old.errors if isinstance(old, io.TextIOWrapper) else "strict"
    encoding = old.encoding if isinstance(old, io.TextIOWrapper) else "utf-8"
    return io.TextIOWrapper(
        buffered,
        encoding=encoding,
        errors=errors,
        line_buffering=line_buffering,
        write_through=number == 2,
    )


if __name__ == "__main__":
    _request = _serve(sys.argv[1])
    if not _request:
        sys.exit(0)
    _run(_request)
