"""Strangers cannot flood the client's log with refusals (issue 9 item 6)."""

from __future__ import annotations

import logging

import pytest

from tensorrpc._client_events import EngineRefused
from tensorrpc._client_io import RefusalLog as _RefusalLog


def refused(i: int) -> EngineRefused:
    engine_id = f"{i}-" + "x" * 1000
    return EngineRefused(engine_id, "fingerprint", f"engine {engine_id!r} differs", by_client=True)


def test_a_flood_of_refusals_logs_a_bounded_burst_and_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = _RefusalLog()
    with caplog.at_level(logging.WARNING, logger="tensorrpc.client"):
        for i in range(10_000):
            log.log(refused(i), 1.0 + i * 1e-4)  # 10,000 refusals in one second
        log.log(refused(10_000), 1.0 + log.WINDOW_S)  # the next window
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == log.BURST + 2
    assert all(len(line) < 1024 for line in lines)  # ids and texts cut short
    assert lines[0].startswith("refused engine '0-xxx")
    assert f"{10_000 - log.BURST} more handshake refusals" in lines[-2]
    assert lines[-1].startswith("refused engine '10000-")


def test_refusals_by_the_engine_are_logged_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tensorrpc.client"):
        _RefusalLog().log(EngineRefused("e1", "not_allowed", "no", by_client=False), 0.0)
    assert [r.getMessage() for r in caplog.records] == [
        "engine e1 refused this client: not_allowed no"
    ]
