"""An impostor holding an engine's id at a binding client (issue 21 item 5).

Without CURVE, ids are first come: the client refuses the real engine as ``duplicate_id``
while the impostor is there. The real engine does not give up: it logs why, says HELLO
again with a growing delay, and takes its id once the impostor is gone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from tensorrpc import Observer
from tensorrpc._client import Client
from tensorrpc._protocol import Welcome
from tensorrpc._server import Server

from .fake_engine import FakeEngine
from .services import Calculator


class _Refused(logging.Handler):
    """Sets `refused` when the client logs its refusal of e1 (on its loop)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.refused = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("refused engine 'e1'"):
            self.refused.set()


class _Rejoined(Observer):
    """Sets `rejoined` when ``engine`` joins a second time."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.joins = 0
        self.rejoined = anyio.Event()

    def engine_event(self, client: str, engine: str, event: str) -> None:
        if engine == self.engine and event != "lost":
            self.joins += 1
            if self.joins == 2:
                self.rejoined.set()


async def test_the_real_engine_outlasts_an_impostor_of_its_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tensorrpc")
    address = f"ipc://{tmp_path}/c.sock"
    watch = _Rejoined("e1")
    refusals = _Refused()
    logging.getLogger("tensorrpc.client").addHandler(refusals)
    try:
        await _squat(address, watch, refusals)
    finally:
        logging.getLogger("tensorrpc.client").removeHandler(refusals)
    engine_log = [r.getMessage() for r in caplog.records if r.name == "tensorrpc.server"]
    assert any("duplicate_id" in line and "HELLO again in" in line for line in engine_log)


async def _squat(address: str, watch: _Rejoined, refusals: _Refused) -> None:
    async with (
        Client(Calculator, bind=address, observer=watch) as client,
        FakeEngine(address, "e1") as impostor,
    ):
        assert isinstance(await impostor.join(), Welcome)
        async with Server(
            Calculator("real"), connect=address, engine_id="e1", heartbeat_interval=0.2
        ):
            with anyio.fail_after(30):
                await refusals.refused.wait()  # the real engine was refused as a duplicate
            await impostor.bye()
            with anyio.fail_after(30):
                await watch.rejoined.wait()
                assert await client.stub().whoami() == "real"
