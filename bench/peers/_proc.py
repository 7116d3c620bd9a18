"""Server peers in their own processes: started, awaited until ready, always reaped.

A peer is ``python -m bench.peers.<name> ...``. It prints one line ``READY <info>`` on
stdout once it serves, and shuts down cleanly when its stdin reaches end of file. Closing
stdin is therefore the polite stop; SIGTERM and then SIGKILL follow after bounded waits,
so no child outlives the benchmark, even one that hangs. If the benchmark process itself
dies, the pipe closes and the peers stop on their own.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[2]


class PeerError(RuntimeError):
    """A peer process failed to start or died; the message carries its stderr tail."""


def child_env() -> dict[str, str]:
    """The environment for peer processes: ours, with the repository on ``PYTHONPATH``."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    return env


def stderr_tail(path: str, limit: int = 1500) -> str:
    """The last ``limit`` characters of a log file, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


class PeerProcess:
    """One peer process, used as a context manager.

    Args:
        module: the peer module, e.g. ``"bench.peers.zmq_peer"``.
        args: its command-line arguments.
        ready_timeout: seconds to wait for the ``READY`` line.
        stop_timeout: seconds to wait after closing stdin before SIGTERM (then SIGKILL).
    """

    def __init__(
        self,
        module: str,
        args: list[str],
        *,
        ready_timeout: float = 60.0,
        stop_timeout: float = 15.0,
    ) -> None:
        self.module = module
        self.args = args
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_info = ""
        self.stderr_text = ""
        fd, self.log_path = tempfile.mkstemp(prefix="trpc-bench-peer-", suffix=".log")
        os.close(fd)

    def __enter__(self) -> PeerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> str:
        """Start the process and wait for its ``READY`` line; return what follows it."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
                env=child_env(),
            )
        try:
            self.ready_info = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.ready_info

    def _wait_ready(self) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.ready_timeout
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"{self.module}: not ready after {self.ready_timeout:.0f}s")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    self.proc.wait(timeout=5)
                    raise PeerError(
                        f"{self.module} exited with {self.proc.returncode} before READY: "
                        f"{stderr_tail(self.log_path)}"
                    )
                buf += chunk
        line = buf.split(b"\n", 1)[0].decode()
        if not line.startswith("READY"):
            raise PeerError(f"{self.module}: unexpected first line {line!r}")
        return line[len("READY") :].strip()

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """Stop and reap the process (stdin EOF, then SIGTERM, then SIGKILL)."""
        proc = self.proc
        if proc is None:
            return None
        try:
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
            self.stderr_text = stderr_tail(self.log_path)
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
        return proc.returncode

    def failure(self) -> str:
        """Why the process died, for an ``unavailable`` entry."""
        code = self.proc.poll() if self.proc is not None else None
        text = stderr_tail(self.log_path) or self.stderr_text
        return f"{self.module} exited with {code}: {text}"
