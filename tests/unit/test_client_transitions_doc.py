"""docs/protocol.md §13 holds the client's transition table; it must equal the code's."""

from __future__ import annotations

from pathlib import Path

from tensorrpc._client_protocol import TRANSITIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
START = "<!-- transitions: client -->"
END = "<!-- /transitions -->"


def table_in_page(text: str) -> list[tuple[str, ...]]:
    """The rows of the table between the client-transitions markers."""
    section = text[text.index(START) + len(START) : text.index(END, text.index(START))]
    rows = [line for line in section.strip().splitlines() if line.startswith("|")]
    header, rule, *body = rows
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "state",
        "input",
        "action",
        "next state",
    ]
    assert set(rule) <= set("|-: ")
    return [tuple(cell.strip() for cell in row.strip().strip("|").split(" | ")) for row in body]


def test_page_and_code_have_the_same_client_transitions() -> None:
    assert table_in_page(PAGE.read_text(encoding="utf-8")) == list(TRANSITIONS)


def test_the_comparison_sees_a_changed_row() -> None:
    text = PAGE.read_text(encoding="utf-8").replace("| PING n | PONG n |", "| PING n | nothing |")
    assert table_in_page(text) != list(TRANSITIONS)


def test_every_state_of_the_table_is_reachable_and_described() -> None:
    states = {row[0] for row in TRANSITIONS} | {row[3] for row in TRANSITIONS}
    assert states == {"none", "dialing", "live"}
    assert all(all(cell and "|" not in cell for cell in row) for row in TRANSITIONS)
