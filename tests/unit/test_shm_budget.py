"""`PeerBudget`: what each peer pins of a torch_shm sender, against its caps (sans-I/O).

A shared storage costs its bytes once per peer, however many of the peer's leases pin
it; pool regions cost theirs per lease; the lease count has a cap of its own.
"""

from __future__ import annotations

from tensorrpc.transports._shm_budget import PeerBudget

A, B = (1, 10), (1, 11)


def test_a_storage_pinned_by_many_leases_costs_its_bytes_once_until_the_last_ends() -> None:
    budget = PeerBudget(max_bytes=100, max_leases=10)
    for _ in range(3):
        assert budget.try_pin("p", A, 60, new_lease=True)
        budget.opened("p")
    assert (budget.bytes_of("p"), budget.leases_of("p")) == (60, 3)
    budget.closed("p", 0, [A])
    budget.closed("p", 0, [A])
    assert (budget.bytes_of("p"), budget.leases_of("p")) == (60, 1)
    budget.closed("p", 0, [A])
    assert (budget.bytes_of("p"), budget.leases_of("p")) == (0, 0)


def test_a_lease_that_pins_one_storage_twice_gives_both_back() -> None:
    budget = PeerBudget(max_bytes=100, max_leases=10)
    assert budget.try_pin("p", A, 60, new_lease=True)
    budget.opened("p")
    assert budget.try_pin("p", A, 60, new_lease=False)  # a second view, same message
    assert budget.bytes_of("p") == 60
    budget.closed("p", 0, [A, A])
    assert budget.bytes_of("p") == 0
    assert budget.try_pin("p", B, 100, new_lease=True)  # the whole budget is free again


def test_over_the_byte_cap_nothing_is_pinned() -> None:
    budget = PeerBudget(max_bytes=100, max_leases=10)
    assert budget.try_pin("p", A, 60, new_lease=True)
    budget.opened("p")
    assert not budget.try_pin("p", B, 41, new_lease=True)
    assert budget.bytes_of("p") == 60
    assert budget.try_pin("p", A, 60, new_lease=True)  # pinned already: costs nothing
    assert budget.try_pin("q", B, 100, new_lease=True)  # another peer, its own budget


def test_the_lease_cap_counts_open_leases_and_not_pins_of_an_open_one() -> None:
    budget = PeerBudget(max_bytes=1000, max_leases=2)
    for _ in range(2):
        assert budget.try_pin("p", A, 1, new_lease=True)
        budget.opened("p")
    assert not budget.try_pin("p", A, 1, new_lease=True)
    assert budget.over("p", 0, new_lease=True)
    assert budget.try_pin("p", B, 1, new_lease=False)  # more in a lease already open
    assert not budget.over("p", 0, new_lease=False)


def test_pool_regions_are_charged_per_lease_beside_pins() -> None:
    budget = PeerBudget(max_bytes=100, max_leases=10)
    budget.opened("p")
    budget.charge("p", 30)
    assert budget.try_pin("p", A, 60, new_lease=False)
    assert budget.over("p", 11, new_lease=False)
    assert not budget.over("p", 10, new_lease=False)
    budget.closed("p", 30, [A])
    assert (budget.bytes_of("p"), budget.leases_of("p")) == (0, 0)
    budget.opened("p")
    budget.clear()
    assert (budget.bytes_of("p"), budget.leases_of("p")) == (0, 0)
