"""The client's engine table: selection, membership, bounded refusals, capacity waiters."""

from __future__ import annotations

import pytest

from tensorrpc._calls import StreamCredit
from tensorrpc._engines import (
    MAX_PAST,
    MAX_REJECTED,
    MAX_REJECTED_KEY,
    MAX_REJECTED_TEXT,
    CapacityWaiters,
    Engine,
    EngineInfo,
    EngineTable,
    check_hello,
)
from tensorrpc._exceptions import EngineNotFoundError

EXPECT = {"service": "Calc", "fingerprint": "f" * 8, "protocol_version": 1}


def info(engine_id: str, **kw: object) -> EngineInfo:
    fields: dict[str, object] = {"service": "Calc", "fingerprint": "f" * 8, "protocol_version": 1}
    fields.update(kw)
    return EngineInfo(engine_id=engine_id, **fields)  # type: ignore[arg-type]


def admit(table: EngineTable, engine_id: str, peer: bytes, now: float = 0.0) -> Engine:
    engine = Engine(info=info(engine_id), peer=peer, heard=now, sent=now)
    table.add(engine)
    return engine


@pytest.mark.parametrize(
    ("kw", "reason", "needle"),
    [
        (
            {"fingerprint": "abc"},
            "fingerprint",
            "engine 'e1' has a different schema: the service's method signatures differ "
            "(fingerprint abc, client expects ffffffff)",
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


def test_id_is_free_after_removal_and_counters_are_kept() -> None:
    table = EngineTable(max_in_flight=4)
    first = admit(table, "e1", b"e1/a")
    first.calls_total, first.errors = 3, 1
    assert table.remove(first)
    assert not first.alive
    assert not table.remove(first)
    assert table.by_peer(b"e1/a") is None
    second = admit(table, "e1", b"e1/b")
    assert table.engines["e1"] is second
    assert table.past["e1"].calls == 3
    assert table.past["e1"].errors == 1


def test_refusals_are_bounded_and_cut() -> None:
    table = EngineTable(max_in_flight=4)
    for i in range(10 * MAX_REJECTED):
        table.refuse(f"{i}-" + "x" * 5000, "fingerprint", "y" * 100_000)
    assert len(table.rejected) == MAX_REJECTED
    assert table.rejected_total == 10 * MAX_REJECTED
    assert all(len(k) <= MAX_REJECTED_KEY for k in table.rejected)
    assert all(len(v) <= MAX_REJECTED_TEXT for v in table.rejected.values())
    assert next(iter(table.rejected)).startswith(f"{9 * MAX_REJECTED}-")  # the oldest went


def test_refusal_is_forgotten_when_the_engine_is_admitted() -> None:
    table = EngineTable(max_in_flight=4)
    table.refuse("e1", "duplicate_id", "busy")
    admit(table, "e1", b"p")
    assert "e1" not in table.rejected


def test_counters_of_departed_engines_are_bounded() -> None:
    table = EngineTable(max_in_flight=4)
    for i in range(MAX_PAST + 10):
        table.remove(admit(table, f"e{i}", f"p{i}".encode()))
    assert len(table.past) == MAX_PAST
    assert "e0" not in table.past
    assert f"e{MAX_PAST + 9}" in table.past


def test_unknown_engine_lists_live_engines() -> None:
    table = EngineTable(max_in_flight=4)
    admit(table, "b", b"b")
    admit(table, "a", b"a")
    with pytest.raises(EngineNotFoundError) as info_:
        table.select("zz")
    assert info_.value.live == ("a", "b")
    assert "'zz'" in str(info_.value)
    assert "a, b" in str(info_.value)


def test_balanced_with_no_engines_fails() -> None:
    table = EngineTable(max_in_flight=4)
    with pytest.raises(EngineNotFoundError, match="no live engines"):
        table.select(None)


def test_least_outstanding_prefers_idle_engine() -> None:
    table = EngineTable(max_in_flight=8)
    a = admit(table, "a", b"a")
    b = admit(table, "b", b"b")
    c = admit(table, "c", b"c")
    a.calls.update({1, 2})
    c.calls.add(3)
    for _ in range(5):
        assert table.select(None) is b
    b.calls.update({4, 5, 6})
    assert table.select(None) is c


def test_least_outstanding_spreads_idle_pool() -> None:
    table = EngineTable(max_in_flight=8)
    engines = [admit(table, n, n.encode()) for n in "abc"]
    picked = [table.select(None) for _ in range(6)]
    assert {id(p) for p in picked} == {id(e) for e in engines}


def test_round_robin_cycles_and_skips_full() -> None:
    table = EngineTable(balancing="round_robin", max_in_flight=1)
    a = admit(table, "a", b"a")
    b = admit(table, "b", b"b")
    c = admit(table, "c", b"c")
    assert [table.select(None) for _ in range(4)] == [a, b, c, a]
    b.calls.add(1)
    assert [table.select(None) for _ in range(2)] == [c, a]
    a.calls.add(2)
    c.calls.add(3)
    assert table.select(None) is None


def test_targeted_engine_at_bound_returns_none() -> None:
    table = EngineTable(max_in_flight=2)
    a = admit(table, "a", b"a")
    a.calls.update({1, 2})
    assert table.select("a") is None
    a.calls.discard(1)
    assert table.select("a") is a


def test_remove_keeps_round_robin_order_consistent() -> None:
    table = EngineTable(balancing="round_robin", max_in_flight=4)
    a = admit(table, "a", b"a")
    b = admit(table, "b", b"b")
    c = admit(table, "c", b"c")
    assert table.select(None) is a
    table.remove(b)
    assert [table.select(None) for _ in range(3)] == [c, a, c]


def test_expired_engines() -> None:
    table = EngineTable(max_in_flight=4)
    a = admit(table, "a", b"a", now=0.0)
    admit(table, "b", b"b", now=2.5)
    assert table.expired(3.0, dead_after=1.0) == [a]
    assert table.expired(3.0, dead_after=5.0) == []


def test_engines_we_were_silent_to_past_their_bound_forgot_us() -> None:
    table = EngineTable(max_in_flight=4)
    bounded = Engine(info=info("a", dead_after_ms=2000), peer=b"a", sent=0.0)
    table.add(bounded)
    admit(table, "old", b"old", now=0.0)  # announced no bound: never judged
    assert table.forgot_us(1.9) == []
    assert table.forgot_us(2.1) == [bounded]


def test_invalid_configuration() -> None:
    with pytest.raises(ValueError, match="balancing"):
        EngineTable(balancing="random", max_in_flight=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight"):
        EngineTable(max_in_flight=0)
    with pytest.raises(ValueError, match="window"):
        StreamCredit(0)


def test_stream_credit_batches_half_window() -> None:
    credit = StreamCredit(8)
    assert [credit.consumed() for _ in range(8)] == [0, 0, 0, 4, 0, 0, 0, 4]
    assert credit.granted == 8
    one = StreamCredit(1)
    assert [one.consumed() for _ in range(3)] == [1, 1, 1]


def test_a_freed_slot_wakes_one_waiter_in_order() -> None:
    waiters = CapacityWaiters()
    for token in range(1000):
        waiters.add(None, token)
    woken = [waiters.released("e1") for _ in range(1000)]
    assert woken == [[t] for t in range(1000)]
    assert waiters.wakeups == 1000
    assert not waiters.released("e1")
    assert waiters.wakeups == 1000


def test_targeted_waiters_come_first_for_their_engine_only() -> None:
    waiters = CapacityWaiters()
    waiters.add(None, "any")
    waiters.add("e2", "for-e2")
    assert waiters.queued("e2")
    assert waiters.queued(None)
    assert not waiters.queued("e1")
    assert waiters.released("e1") == ["any"]
    assert not waiters.released("e1")
    assert waiters.released("e2") == ["for-e2"]
    assert len(waiters) == 0


def test_cancelled_waiter_is_forgotten() -> None:
    waiters = CapacityWaiters()
    waiters.add("e1", 1)
    waiters.add("e1", 2)
    waiters.discard("e1", 1)
    waiters.discard(None, 99)
    assert waiters.released("e1") == [2]
    assert len(waiters) == 0


def test_join_wakes_up_to_its_slots_and_loss_wakes_its_targeted_waiters() -> None:
    waiters = CapacityWaiters()
    for token in range(5):
        waiters.add(None, token)
    waiters.add("e1", "t1")
    waiters.add("e1", "t2")
    assert waiters.joined("e1", 3) == ["t1", "t2", 0]
    waiters.add("e1", "t3")
    assert waiters.lost("e1", none_left=False) == ["t3"]
    assert waiters.lost("e1", none_left=True) == [1, 2, 3, 4]
    waiters.add("e9", "x")
    waiters.add(None, "y")
    assert sorted(waiters.everyone()) == ["x", "y"]


def test_absence_says_why_no_engine_can_take_a_call() -> None:
    # Issue 24 item 2: "no live engines" said nothing of why.
    table = EngineTable(max_in_flight=4)
    assert table.absence(None) == "no engine has joined yet"
    assert table.absence("e1") == "it never joined"
    with pytest.raises(EngineNotFoundError, match="no live engines: no engine has joined yet"):
        table.select(None)

    table.refuse("old", "fingerprint", "engine 'old' has a different schema: engine lacks: x")
    assert table.absence(None) == (
        "every engine that tried to join was refused: old: fingerprint: engine 'old' has a "
        "different schema: engine lacks: x"
    )
    refused = table.absence("old")
    assert refused is not None
    assert refused.startswith("it was refused: fingerprint: ")

    e1 = admit(table, "e1", b"p1")
    assert table.absence(None) is None
    assert table.absence("e1") is None
    table.remove(e1)  # died, said BYE, or restarting
    why = table.absence(None)
    assert why is not None
    assert why.startswith("1 engine left (died or stopped) and none has rejoined yet: restarting?")
    assert "('e1')" in why
    assert "refused: old: fingerprint" in why  # both facts are said
    assert table.absence("e1") == "it left (died or stopped) and has not rejoined yet: restarting?"
    with pytest.raises(EngineNotFoundError, match="'e1' is not live \\(it left"):
        table.select("e1")
    admit(table, "e1", b"p2")  # it rejoined
    assert table.absence("e1") is None
