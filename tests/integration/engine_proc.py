"""Engine processes for the client integration tests.

Run as ``python -m tests.integration.engine_proc --engine-id e1 --connect ADDR`` (or
``--bind ADDR``); :class:`EngineProcess` starts one from a test, and always reaps it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Exit status of an engine whose serve() raised (e.g. refused by every client).
EXIT_REFUSED = 3


class EngineProcess:
    """One engine in a subprocess; a context manager that kills and reaps it on exit.

    Args:
        engine_id: The engine's id.
        connect: Client addresses to dial (engines-dial-in topology).
        bind: Address to listen on (client-dials-engine topology); with an ephemeral tcp
            port, read the real one from :meth:`address`.
        service: ``"v1"`` (``Calculator``) or ``"v2"`` (same name, other fingerprint).
        workdir: Directory for the address file and the log.
    """

    def __init__(
        self,
        engine_id: str,
        *,
        workdir: Path,
        connect: tuple[str, ...] = (),
        bind: str | None = None,
        service: str = "v1",
        backend: str = "asyncio",
    ) -> None:
        self.engine_id = engine_id
        self.workdir = workdir
        self.address_file = workdir / f"{engine_id}-{os.urandom(4).hex()}.addr"
        self.log_path = self.address_file.with_suffix(".log")
        args = [sys.executable, "-m", "tests.integration.engine_proc", "--engine-id", engine_id]
        for address in connect:
            args += ["--connect", address]
        if bind is not None:
            args += ["--bind", bind, "--address-file", str(self.address_file)]
        args += ["--service", service, "--backend", backend]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def address(self, timeout: float = 30.0) -> str:
        """The address a ``bind=`` engine listens on (waits until it has bound)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                text = self.address_file.read_text()
                if text.endswith("\n"):
                    return text.strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.engine_id} exited early:\n{self.output()}")
            time.sleep(0.02)
        raise TimeoutError(f"engine {self.engine_id} did not bind within {timeout} s")

    def output(self) -> str:
        """Everything the engine printed so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """Wait (bounded) for the engine to exit; its exit status."""
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """``kill -9`` the engine and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time; reaped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self._log.close()


ENGINE_DEAD_AFTER = 3.0


async def _serve(args: argparse.Namespace) -> None:
    import anyio

    from tensorrpc._server import Server
    from tests.integration.services import Calculator, CalculatorV2

    handler: object = Calculator(args.engine_id) if args.service == "v1" else CalculatorV2()
    server = Server(
        handler,
        engine_id=args.engine_id,
        connect=args.connect or None,
        bind=args.bind,
        heartbeat_interval=0.1,
        # How long the engine waits before forgetting a silent client. Generous, so that a
        # client starved of CPU on a loaded 2-core machine is not forgotten mid-test.
        dead_after=ENGINE_DEAD_AFTER,
        grace_period=0.5,
    )
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        async with server:
            if args.address_file:
                assert server.endpoint is not None
                _write_address(args.address_file, server.endpoint)
            await server.serve_forever()
        tg.cancel_scope.cancel()


def _write_address(path: str, address: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(address + "\n")
    tmp.rename(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--connect", action="append", default=[])
    parser.add_argument("--bind")
    parser.add_argument("--address-file")
    parser.add_argument("--service", choices=("v1", "v2"), default="v1")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[{args.engine_id}] %(name)s %(message)s")
    import anyio

    try:
        anyio.run(_serve, args, backend=args.backend)
    except Exception as exc:
        leaves = exc.exceptions if isinstance(exc, ExceptionGroup) else (exc,)
        for leaf in leaves:
            print(f"engine {args.engine_id} stopped: {type(leaf).__name__}: {leaf}", flush=True)
        sys.exit(EXIT_REFUSED)


if __name__ == "__main__":
    main()
