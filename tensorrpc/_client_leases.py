"""The client's lease table, sans-I/O (rule 6 of `tensorrpc._client_protocol`).

Argument and request item leases of calls we gave up on are kept, by (engine peer, call
id), until the engine's RELEASE names them, a late reply to the call comes, or the
engine's session ends. Result leases we are done with wait, per engine, for the header
of the next CALL to it (at most `MAX_CALL_RELEASES`), else go in RELEASE messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorrpc._client_events import LeasesFreed
from tensorrpc._protocol import MAX_CALL_RELEASES

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from tensorrpc._calls import Call
    from tensorrpc._engines import Engine

__all__ = ["LeaseTable", "take_item_leases", "take_lease"]


def take_lease(call: Call) -> int | None:
    """The argument lease to free now that ``call`` ended or got its first stream item
    (the engine attached to its arguments, or never will); None: none."""
    lease, call.lease = call.lease, None
    return lease


def take_item_leases(call: Call) -> list[int]:
    """The request item leases to free now that ``call`` ended (the engine replied for
    the last time, or never will): `tensorrpc._streams` rule 6."""
    request = call.request
    if request is None or not request.leases:
        return []
    leases, request.leases = request.leases, []
    return leases


class LeaseTable:
    """Leases kept for calls we gave up on, and result leases waiting to go back.

    Args:
        send: Queues RELEASE messages naming these leases to an engine (the machine's).
    """

    __slots__ = ("_by_lease", "_held", "_returning", "_send", "closed", "due")

    def __init__(self, send: Callable[[Engine, Sequence[int], float], None]) -> None:
        self._send = send
        self._held: dict[tuple[bytes, int], list[int]] = {}
        self._by_lease: dict[int, tuple[bytes, int]] = {}
        self._returning: list[Engine] = []
        #: A `release_pending` is due (the shell calls it once its caller yields).
        self.due = False
        self.closed = False

    def __len__(self) -> int:
        """Leases kept for calls we gave up on (awaiting the engine's RELEASE)."""
        return len(self._by_lease)

    def hold(self, call: Call) -> None:
        """``call`` was cancelled: the engine may still read its arguments and request
        items, so their leases stay until its RELEASE, a late reply, or its end."""
        leases = [] if call.lease is None else [call.lease]
        call.lease = None
        request = call.request
        if request is not None and request.leases:
            leases += request.leases
            request.leases = []
        if leases:
            key = (call.engine.peer, call.call_id)
            self._held[key] = leases
            for lease in leases:
                self._by_lease[lease] = key

    def late_reply(self, engine: Engine, call_id: int) -> LeasesFreed | None:
        """A reply to no call in flight: the engine is done with that call's arguments."""
        leases = self._held.pop((engine.peer, call_id), None) if self._held else None
        if leases is None:
            return None
        for lease in leases:
            del self._by_lease[lease]
        return LeasesFreed(engine, tuple(leases))

    def released(self, engine: Engine, leases: Sequence[int]) -> LeasesFreed:
        """The engine's RELEASE: it is done with these kept leases; any other id (never
        made, already ended, another engine's, a running call's) is refused."""
        freed: list[int] = []
        refused = 0
        held, by_lease = self._held, self._by_lease
        for lease in leases:
            key = by_lease.get(lease)
            if key is None or key[0] != engine.peer:
                refused += 1
                continue
            del by_lease[lease]
            kept = held[key]
            kept.remove(lease)
            if not kept:
                del held[key]
            freed.append(lease)
        return LeasesFreed(engine, tuple(freed), refused)

    def for_call(self, engine: Engine, returns: Sequence[int], now: float) -> tuple[int, ...]:
        """The result leases the next CALL to ``engine`` carries in its header (those
        waiting and ``returns``); too many go in a RELEASE now instead."""
        pending, engine.releases = engine.releases, []
        unique = tuple(dict.fromkeys([*pending, *returns]))
        if len(unique) <= MAX_CALL_RELEASES:
            return unique
        self._send(engine, unique, now)
        return ()

    def give_back(self, engine: Engine, leases: Sequence[int]) -> bool:
        """We are done with the engine's result tensors under ``leases``: they go in the
        next CALL to it, or in a RELEASE at `release_pending`.

        Returns:
            True when nothing was waiting before: the shell calls `release_pending` once
            its caller yields (a CALL made before then carries them instead).
        """
        if not leases or not engine.alive or self.closed:
            return False
        if not engine.releases:
            self._returning.append(engine)
        engine.releases.extend(leases)
        first = not self.due
        self.due = True
        return first

    def release_pending(self, now: float) -> None:
        """RELEASE the result leases `give_back` took that no CALL carried."""
        engines, self._returning = self._returning, []
        self.due = False
        for engine in engines:
            if engine.releases:
                pending, engine.releases = engine.releases, []
                if engine.alive and not self.closed:
                    self._send(engine, pending, now)

    def release(self, engine: Engine, leases: Sequence[int], now: float) -> None:
        """RELEASE now, to ``engine``, these result leases and those waiting for a CALL."""
        if not engine.alive or self.closed:
            return
        if engine.releases:
            leases = [*engine.releases, *leases]
            engine.releases = []
        if leases:
            self._send(engine, leases, now)

    def engine_lost(self, engine: Engine) -> None:
        """The engine's session ended: it dropped our leases, and ours it kept end too
        (the shell frees that peer's leases)."""
        engine.releases = []
        if self._held:
            for key in [k for k in self._held if k[0] == engine.peer]:
                for lease in self._held.pop(key):
                    del self._by_lease[lease]

    def close(self) -> None:
        """The client closed: the engines drop our leases themselves."""
        self._held.clear()
        self._by_lease.clear()
        self.closed = True
