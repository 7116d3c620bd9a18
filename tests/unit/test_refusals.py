"""Refusals fail fast and say what differs (issue 14): the pure parts.

The same through a real client and engine: tests/integration/test_refusals.py.
"""

from __future__ import annotations

from tensorrpc._engines import EngineInfo, check_hello, schema_diff, unavailable_message
from tensorrpc._logonce import Said

OURS = {
    "add": "add(a: int, b: int = 1) -> int",
    "mul": "mul(a: int, b: int) -> int",
    "gone": "gone() -> None",
}


def info(methods: tuple[str, ...], signatures: tuple[str, ...] | None = None) -> EngineInfo:
    """An engine's HELLO; without ``signatures``, one whose signatures were cut away."""
    if signatures is None:
        signatures = ("",) * len(methods)
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


def test_schema_diff_with_signatures_cut_away_compares_names() -> None:
    assert schema_diff(OURS, info(("add", "mul", "gone"))) == (
        "the method names are the same; the engine's HELLO cut its signatures"
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


def test_the_same_refusal_is_said_once_per_key_and_the_memory_is_bounded() -> None:
    said = Said(limit=2)
    assert said.first(("e1", "fp-a"))
    assert not said.first(("e1", "fp-a"))
    assert said.first(("e1", "fp-b"))  # another fingerprint: said again
    assert said.first(("e2", "fp-a"))  # forgets the oldest (e1, fp-a)
    assert said.first(("e1", "fp-a"))
