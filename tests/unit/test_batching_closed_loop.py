"""The closed-loop model of `bench.batching_model` on the real batcher (fake clock)."""

from __future__ import annotations

import pytest

from bench.batching_model import closed_loop

STEP, CALLERS = 0.005, 64


def test_callers_back_within_max_delay_share_one_batch_within_the_bound() -> None:
    loop = closed_loop(CALLERS, STEP, 0.002, 20e-6)  # turnaround 1.28 ms < 2 ms
    assert loop.mean_batch == CALLERS
    assert loop.median_s <= 0.002 + STEP + 0.001


@pytest.mark.parametrize("c", [20e-6, 40e-6])
def test_a_split_never_heals_while_the_step_outlasts_max_delay(c: float) -> None:
    # One caller late once (or a turnaround above max_delay from the start): its batch
    # is due whenever the other one ends, so two groups take turns for good, and every
    # call waits for the other group's step as well as its own.
    loop = closed_loop(CALLERS, STEP, 0.002, c, late=0.003)
    assert loop.mean_batch == pytest.approx(CALLERS / 2, abs=0.5)
    assert loop.median_s > 0.002 + STEP + 0.001  # the bound is out of reach
    assert loop.median_s == pytest.approx(2 * STEP, rel=0.05)


def test_a_split_heals_when_max_delay_outlasts_the_step() -> None:
    loop = closed_loop(CALLERS, STEP, 0.010, 20e-6, late=0.011)  # it misses its batch
    assert loop.mean_batch == CALLERS
    assert loop.median_s <= 0.010 + STEP + 0.001
