"""Waiting for capacity costs O(1) per waiter, however many wait (issue 9 item 9).

The queues were dicts used as ordered sets: taking the oldest token scans every hole
that earlier takes left at the front of the dict, so 100,000 waiters cost O(N²) (21 s of
CPU). `FifoSet` counts the entries it looks at; these tests bound that count.
"""

from __future__ import annotations

import random

from tensorrpc._engines import CapacityWaiters, FifoSet

N = 100_000


def test_fifo_set_takes_in_order_with_constant_work_per_token() -> None:
    queue = FifoSet()
    for token in range(N):
        queue.add(token)
    queue.add(0)  # already a member: stays first
    taken = [queue.take() for _ in range(N)]
    assert taken == list(range(N))
    assert queue.take() is None
    assert queue.work == N


def test_cancelled_waiters_cost_constant_work_too() -> None:
    rng = random.Random(9)
    waiters = CapacityWaiters()
    added = cancelled = 0
    alive: set[int] = set()
    for token in range(N):  # a burst of callers, a third of them giving up meanwhile
        waiters.add(None, token)
        added += 1
        alive.add(token)
        if rng.random() < 1 / 3:
            gone = rng.choice((token, token - 1, token // 2))
            if gone in alive:
                waiters.discard(None, gone)
                alive.discard(gone)
                cancelled += 1
    expected = sorted(alive)
    woken: list[object] = []
    while True:
        tokens = waiters.released("e1")
        if not tokens:
            break
        woken.extend(tokens)
    assert woken == expected  # FIFO, every waiter still waiting woken exactly once
    assert waiters.wakeups == added - cancelled
    assert len(waiters) == 0
    assert waiters.work <= 3 * added  # O(1) per waiter, sweeps included


def test_targeted_queues_count_their_work_after_they_empty() -> None:
    waiters = CapacityWaiters()
    for token in range(1000):
        waiters.add("e1", token)
    assert waiters.joined("e1", 1000) == list(range(1000))
    assert not waiters.queued("e1")
    assert 1000 <= waiters.work <= 2000
