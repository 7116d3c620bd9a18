"""``tensorrpc top`` against a hostile engine (issue 21 item 2).

The engine's id carries rich markup (a hyperlink, styles) and its statistics answers are
malformed (a zero ``latency_buckets_per_octave``, no ``calls``): top draws the id as
plain text, shows the bad answer as that engine's note, and keeps refreshing.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tensorrpc import _observe
from tensorrpc.top import EngineView, check_statistics, table

from .test_top import _stats, top_session

MARKUP_ID = "[link=https:x.example]e1[blink red]!"  # unclosed tags: an id has no "/"
HOSTILE_NOTE = "\x1b[2J\x1b]0;pwned\x07[link=https://x.example/]y[/link]"


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="truecolor", width=200)
    return console, out


def test_engine_strings_are_drawn_as_plain_text() -> None:
    view = EngineView(MARKUP_ID, note=HOSTILE_NOTE)
    console, out = _terminal()
    console.print(table([view], "top"))
    drawn = out.getvalue()
    assert "\x1b]" not in drawn  # no OSC: neither a hyperlink (OSC 8) nor a title (OSC 0)
    assert "\x1b[2J" not in drawn
    assert "\x1b[5m" not in drawn  # no blink from the id's markup
    assert "[link=https:x.example]e1[blink red]!" in drawn
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in drawn


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"latency_buckets_per_octave": 0}, "latency_buckets_per_octave"),
        ({"latency_buckets_per_octave": None}, "latency_buckets_per_octave"),
        ({"batching": None}, "batching"),
        ({"calls": None}, "calls"),
        ({"time": float("nan")}, "time"),
        ({"queued": -1}, "queued"),
        ({"transports": {"frames": {}}}, "transports.frames"),
        ({"methods": {"add": {"latency": [[10**6, 1]]}}}, "bucket index"),
        ({"methods": {"add": {"latency": [["x", 1]]}}}, "bucket index"),
        ({"methods": {"add": []}}, "latency"),
    ],
)
def test_a_malformed_statistics_answer_becomes_the_note(change: dict[str, Any], why: str) -> None:
    view = EngineView("e1")
    view.update(_stats(100.0, 10, 0, 1000, [[40, 10]]))
    bad = {**_stats(101.0, 20, 0, 1000, [[40, 20]]), **change}
    for key in [k for k, v in change.items() if v is None]:
        del bad[key]  # None: the field is missing
    with pytest.raises(ValueError, match=why):
        check_statistics(bad)
    view.update(bad)
    assert view.note.startswith("bad statistics:")
    assert why in view.note
    view.update(_stats(102.0, 30, 0, 1000, [[40, 30]]))  # the next good one is used
    assert view.note == ""
    assert view.rates["calls"] == pytest.approx(10.0)


def test_a_statistics_answer_that_is_not_a_map_becomes_the_note() -> None:
    view = EngineView("e1")
    view.update([1, 2, 3])
    assert view.note == "bad statistics: the answer is not a map"
    assert view.current is None


def _hostile_body(*args: Any, **kwargs: Any) -> dict[str, Any]:
    body = _stats(time.time(), 1, 0, 10, [[40, 1]])
    del body["calls"]
    body["latency_buckets_per_octave"] = 0
    return body


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the engine side; top runs its own loop
async def test_top_in_a_pseudo_terminal_survives_a_hostile_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_observe, "statistics_body", _hostile_body)
    rc, text = await top_session(tmp_path, engine_id=MARKUP_ID)
    assert rc == 0, text[-2000:]
    assert "bad statistics" in text
    assert "[link=https:x.example]e1" in text
    assert "\x1b]8;" not in text  # no hyperlink
    assert "\x1b[5m" not in text  # no blink
