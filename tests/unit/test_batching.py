"""The batcher's rules (tensorrpc._batching), sans-I/O with a fake clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tensorrpc import ServiceDefinitionError
from tensorrpc._batching import Batcher, Batching, Continuous


class Item:
    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"Item({self.n})"


def items(k: int) -> list[Item]:
    return [Item(i) for i in range(k)]


def test_closes_at_max_size_at_once() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=3, max_delay=10.0))
    xs = items(4)
    for x in xs:
        assert b.offer(x, 0.0)
    p = b.poll(0.0)
    assert p.batch == xs[:3]
    assert b.running == 1
    assert len(b) == 1


def test_waits_for_max_delay_of_oldest() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=8, max_delay=0.5))
    xs = items(2)
    b.offer(xs[0], 1.0)
    b.offer(xs[1], 1.3)
    p = b.poll(1.2)
    assert p.batch == []
    assert p.wake_at == pytest.approx(1.5)
    p = b.poll(1.5)
    assert p.batch == xs


def test_zero_delay_takes_what_is_queued_now() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=8, max_delay=0))
    x = Item(0)
    b.offer(x, 5.0)
    assert b.poll(5.0).batch == [x]


def test_preferred_sizes_close_early_and_round_down() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=16, max_delay=1.0, preferred_sizes=(2, 4)))
    xs = items(5)
    for x in xs[:3]:
        b.offer(x, 0.0)
    assert b.poll(0.1).batch == []  # 3 queued: not the largest preferred size yet
    b.offer(xs[3], 0.2)
    assert b.poll(0.2).batch == xs[:4]  # the largest preferred size is queued
    b.finished()
    b.offer(xs[4], 0.3)
    for x in items(2):
        b.offer(x, 0.3)
    p = b.poll(1.3)  # delay: 3 queued round down to 2
    assert [x.n for x in p.batch] == [4, 0]
    assert len(b) == 1


def test_concurrent_batch_bound() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=1, max_delay=0, max_batches=2))
    xs = items(3)
    for x in xs:
        b.offer(x, 0.0)
    assert b.poll(0.0).batch == [xs[0]]
    assert b.poll(0.0).batch == [xs[1]]
    assert b.poll(0.0).batch == []  # two running: the third waits
    b.finished()
    assert b.poll(0.0).batch == [xs[2]]
    b.finished()
    b.finished()
    with pytest.raises(RuntimeError, match="without a running batch"):
        b.finished()


def test_bounded_queue_refuses() -> None:
    b: Batcher[Item] = Batcher(Batching(max_queue=2))
    assert b.offer(Item(0), 0.0)
    assert b.offer(Item(1), 0.0)
    assert not b.offer(Item(2), 0.0)


def test_expired_items_never_enter_a_batch() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=4, max_delay=1.0))
    late, ok = Item(0), Item(1)
    b.offer(late, 0.0, deadline=0.5)
    b.offer(ok, 0.0, deadline=5.0)
    p = b.poll(0.2)
    assert p.batch == []
    assert p.expired == []
    assert p.wake_at == 0.5
    p = b.poll(0.5)
    assert p.expired == [late]
    assert p.batch == []
    assert b.poll(1.0).batch == [ok]


def test_running_items_are_handed_back_late_at_their_deadline() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=4, max_delay=0.0))
    x, done, forever = Item(0), Item(1), Item(2)
    b.offer(x, 0.0, deadline=1.0)
    b.offer(done, 0.0, deadline=0.5)
    b.offer(forever, 0.0)
    assert b.poll(0.0).batch == [x, done, forever]
    b.settled(done)  # its outcome is in: its deadline no longer matters
    p = b.poll(0.6)
    assert p.late == []
    assert p.wake_at == 1.0  # the running item's deadline wakes the shell
    p = b.poll(1.0)
    assert p.late == [x]
    assert p.wake_at == math.inf
    assert b.poll(2.0).late == []  # handed back once


def test_join_hands_back_late_running_items() -> None:
    b: Batcher[Item] = Batcher(Continuous(max_size=4, max_delay=0.0))
    x, y = Item(0), Item(1)
    b.offer(x, 0.0, deadline=1.0)
    assert b.poll(0.0).batch == [x]
    b.offer(y, 0.5, deadline=3.0)
    p = b.join(3, 1.2)
    assert p.late == [x]
    assert p.batch == [y]
    assert p.wake_at == 3.0


def test_settled_items_do_not_pile_up() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=1, max_delay=0.0, max_batches=1))
    for n in range(1000):
        x = Item(n)
        b.offer(x, float(n), deadline=1e9)
        assert b.poll(float(n)).batch == [x]
        b.settled(x)
        b.finished()
    assert len(b._watch) <= 64 + 1


def sooner(b: Batcher[Item]) -> bool:
    # A call, not the attribute: mypy would keep an assert's narrowing across offers.
    return b.poll_sooner


def test_offer_says_when_the_shell_must_poll_sooner() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=3, max_delay=1.0))
    xs = items(5)
    assert b.offer(xs[0], 0.0)
    assert sooner(b)  # the first item: its delay starts a timer
    assert b.poll(0.0).wake_at == 1.0
    assert b.offer(xs[1], 0.2)
    assert not sooner(b)  # the oldest item's delay still decides
    assert b.offer(xs[2], 0.3, deadline=0.8)
    assert sooner(b)  # batch full (max_size)
    assert b.poll(0.3).batch == xs[:3]
    assert b.poll(0.3).wake_at == 0.8  # the running item's deadline
    assert b.offer(xs[3], 0.4)
    assert not sooner(b)  # its delay ends at 1.4: the timer at 0.8 comes first
    b.finished()
    assert b.poll(0.4).wake_at == 0.8
    assert b.offer(xs[4], 0.5, deadline=0.6)
    assert sooner(b)  # a deadline before the shell's timer
    b.remove(xs[3])
    b.remove(xs[4])
    assert b.poll(0.5).wake_at == 0.8
    assert b.offer(Item(9), 0.6)
    assert not sooner(b)  # the queue was empty, but its delay ends after 0.8
    assert b.poll(0.8).late == [xs[2]]
    assert b.offer(Item(10), 0.9)
    assert not sooner(b)  # the oldest item (9) decides: 1.6, the shell's timer


def test_cancelled_items_never_enter_a_batch() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=2, max_delay=1.0))
    xs = items(3)
    for x in xs:
        b.offer(x, 0.0)
    assert b.remove(xs[0])
    assert not b.remove(xs[0])
    assert not b.queued(xs[0])
    assert b.poll(0.0).batch == xs[1:]


def test_delay_counts_from_the_oldest_remaining_item() -> None:
    b: Batcher[Item] = Batcher(Batching(max_size=8, max_delay=1.0))
    first, second = Item(0), Item(1)
    b.offer(first, 0.0)
    b.offer(second, 0.6)
    b.remove(first)
    assert b.poll(1.0).batch == []
    assert b.poll(1.6).batch == [second]


def test_join_at_step_boundary_takes_queued_items_up_to_room() -> None:
    b: Batcher[Item] = Batcher(Continuous(max_size=3, max_delay=1.0))
    xs = items(5)
    b.offer(xs[0], 0.0)
    assert b.poll(0.0).batch == []  # a new batch waits for the delay
    assert b.poll(1.0).batch == [xs[0]]
    for x in xs[1:]:
        b.offer(x, 1.1)
    j = b.join(2, 1.1)  # joining does not wait for the delay
    assert j.batch == xs[1:3]
    assert b.running == 1
    assert b.join(0, 1.2).batch == []
    assert len(b) == 2  # the rest wait for room
    assert b.queued(xs[3])
    assert b.queued(xs[4])


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (Batching(max_size=0), "max_size"),
        (Batching(max_size=True), "max_size"),
        (Batching(max_delay=-1), "max_delay"),
        (Batching(max_delay=math.inf), "max_delay"),
        (Batching(max_delay="1"), "max_delay"),  # type: ignore[arg-type]
        (Batching(max_batches=0), "max_batches"),
        (Batching(max_queue=0), "max_queue"),
        (Batching(max_size=4, preferred_sizes=(8,)), "preferred_sizes"),
        (Batching(preferred_sizes=[2]), "preferred_sizes"),  # type: ignore[arg-type]
        (Continuous(max_size=-1), "max_size"),
        (Continuous(max_delay=math.nan), "max_delay"),
    ],
)
def test_bad_settings_are_refused_naming_the_method(cfg: Batching | Continuous, field: str) -> None:
    with pytest.raises(ServiceDefinitionError, match=rf"Svc\.embed: \w+\.{field}"):
        cfg.check("Svc.embed")


class BatcherMachine(RuleBasedStateMachine):
    """Random offers, cancels, time passing, polls and finishes; the rules hold throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = Batching(max_size=4, max_delay=1.0, preferred_sizes=(2, 3), max_batches=2,
                            max_queue=6)  # fmt: skip
        self.b: Batcher[Item] = Batcher(self.cfg)
        self.now = 0.0
        self.n = 0
        self.queued: dict[int, tuple[Item, float, float]] = {}  # model: id -> (item, since, dl)
        self.seen: set[int] = set()  # items that left the queue (batch, expiry, cancel)
        self.cancelled: set[int] = set()
        self.expired: set[int] = set()
        self.running: dict[int, tuple[Item, float]] = {}  # model: in a batch, finite deadline
        self.wake_at = math.inf  # the last wake_at the shell got (it sleeps until then)
        self.kicked = False  # told to poll sooner since it last polled

    @rule(deadline=st.one_of(st.none(), st.floats(0.0, 3.0)))
    def offer(self, deadline: float | None) -> None:
        x = Item(self.n)
        self.n += 1
        dl = math.inf if deadline is None else self.now + deadline
        before = self.wake_at
        ok = self.b.offer(x, self.now, dl)
        assert ok == (len(self.queued) < self.cfg.max_queue)
        if self.b.poll_sooner:
            self.kicked = True  # the shell polls at once
        elif ok and not self.kicked:
            # The shell sleeps until `before`: nothing may be due earlier.
            b = self.b
            assert len(b) < self.cfg.max_size
            assert len(b) != 3  # the largest preferred size closes a batch at once
            assert dl >= before
            assert (
                b.running >= self.cfg.max_batches
                or min(v[1] for v in [*self.queued.values(), (x, self.now, dl)])
                + self.cfg.max_delay
                >= before
            )
        if ok:
            self.queued[x.n] = (x, self.now, dl)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        n = data.draw(st.sampled_from(sorted(self.queued)))
        x = self.queued.pop(n)[0]
        assert self.b.remove(x)
        self.cancelled.add(n)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        n = data.draw(st.sampled_from(sorted(self.running)))
        self.b.settled(self.running.pop(n)[0])

    @rule(dt=st.floats(0.0, 1.5))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def poll(self) -> None:
        running = self.b.running
        before = dict(self.queued)
        p = self.b.poll(self.now)
        self.wake_at = p.wake_at
        self.kicked = bool(p.batch)  # a batch closed: the shell polls again at once
        for x in p.expired:
            assert x.n in before, "only queued items expire"
            assert before[x.n][2] <= self.now
            self.queued.pop(x.n)
            self.expired.add(x.n)
        for x in p.late:
            assert x.n in self.running, "only running, unsettled items are late, once"
            assert self.running.pop(x.n)[1] <= self.now
        for n, (_, dl) in self.running.items():
            assert dl > self.now, f"item {n} is late in its batch and was not handed back"
        live = dict(self.queued.items())
        if p.batch:
            assert running < self.cfg.max_batches
            assert 1 <= len(p.batch) <= self.cfg.max_size
            order = sorted(live)
            assert [x.n for x in p.batch] == order[: len(p.batch)], "oldest first"
            for x in p.batch:
                assert x.n not in self.cancelled
                assert x.n not in self.expired
                assert live[x.n][2] > self.now, "no expired item enters a batch"
                dl = self.queued.pop(x.n)[2]
                if dl != math.inf:
                    self.running[x.n] = (x, dl)
            oldest_wait = self.now - live[order[0]][1]
            closed_by_size = len(live) >= self.cfg.max_size or len(live) >= 3
            assert closed_by_size or oldest_wait >= self.cfg.max_delay
            if not closed_by_size:
                pref = [s for s in self.cfg.preferred_sizes if s <= len(live)]
                assert len(p.batch) == (max(pref) if pref else len(live))
        else:
            # Nothing closed: either no slot, or no rule says close.
            if running < self.cfg.max_batches and live:
                oldest = min(v[1] for v in live.values())
                assert len(live) < 3
                assert self.now - oldest < self.cfg.max_delay
                assert p.wake_at <= oldest + self.cfg.max_delay
        for n, (_, _, dl) in self.queued.items():
            assert dl > self.now, f"item {n} is late and still queued"
        deadlines = [v[2] for v in self.queued.values()] + [v[1] for v in self.running.values()]
        assert p.wake_at <= min(deadlines, default=math.inf), "a deadline wakes the shell"

    @precondition(lambda self: self.b.running > 0)
    @rule()
    def finish(self) -> None:
        self.b.finished()
        self.kicked = True  # the shell polls when a batch is done

    @invariant()
    def counts_match(self) -> None:
        assert len(self.b) == len(self.queued)
        assert 0 <= self.b.running <= self.cfg.max_batches


BatcherMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBatcherMachine = BatcherMachine.TestCase
