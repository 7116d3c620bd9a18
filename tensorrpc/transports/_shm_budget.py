"""What each peer holds of a torch_shm sender's memory, against its cap (sans-I/O).

A receiver that never releases must not make the sender grow without bound, so every peer
has a budget: at most ``max_leases`` unreleased leases and ``max_bytes`` of memory pinned
by them. Two kinds of memory count:

* pool regions (fresh tensors copied in): each region's bytes, charged to the lease that
  holds it;
* shared storages (tensors born in tensorrpc shared memory, sent by alias): the storage's
  bytes, charged to the peer **once** however many of its leases pin that storage, and
  uncharged when the last of them ends. Sending the same shared tensor in 64 calls in
  flight pins one storage, not 64: charging it per lease made such calls fall back to
  frames past ``max_bytes / size`` calls in flight, 100 to 300 times slower.

The caller (`TorchShmTransport`) holds its lock around every method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Hashable, Iterable

#: A shared storage's identity: its memfd's ``(st_dev, st_ino)``, stable while pinned.
StorageKey = tuple[int, int]


class PeerBudget:
    """Unreleased leases and pinned bytes per peer, with the caps that bound them.

    Args:
        max_bytes: most bytes one peer may pin (pool regions plus distinct storages).
        max_leases: most unreleased leases one peer may hold.
    """

    __slots__ = ("_bytes", "_leases", "_pins", "max_bytes", "max_leases")

    def __init__(self, max_bytes: int, max_leases: int) -> None:
        self.max_bytes = max_bytes
        self.max_leases = max_leases
        self._bytes: dict[Hashable, int] = {}
        self._leases: dict[Hashable, int] = {}
        #: peer -> storage -> [leases pinning it, its bytes].
        self._pins: dict[Hashable, dict[StorageKey, list[int]]] = {}

    def bytes_of(self, peer: Hashable) -> int:
        """Bytes ``peer`` pins now."""
        return self._bytes.get(peer, 0)

    def leases_of(self, peer: Hashable) -> int:
        """Unreleased leases ``peer`` holds now."""
        return self._leases.get(peer, 0)

    def over(self, peer: Hashable, nbytes: int, *, new_lease: bool) -> bool:
        """Whether ``nbytes`` more (and a new lease, if ``new_lease``) exceed the caps."""
        if self._bytes.get(peer, 0) + nbytes > self.max_bytes:
            return True
        return new_lease and self._leases.get(peer, 0) >= self.max_leases

    def try_pin(self, peer: Hashable, key: StorageKey, nbytes: int, *, new_lease: bool) -> bool:
        """Pin storage ``key`` (of ``nbytes``) for a lease of ``peer`` unless that exceeds
        the caps; False: nothing pinned. Its bytes count only if no lease of ``peer`` pins
        it yet; ``new_lease``: the pin needs a lease not yet `opened`."""
        pins = self._pins.get(peer)
        pin = pins.get(key) if pins is not None else None
        cost = nbytes if pin is None else 0
        if self.over(peer, cost, new_lease=new_lease):
            return False
        if pin is not None:
            pin[0] += 1
            return True
        if pins is None:
            pins = self._pins[peer] = {}
        pins[key] = [1, nbytes]
        self._bytes[peer] = self._bytes.get(peer, 0) + nbytes
        return True

    def opened(self, peer: Hashable) -> None:
        """A lease for ``peer`` was made."""
        self._leases[peer] = self._leases.get(peer, 0) + 1

    def charge(self, peer: Hashable, nbytes: int) -> None:
        """A lease of ``peer`` took a pool region of ``nbytes``."""
        self._bytes[peer] = self._bytes.get(peer, 0) + nbytes

    def closed(self, peer: Hashable, nbytes: int, pins: Iterable[StorageKey]) -> None:
        """A lease of ``peer`` ended: its pool regions (``nbytes``) and its ``pins``
        (an entry per successful `try_pin`) go back."""
        freed = nbytes
        held = self._pins.get(peer)
        if held is not None:
            for key in pins:
                pin = held[key]
                pin[0] -= 1
                if pin[0] == 0:
                    del held[key]
                    freed += pin[1]
            if not held:
                del self._pins[peer]
        left = self._bytes.get(peer, 0) - freed
        if left > 0:
            self._bytes[peer] = left
        else:
            self._bytes.pop(peer, None)
        count = self._leases.get(peer, 0) - 1
        if count > 0:
            self._leases[peer] = count
        else:
            self._leases.pop(peer, None)

    def clear(self) -> None:
        """Forget every peer (the transport closed, or a forked child starts afresh)."""
        self._bytes.clear()
        self._leases.clear()
        self._pins.clear()
