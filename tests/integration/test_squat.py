"""An impostor holding an engine's id at a binding client (issue 21 item 5).

Without CURVE, ids are first come: the client refuses the real engine as ``duplicate_id``
while the impostor is there. The real engine does not give up: it logs why, says HELLO
again with a growing delay, and takes its id once the impostor is gone. With CURVE and
``engine_keys=``, an id is taken only with the key bound to it: the squat is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from tensorrpc import Observer
from tensorrpc._client import Client
from tensorrpc._exceptions import HandshakeRejectedError
from tensorrpc._protocol import Welcome
from tensorrpc._security import CurveClientConfig, CurveServerConfig, generate_keypair
from tensorrpc._server import Server, serve

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


async def test_with_engine_keys_a_squat_is_refused_and_the_real_engine_joins() -> None:
    client_keys, real_keys, impostor_keys = (generate_keypair() for _ in range(3))
    curve = CurveServerConfig(
        client_keys, allowed_clients=[real_keys.public_key, impostor_keys.public_key]
    )
    async with Client(
        Calculator,
        bind="tcp://127.0.0.1:0",
        curve=curve,
        engine_keys={"e1": real_keys.public_key},
    ) as client:
        (address,) = client.addresses
        with anyio.fail_after(30):
            # An allowed engine that claims another's id is refused, and stops (final).
            impostor = CurveClientConfig(impostor_keys, client_keys.public_key)
            with pytest.raises(HandshakeRejectedError, match="bound to another CURVE key"):
                await serve(Calculator("impostor"), connect=address, engine_id="e1", curve=impostor)
            with pytest.raises(HandshakeRejectedError, match="not bound to a key"):
                await serve(Calculator("other"), connect=address, engine_id="e2", curve=impostor)
            real = CurveClientConfig(real_keys, client_keys.public_key)
            async with Server(Calculator("real"), connect=address, engine_id="e1", curve=real):
                await client.wait_for_engines(1)
                assert await client.stub().whoami() == "real"


def test_engine_keys_need_a_curve_server() -> None:
    with pytest.raises(ValueError, match="engine_keys= needs curve=CurveServerConfig"):
        Client(Calculator, bind="ipc:///tmp/x", engine_keys={"e1": generate_keypair().public_key})
    keys = generate_keypair()
    with pytest.raises(ValueError, match=r"engine_keys\['e1'\] must be 40 z85 characters"):
        Client(
            Calculator,
            bind="ipc:///tmp/x",
            curve=CurveServerConfig(keys, allowed_clients=None),
            engine_keys={"e1": "short"},
        )
