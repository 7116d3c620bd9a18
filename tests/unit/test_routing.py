from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tensorrpc._routing as routing
from tensorrpc._exceptions import EngineNotFoundError
from tensorrpc._routing import EngineInfo, EngineRegistry, EngineState, StreamCredit, check_hello

EXPECT = {"service": "Calc", "fingerprint": "f" * 8, "protocol_version": 1}


def info(engine_id: str, **kw: object) -> EngineInfo:
    fields: dict[str, object] = {"service": "Calc", "fingerprint": "f" * 8, "protocol_version": 1}
    fields.update(kw)
    return EngineInfo(engine_id=engine_id, **fields)  # type: ignore[arg-type]


def admit(reg: EngineRegistry, engine_id: str, peer: bytes, now: float = 0.0) -> EngineState:
    state = reg.admit(info(engine_id), peer, now, **EXPECT)  # type: ignore[arg-type]
    assert isinstance(state, EngineState)
    return state


def test_routing_imports_no_io_modules() -> None:
    tree = ast.parse(Path(routing.__file__).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"zmq", "asyncio", "anyio", "trio"}


@pytest.mark.parametrize(
    ("kw", "reason", "needle"),
    [
        (
            {"fingerprint": "abc"},
            "fingerprint",
            "engine 'e1' has schema fingerprint abc, client expects ffffffff",
        ),
        ({"service": "Other"}, "service", "serves 'Other', client expects 'Calc'"),
        ({"protocol_version": 9}, "version", "speaks protocol version 9, client speaks 1"),
    ],
)
def test_check_hello_says_what_differs(kw: dict[str, object], reason: str, needle: str) -> None:
    refusal = check_hello(info("e1", **kw), **EXPECT)  # type: ignore[arg-type]
    assert refusal is not None
    assert refusal[0] == reason
    assert needle in refusal[1]


def test_check_hello_accepts_match() -> None:
    assert check_hello(info("e1"), **EXPECT) is None  # type: ignore[arg-type]


def test_duplicate_live_id_is_refused_and_first_keeps_place() -> None:
    reg = EngineRegistry(max_in_flight=4)
    first = admit(reg, "e1", b"e1/a")
    refusal = reg.admit(info("e1"), b"e1/b", 1.0, **EXPECT)  # type: ignore[arg-type]
    assert isinstance(refusal, tuple)
    assert refusal[0] == "duplicate_id"
    assert reg.engines["e1"] is first
    assert reg.rejected["e1"].startswith("duplicate_id: engine id 'e1' is already served")
    assert reg.by_peer(b"e1/b") is None


def test_repeated_hello_from_same_peer_is_idempotent() -> None:
    reg = EngineRegistry(max_in_flight=4)
    first = admit(reg, "e1", b"p")
    again = reg.admit(info("e1"), b"p", 5.0, **EXPECT)  # type: ignore[arg-type]
    assert again is first
    assert first.last_seen == 5.0


def test_id_is_free_after_removal() -> None:
    reg = EngineRegistry(max_in_flight=4)
    first = admit(reg, "e1", b"e1/a")
    first.calls.add(7)
    removed = reg.remove("e1")
    assert removed is first
    assert not first.alive
    assert reg.remove("e1") is None
    second = admit(reg, "e1", b"e1/b")
    assert reg.engines["e1"] is second
    assert "e1" not in reg.rejected


def test_unknown_engine_lists_live_engines() -> None:
    reg = EngineRegistry(max_in_flight=4)
    admit(reg, "b", b"b")
    admit(reg, "a", b"a")
    with pytest.raises(EngineNotFoundError) as info_:
        reg.select("zz")
    assert info_.value.live == ("a", "b")
    assert "'zz'" in str(info_.value)
    assert "a, b" in str(info_.value)


def test_balanced_with_no_engines_fails() -> None:
    reg = EngineRegistry(max_in_flight=4)
    with pytest.raises(EngineNotFoundError, match="no live engines"):
        reg.select(None)
    assert reg.has_capacity(None)


def test_least_outstanding_prefers_idle_engine() -> None:
    reg = EngineRegistry(max_in_flight=8)
    a = admit(reg, "a", b"a")
    b = admit(reg, "b", b"b")
    c = admit(reg, "c", b"c")
    a.calls.update({1, 2})
    c.calls.add(3)
    for _ in range(5):
        assert reg.select(None) is b
    b.calls.update({4, 5, 6})
    assert reg.select(None) is c


def test_least_outstanding_spreads_idle_pool() -> None:
    reg = EngineRegistry(max_in_flight=8)
    states = [admit(reg, n, n.encode()) for n in "abc"]
    picked = [reg.select(None) for _ in range(6)]
    assert {id(p) for p in picked} == {id(s) for s in states}


def test_round_robin_cycles_and_skips_full() -> None:
    reg = EngineRegistry(balancing="round_robin", max_in_flight=1)
    a = admit(reg, "a", b"a")
    b = admit(reg, "b", b"b")
    c = admit(reg, "c", b"c")
    assert [reg.select(None) for _ in range(4)] == [a, b, c, a]
    b.calls.add(1)
    assert [reg.select(None) for _ in range(2)] == [c, a]
    a.calls.add(2)
    c.calls.add(3)
    assert reg.select(None) is None
    assert not reg.has_capacity(None)


def test_targeted_engine_at_bound_returns_none() -> None:
    reg = EngineRegistry(max_in_flight=2)
    a = admit(reg, "a", b"a")
    a.calls.update({1, 2})
    assert reg.select("a") is None
    assert not reg.has_capacity("a")
    a.calls.discard(1)
    assert reg.select("a") is a


def test_remove_keeps_round_robin_order_consistent() -> None:
    reg = EngineRegistry(balancing="round_robin", max_in_flight=4)
    a = admit(reg, "a", b"a")
    admit(reg, "b", b"b")
    c = admit(reg, "c", b"c")
    assert reg.select(None) is a
    reg.remove("b")
    assert [reg.select(None) for _ in range(3)] == [c, a, c]


def test_expired_engines() -> None:
    reg = EngineRegistry(max_in_flight=4)
    a = admit(reg, "a", b"a", now=0.0)
    admit(reg, "b", b"b", now=2.5)
    assert reg.expired(3.0, dead_after=1.0) == [a]
    assert reg.expired(3.0, dead_after=5.0) == []


def test_invalid_configuration() -> None:
    with pytest.raises(ValueError, match="balancing"):
        EngineRegistry(balancing="random", max_in_flight=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight"):
        EngineRegistry(max_in_flight=0)
    with pytest.raises(ValueError, match="window"):
        StreamCredit(0)


def test_stream_credit_batches_half_window() -> None:
    credit = StreamCredit(8)
    assert [credit.consumed() for _ in range(8)] == [0, 0, 0, 4, 0, 0, 0, 4]
    one = StreamCredit(1)
    assert [one.consumed() for _ in range(3)] == [1, 1, 1]
