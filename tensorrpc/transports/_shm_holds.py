"""One-copy receive for ``torch_shm``: tensors built on a peer's pool regions, and their leases.

A pool tensor is copied once, by its sender, into a region of a sealed memfd; the receiver
builds its tensor **on that region** (no second copy). The region stays leased to the
receiver while the tensor lives, so the sender never writes it again until it is told so:
the received tensor stays private. Two ways to end the lease:

* ``hold`` (results and stream items: the sender keeps the region until a RELEASE): each
  tensor on a region is registered under ``(peer, lease)``; when its storage is freed (its
  last view dies, in any thread) the lease becomes *releasable*, and the runtime sends the
  releasable ids in one RELEASE, batched (`Holds.take`).
* ``keep`` (arguments: the sender takes its regions back with the first reply): the
  tensors of one message are tracked weakly under the message's key; before that reply
  the receiver calls ``detach``, which gives the tensors still alive private pages (a copy;
  `tensorrpc.transports._shm_pool.privatize`). Tensors already gone cost nothing, which is
  the usual case (arguments die with the handler).

Nothing here touches sockets or clocks; the mapping itself is owned by the tensor (a view
of the segment's mapping), so a peer's death or exit never invalidates received tensors.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Hashable

    import torch

__all__ = ["Hold", "Holds"]


class Holds:
    """Leases held by live received tensors, and messages whose tensors may need detaching.

    Thread-safe: a tensor may die in any thread (its storage's finalizer runs `drop`).
    """

    def __init__(self) -> None:
        # Re-entrant: a tensor's death (and so `drop`) may run inside one of our own
        # calls, when a garbage collection happens there.
        self._lock = threading.RLock()
        self._live: dict[tuple[Hashable, int], int] = {}
        #: Releasable lease ids by peer. Its emptiness may be read without the lock (an
        #: O(1) check on every call); the dict is never replaced.
        self.ready: dict[Hashable, list[int]] = {}
        #: Tensors of messages to detach, by message key. Its emptiness may be read without
        #: the lock (`detach`); the dict is never replaced.
        self._kept: dict[Hashable, weakref.WeakSet[Hold]] = {}

    # -- hold: released when the tensors die ----------------------------------------------

    def add(self, peer: Hashable, lease: int) -> None:
        """One more tensor (or an open decode) holds ``lease`` of ``peer``."""
        key = (peer, lease)
        with self._lock:
            self._live[key] = self._live.get(key, 0) + 1

    def drop(self, peer: Hashable, lease: int) -> None:
        """One holder of ``lease`` is gone; the last one makes the lease releasable."""
        key = (peer, lease)
        with self._lock:
            left = self._live.get(key)
            if left is None:
                return  # forgotten (the peer is gone): nothing to release any more
            if left > 1:
                self._live[key] = left - 1
                return
            del self._live[key]
            self.ready.setdefault(peer, []).append(lease)

    def take(self, peer: Hashable) -> tuple[int, ...]:
        """The releasable lease ids of ``peer``, each returned once."""
        if not self.ready:  # the common case, read without the lock: O(1)
            return ()
        with self._lock:
            ready = self.ready.pop(peer, None)
        return tuple(dict.fromkeys(ready)) if ready else ()

    def peers(self) -> list[Hashable]:
        """Peers with releasable leases (for a periodic flush)."""
        with self._lock:
            return list(self.ready)

    def held(self) -> int:
        """Peers' leases held by live tensors (or open decodes) right now."""
        with self._lock:
            return len(self._live)

    # -- keep: detached before the sender takes the regions back --------------------------

    def keep(self, key: Hashable, hold: Hold) -> None:
        """Track a tensor of message ``key`` (weakly) for `detach`."""
        with self._lock:
            self._kept.setdefault(key, weakref.WeakSet()).add(hold)

    def detach(self, key: Hashable) -> list[Hold]:
        """Stop tracking message ``key``; return its tensors still alive."""
        if not self._kept:
            # The common case (no one-copy tensor tracked), read without the lock: a
            # message's tensors are tracked by its own decode, which ran before this.
            return []
        with self._lock:
            kept = self._kept.pop(key, None)
            return list(kept) if kept else []

    def kept_bytes(self, key: Hashable) -> int:
        """Bytes of message ``key``'s tensors still alive (what `detach` would copy)."""
        if not self._kept:
            return 0
        with self._lock:
            kept = self._kept.get(key)
            return sum(hold.nbytes for hold in kept) if kept else 0

    # -- peers ------------------------------------------------------------------------------

    def forget(self, peer: Hashable) -> list[Hashable]:
        """The peer is gone: none of its leases is released any more.

        Returns:
            The keys of its messages still tracked for `detach` (tuples starting with
            ``peer``); the caller detaches them.
        """
        with self._lock:
            # list() first: a tensor dying in a garbage collection here re-enters `drop`,
            # which must not change a dict we are iterating over.
            self.ready.pop(peer, None)
            for key in [k for k in list(self._live) if k[0] == peer]:
                self._live.pop(key, None)
            return [k for k in list(self._kept) if isinstance(k, tuple) and k and k[0] == peer]


class Hold:
    """Kept alive by exactly one received tensor's storage (as an attribute of its buffer).

    Its death is the tensor's death: it drops the lease from `Holds` (``hold`` mode). It
    also keeps the segment's mapping alive, so the tensor stays valid after the sender
    dies, and says which bytes to privatize (``keep`` mode).
    """

    __slots__ = ("__weakref__", "addr", "holds", "lease", "map_key", "mapping", "nbytes", "peer")

    def __init__(
        self,
        holds: Holds | None,
        peer: Hashable,
        lease: int,
        mapping: torch.Tensor,
        span: tuple[int, int],
        map_key: tuple[int, int, int],
    ) -> None:
        #: None: nothing to release when the tensor dies (``keep`` mode).
        self.holds = holds
        self.peer = peer
        self.lease = lease
        #: The segment's mapping: unmapped only after the last tensor on it dies.
        self.mapping = mapping
        self.addr, self.nbytes = span
        #: The mapping cache's key of the segment (``(pid, dev, ino)``).
        self.map_key = map_key

    def __del__(self) -> None:
        holds = self.holds
        if holds is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown
                holds.drop(self.peer, self.lease)
