"""Refusals fail fast and say what differs (issue 14), through a real client and engine.

The pure parts (the schema diff, the messages, the once-per-key memory):
tests/unit/test_refusals.py.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import anyio
import pytest

from tensorrpc._client import Client
from tensorrpc._exceptions import EnginesUnavailableError
from tensorrpc._protocol import Reject, Welcome
from tensorrpc._server import serve
from tensorrpc._service import describe
from tests.integration.fake_engine import FakeEngine
from tests.integration.services import Calculator, CalculatorV2


def make_client(tmp_path: Path) -> Client[Calculator]:
    return Client(Calculator, bind=f"ipc://{tmp_path}/client.sock")


async def test_a_refused_engine_ends_the_wait_at_once(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client:
        async with anyio.create_task_group() as tg:
            failure: list[BaseException] = []
            failed = anyio.Event()

            async def wait() -> None:
                try:
                    await client.wait_for_engines(1, timeout=600)
                except EnginesUnavailableError as exc:
                    failure.append(exc)
                failed.set()

            tg.start_soon(wait)
            async with FakeEngine(client.addresses[0], "old", service=CalculatorV2) as engine:
                assert isinstance(await engine.join(), Reject)
            with anyio.fail_after(30):  # far below the wait's own timeout of 600 s
                await failed.wait()
        text = str(failure[0])
        assert "every engine that tried to join was refused" in text
        assert "engine lacks: `mul(a: int, b: int) -> int`" in text
        # a wait that starts after the refusal fails fast too
        with anyio.fail_after(30), pytest.raises(EnginesUnavailableError, match="refused"):
            await client.wait_for_engines(1, timeout=600)


async def test_a_good_engine_within_the_grace_wins(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client:
        async with FakeEngine(client.addresses[0], "old", service=CalculatorV2) as old:
            assert isinstance(await old.join(), Reject)
        async with FakeEngine(client.addresses[0], "new") as new:
            assert isinstance(await new.join(), Welcome)
            with anyio.fail_after(30):
                engines = await client.wait_for_engines(1, timeout=600)
            assert list(engines) == ["new"]


async def test_without_a_timeout_a_refusal_ends_the_wait_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 24 item 3: the default wait_for_engines(n) hung forever on a schema mismatch
    # while the refusal was logged every second, hashes first.
    caplog.set_level(logging.DEBUG, logger="tensorrpc")
    async with make_client(tmp_path) as client:
        for _ in range(3):  # the same engine retries its handshake: one warning
            async with FakeEngine(client.addresses[0], "old", service=CalculatorV2) as old:
                assert isinstance(await old.join(), Reject)
        with anyio.fail_after(30), pytest.raises(EnginesUnavailableError, match="refused"):
            await client.wait_for_engines(1)  # timeout=None
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "refused engine 'old'" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert line.startswith("refused engine 'old': engine 'old' has a different schema: ")
    assert line.index("engine lacks:") < line.index("(fingerprint ")
    assert not re.search(r"[0-9a-f]{13}", line), "fingerprints are shortened"
    assert any(
        r.levelno == logging.DEBUG and "refused again" in r.getMessage() for r in caplog.records
    )
    assert describe(Calculator).name == describe(CalculatorV2).name


async def test_an_engine_logs_a_repeated_refusal_once_with_a_printable_client(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Listen mode: the engine forgets the refused session after its dead_after (short
    # here), the client asks for HELLO again and refuses each answer.
    caplog.set_level(logging.DEBUG, logger="tensorrpc")
    address = f"ipc://{tmp_path}/engine.sock"
    thrice = anyio.Event()
    seen: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:  # runs on the loop's thread
            if "refused" in record.getMessage():
                seen.append(record.getMessage())
                if len(seen) >= 3:
                    thrice.set()

    handler = Count()
    logging.getLogger("tensorrpc.server").addHandler(handler)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(
                lambda task_status: serve(
                    CalculatorV2(),
                    bind=address,
                    heartbeat_interval=0.05,
                    dead_after=0.5,
                    task_status=task_status,
                )
            )
            async with Client(Calculator, connect=address, heartbeat_interval=0.05):
                with anyio.fail_after(60):
                    await thrice.wait()
            tg.cancel_scope.cancel()
    finally:
        logging.getLogger("tensorrpc.server").removeHandler(handler)
    engine_lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tensorrpc.server" and "refused" in r.getMessage()
    ]
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tensorrpc.server"
        and r.levelno == logging.WARNING
        and "refused" in r.getMessage()
    ]
    assert len(engine_lines) >= 3
    assert len(warned) == 1, warned
    assert "b'" not in warned[0], "the client's routing id is printable"
    assert "\\x" not in warned[0]
    assert re.match(r"client [0-9a-f]+ refused engine ", warned[0]), warned[0]
