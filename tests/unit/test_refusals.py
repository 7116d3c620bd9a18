"""Refusals fail fast and say what differs (issue 14): the pure parts, and a fake engine."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from tensorrpc._client import Client
from tensorrpc._engines import EngineInfo, check_hello, schema_diff, unavailable_message
from tensorrpc._exceptions import EnginesUnavailableError
from tensorrpc._protocol import Reject, Welcome
from tensorrpc._service import describe
from tests.integration.fake_engine import FakeEngine
from tests.integration.services import Calculator, CalculatorV2

OURS = {
    "add": "add(a: int, b: int = 1) -> int",
    "mul": "mul(a: int, b: int) -> int",
    "gone": "gone() -> None",
}


def info(methods: tuple[str, ...], signatures: tuple[str, ...] = ()) -> EngineInfo:
    return EngineInfo(
        engine_id="e1",
        service="Calc",
        fingerprint="theirs",
        protocol_version=1,
        host_id="h",
        pid=1,
        methods=methods,
        signatures=signatures,
    )


def test_schema_diff_names_added_removed_and_changed_methods() -> None:
    theirs = info(
        ("add", "mul", "new"),
        ("add(a: int, b: int = 2) -> int", "mul(a: int, b: int) -> int", "new(x: str) -> str"),
    )
    text = schema_diff(OURS, theirs)
    assert "engine adds: `new(x: str) -> str`" in text
    assert "engine lacks: `gone() -> None`" in text
    assert (
        "changed: add: engine `add(a: int, b: int = 2) -> int`, client "
        "`add(a: int, b: int = 1) -> int`" in text
    )
    assert "mul" not in text


def test_schema_diff_without_signatures_compares_names() -> None:
    assert schema_diff(OURS, info(("add", "mul", "gone"))) == (
        "the engine does not announce its signatures; the method names are the same"
    )
    assert (
        schema_diff(OURS, info(("add", "x")))
        == "engine adds: x; engine lacks: `mul(a: int, b: int) -> int`, `gone() -> None`"
    )
    same = info(tuple(OURS), tuple(OURS.values()))
    assert "types they name" in schema_diff(OURS, same)


def test_schema_diff_is_bounded() -> None:
    many = tuple(f"m{i}" for i in range(1000))
    text = schema_diff(OURS, info(many))
    assert "and 992 more" in text
    assert len(text) < 1000


def test_a_fingerprint_refusal_carries_the_diff() -> None:
    refusal = check_hello(
        info(("add",), ("add(a: str) -> str",)),
        service="Calc",
        fingerprint="ours",
        protocol_version=1,
        signatures=OURS,
    )
    assert refusal is not None
    assert refusal[0] == "fingerprint"
    assert "changed: add: engine `add(a: str) -> str`" in refusal[1]


def test_unavailable_message_says_whether_everyone_was_refused() -> None:
    refused = {"e1": "fingerprint: differs"}
    assert unavailable_message(0, 2, 5.0, refused) == (
        "0 of 2 engines live: every engine that tried to join was refused; "
        "refused: e1: fingerprint: differs"
    )
    assert unavailable_message(1, 2, 5.0, refused).startswith("1 of 2 engines live after 5.0 s")
    assert unavailable_message(0, 1, 5.0, {}) == "0 of 1 engines live after 5.0 s"


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


async def test_without_a_timeout_refusals_are_logged_and_the_wait_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tensorrpc")
    async with make_client(tmp_path) as client:
        async with FakeEngine(client.addresses[0], "old", service=CalculatorV2) as old:
            assert isinstance(await old.join(), Reject)
        assert any("refused engine 'old'" in r.getMessage() for r in caplog.records)
        with anyio.move_on_after(1.0) as scope:  # well past the 0.5 s grace
            await client.wait_for_engines(1, timeout=None)
        assert scope.cancelled_caught, "a wait without a timeout must not give up"
    assert describe(Calculator).name == describe(CalculatorV2).name
