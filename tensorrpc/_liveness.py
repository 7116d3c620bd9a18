"""Liveness arithmetic, sans-I/O: heartbeat intervals, dead-after bounds, capped backoff.

Both ends of a connection use these rules (docs/protocol.md §9):

1. Each side announces in the handshake how long it waits before declaring the other dead
   (``dead_after_ms`` in HELLO and WELCOME; 0 means "not announced").
2. Each side pings often enough for the *other* side's bound: at its own
   ``heartbeat_interval``, or every third of the peer's bound when that is shorter, so
   that two pings in a row may be lost before the peer gives up.
3. Any well-formed message from a peer with a session counts as life.
4. Retries (a HELLO nobody answered, a first PING before the connection is up) back off
   exponentially from a floor to a cap and never faster than the floor.

Nothing here reads a clock: times are parameters, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff", "Heartbeat", "check_heartbeat", "ping_interval"]

#: Pings per peer bound: a peer hears from us at least this many times per bound.
PINGS_PER_BOUND = 3


def check_heartbeat(interval: float, dead_after: float) -> None:
    """Refuse a heartbeat interval and dead-after bound that cannot work together.

    Raises:
        ValueError: unless ``0 < interval < dead_after``.
    """
    if not interval > 0 or not dead_after > interval:
        raise ValueError(
            f"need 0 < heartbeat_interval < dead_after, got {interval!r} and {dead_after!r}"
        )


def ping_interval(own_interval: float, peer_dead_after: float) -> float:
    """Seconds between two PINGs to a peer that announced ``peer_dead_after`` (0: none)."""
    if peer_dead_after > 0:
        return min(own_interval, peer_dead_after / PINGS_PER_BOUND)
    return own_interval


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One side's liveness settings.

    Attributes:
        interval: Seconds between PINGs when the peer announced no shorter need.
        dead_after: Seconds of silence after which this side declares a peer dead;
            announced to the peer (in milliseconds) in the handshake.
    """

    interval: float = 1.0
    dead_after: float = 5.0

    def __post_init__(self) -> None:
        check_heartbeat(self.interval, self.dead_after)

    @property
    def interval_ms(self) -> int:
        """``interval`` in whole milliseconds (at least 1), as sent on the wire."""
        return max(1, int(self.interval * 1000))

    @property
    def dead_after_ms(self) -> int:
        """``dead_after`` in whole milliseconds (at least 1), as sent on the wire."""
        return max(1, int(self.dead_after * 1000))


class Backoff:
    """Capped exponential backoff: ``floor``, ``2·floor``, ... up to ``cap``.

    Args:
        floor: The first delay, in seconds (> 0).
        cap: The largest delay, in seconds (≥ ``floor``).
    """

    __slots__ = ("_next", "cap", "floor")

    def __init__(self, floor: float, cap: float) -> None:
        if not 0 < floor <= cap:
            raise ValueError(f"need 0 < floor <= cap, got {floor!r} and {cap!r}")
        self.floor = floor
        self.cap = cap
        self._next = floor

    def next(self) -> float:
        """The delay before the next attempt; each call doubles the following one."""
        delay = self._next
        self._next = min(delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        """Start again from ``floor`` (after a success)."""
        self._next = self.floor
