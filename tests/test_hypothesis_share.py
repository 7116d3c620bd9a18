"""The suite's share of hypothesis examples (tests/conftest.py, ``TENSORRPC_HYPOTHESIS``)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from tests import conftest


@settings(max_examples=80)
@given(st.integers())
def test_a_property(n: int) -> None:
    assert isinstance(n, int)


class Counter(RuleBasedStateMachine):
    """A machine of one rule, for its settings."""

    count = 0

    @rule()
    def step(self) -> None:
        self.count += 1
        assert self.count > 0


Counter.TestCase.settings = settings(max_examples=40, stateful_step_count=7)
TestCounter = Counter.TestCase


def share(count: int) -> int:
    return min(count, max(conftest.MIN_EXAMPLES, round(count * conftest.EXAMPLES_SHARE)))


def test_collected_tests_run_their_share() -> None:
    assert test_a_property._hypothesis_internal_use_settings.max_examples == share(80)  # type: ignore[attr-defined]
    machine = TestCounter.settings
    assert machine.max_examples == share(40)
    assert machine.stateful_step_count == 7  # as deep as written


def test_the_share_never_adds_examples() -> None:
    assert conftest.scaled(settings(max_examples=3), 0.25).max_examples == 3
    assert conftest.scaled(settings(max_examples=12), 0.25).max_examples == conftest.MIN_EXAMPLES
    assert conftest.scaled(settings(max_examples=400), 0.25).max_examples == 100
    assert conftest.scaled(settings(max_examples=400), 1.0).max_examples == 400


def test_thorough_runs_every_example() -> None:
    assert conftest.examples_share({"TENSORRPC_HYPOTHESIS": "thorough"}) == 1.0
    assert conftest.examples_share({}) == 0.25
    assert conftest.examples_share({"TENSORRPC_HYPOTHESIS": "quick"}) == 0.25
