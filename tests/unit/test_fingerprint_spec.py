"""docs/protocol.md, appendix A, computes the fingerprint the code computes.

The worked example's canonical text is taken from the page (its lines joined), hashed, and
compared with the hash the page states and with what `describe` computes for the
example's service, defined by the page's own Python block. A change to the descriptions,
the defaults' text or the JSON layout that the page does not follow fails here.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import types
from pathlib import Path

import pytest

from tensorrpc import describe

PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def appendix() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("## Appendix A. The schema fingerprint")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def fenced(section: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", section, flags=re.S | re.M)


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The page's example, run as a module of its own (its dataclass needs one)."""
    section = appendix()
    worked = section[section.index("### A.4") :]
    (code,) = fenced(worked, "python")
    module = types.ModuleType("fingerprint_spec_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, str(PAGE), "exec"), module.__dict__)
    return module


def test_the_worked_example_hashes_to_the_code_fingerprint(example: types.ModuleType) -> None:
    worked = appendix()[appendix().index("### A.4") :]
    (canonical,) = fenced(worked, "text")
    text = "".join(canonical.splitlines())
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    stated = re.findall(r"`([0-9a-f]{64})`", worked)
    assert stated == [digest]
    assert digest == example.FINGERPRINT
    assert describe(example.Geo).fingerprint == digest


def test_the_canonical_text_follows_the_layout_the_page_states(
    example: types.ModuleType,
) -> None:
    worked = appendix()[appendix().index("### A.4") :]
    (canonical,) = fenced(worked, "text")
    text = "".join(canonical.splitlines())
    assert text.isascii()
    doc = json.loads(text)
    # Compact, keys sorted, ASCII: the text is exactly its own canonical dump.
    assert json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True) == text
    assert [m["name"] for m in doc["methods"]] == sorted(describe(example.Geo).methods)
    spec = describe(example.Geo)
    for method in doc["methods"]:
        m = spec.methods[method["name"]]
        if m.request_streaming:  # one PARAM, the stream: stream[item type]
            assert m.item_type is not None
            assert [p[0] for p in method["params"]] == [m.item_param]
            assert method["params"][0][2] == f"stream[{m.item_type.description}]"
        else:
            assert [p[0] for p in method["params"]] == list(m.params)
        assert method["returns"] == m.result_type.description
        assert method["streaming"] == m.streaming
    kinds = {
        m["name"]: (m["streaming"], m["params"][0][2].startswith("stream[")) for m in doc["methods"]
    }
    # The four kinds of method: unary, server streaming, client streaming, bidirectional.
    assert sorted(kinds.values()) == [(False, False), (False, True), (True, False), (True, True)]
    by_name = {m["name"]: m for m in doc["methods"]}
    scale = {p[0]: p for p in by_name["scale"]["params"]}
    assert scale["factor"][3] == "1"  # an int default for a float stays "1", not "1.0"
