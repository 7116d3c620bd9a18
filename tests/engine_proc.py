"""Engine processes for the tests: the one launcher of every real engine subprocess.

Run as ``python -m tests.engine_proc --engine-id e1 --connect ADDR`` (or ``--bind ADDR
--address-file F``); `EngineProcess` starts one from a test and always reaps it. It is
its own program, forked by ``tests/_forkserver.py``: it shares nothing with the test
process but the socket address. ``--service`` picks what it serves: ``v1``
(`tests.integration.services.Calculator`), ``v2`` (same name, another fingerprint) or
``tensor`` (`tests.transports._engine.TensorService`, for the transport tests, with
``--no-torch-shm`` to offer frames only) or ``streams`` (`tests.integration.services.Streams`).
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
from typing import Any

from tests import _forkserver

ROOT = Path(__file__).resolve().parents[1]
#: Exit status of an engine whose serve() raised (e.g. refused by every client).
EXIT_REFUSED = 3


class EngineProcess:
    """One engine in a subprocess; a context manager that kills and reaps it on exit.

    Args:
        engine_id: The engine's id.
        connect: Client addresses to dial (engines-dial-in topology).
        bind: Address to listen on (client-dials-engine topology); with an ephemeral tcp
            port, read the real one from `address`.
        service: ``"v1"`` (``Calculator``), ``"v2"`` (same name, other fingerprint) or
            ``"tensor"`` (``TensorService``).
        workdir: Directory for the address file and the log.
        backend: The engine's anyio backend.
        torch_shm: Offer ``torch_shm`` (``tensor`` engines).
        dead_after: Seconds of client silence before the engine forgets it (``v1``/``v2``).
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
        torch_shm: bool = True,
        dead_after: float | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.workdir = workdir
        self.address_file = workdir / f"{engine_id}-{os.urandom(4).hex()}.addr"
        self.log_path = self.address_file.with_suffix(".log")
        args = [sys.executable, "-m", "tests.engine_proc", "--engine-id", engine_id]
        for address in connect:
            args += ["--connect", address]
        if bind is not None:
            args += ["--bind", bind, "--address-file", str(self.address_file)]
        args += ["--service", service, "--backend", backend]
        if not torch_shm:
            args.append("--no-torch-shm")
        if dead_after is not None:
            args += ["--dead-after", str(dead_after)]
        self._log = self.log_path.open("wb")
        # Forked from a pre-imported interpreter (tests/_forkserver.py): its own process,
        # without the seconds of torch's import; Popen's interface.
        self.proc = _forkserver.popen(
            args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def address(self, timeout: float = 60.0) -> str:
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
        raise TimeoutError(
            f"engine {self.engine_id} did not bind within {timeout} s:\n{self.output()}"
        )

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
        self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time; reaped.

        Returns:
            The exit status (negative: it had to be killed).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self._log.close()


#: How long an engine waits before forgetting a silent client. Generous, so that a client
#: starved of CPU on a loaded 2-core machine is not forgotten mid-test.
ENGINE_DEAD_AFTER = 3.0


def _server(args: argparse.Namespace) -> Any:
    from tensorrpc._server import Server

    if args.service == "tensor":
        from tests.transports import _engine

        server = Server(
            _engine.TensorService(),
            engine_id=args.engine_id,
            connect=args.connect or None,
            bind=args.bind,
            heartbeat_interval=0.2,
            dead_after=2.0,
            grace_period=1.0,
            torch_shm=not args.no_torch_shm,
        )
        _engine.SERVER = server  # its handlers report the transport statistics
        return server
    from tests.integration.services import Calculator, CalculatorV2, Streams

    handler: object = (
        Calculator(args.engine_id)
        if args.service == "v1"
        else Streams()
        if args.service == "streams"
        else CalculatorV2()
    )
    return Server(
        handler,
        engine_id=args.engine_id,
        connect=args.connect or None,
        bind=args.bind,
        heartbeat_interval=0.1,
        dead_after=args.dead_after,
        grace_period=0.5,
    )


async def _serve(args: argparse.Namespace) -> None:
    import anyio

    server = _server(args)
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
    parser.add_argument("--service", choices=("v1", "v2", "tensor", "streams"), default="v1")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--no-torch-shm", action="store_true")
    parser.add_argument("--dead-after", type=float, default=ENGINE_DEAD_AFTER)
    args = parser.parse_args()
    level = logging.WARNING if args.service == "tensor" else logging.INFO
    logging.basicConfig(level=level, format=f"[{args.engine_id}] %(name)s %(message)s")
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
