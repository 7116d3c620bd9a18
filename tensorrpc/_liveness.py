"""Liveness arithmetic shared by both ends, sans-I/O: heartbeat bounds and capped backoff.

Nothing here reads a clock: every time is a parameter (seconds, any monotonic origin).

Rules:

1. A side pings each peer at least `PINGS_PER_BOUND` times per the dead-after bound
   the *peer* announced, and never less often than its own heartbeat interval, so that no
   peer declares it dead while both are healthy.
2. Backoff doubles from its minimum up to its cap and starts again from the minimum after
   `Backoff.reset`.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MIN_PING_INTERVAL_S",
    "PINGS_PER_BOUND",
    "Backoff",
    "check_heartbeat",
    "ping_interval",
    "to_ms",
]

#: How many PINGs a side sends per dead-after bound of its peer.
PINGS_PER_BOUND: Final = 3
#: The shortest interval between two PINGs to one peer, whatever it announced.
MIN_PING_INTERVAL_S: Final = 0.01


def check_heartbeat(heartbeat_interval: float, dead_after: float) -> None:
    """Check a side's own liveness settings.

    Args:
        heartbeat_interval: Seconds between PINGs to each peer.
        dead_after: Seconds of silence after which a peer is declared dead.

    Raises:
        ValueError: Unless ``0 < heartbeat_interval < dead_after``.
    """
    if not heartbeat_interval > 0 or not dead_after > heartbeat_interval:
        raise ValueError("need 0 < heartbeat_interval < dead_after")


def to_ms(seconds: float) -> int:
    """A duration in whole milliseconds for the wire (at least 1, at most 2**32-1)."""
    return max(1, min(round(seconds * 1000), 0xFFFF_FFFF))


def ping_interval(own_interval: float, peer_dead_after_ms: int) -> float:
    """Seconds between PINGs to a peer that announced ``peer_dead_after_ms``.

    Args:
        own_interval: This side's heartbeat interval in seconds.
        peer_dead_after_ms: The peer's dead-after bound in milliseconds (at least 1).

    Returns:
        ``own_interval``, shortened so that the peer hears at least
        `PINGS_PER_BOUND` PINGs per its bound; never below
        `MIN_PING_INTERVAL_S`.
    """
    bound = peer_dead_after_ms / 1000 / PINGS_PER_BOUND
    return max(MIN_PING_INTERVAL_S, min(own_interval, bound))


class Backoff:
    """A capped exponential delay: ``minimum``, doubled per failure, at most ``cap``.

    Args:
        minimum: The first delay, in seconds.
        cap: The longest delay, in seconds.
    """

    __slots__ = ("_cap", "_delay", "_minimum")

    def __init__(self, minimum: float, cap: float) -> None:
        if not 0 < minimum <= cap:
            raise ValueError("need 0 < minimum <= cap")
        self._minimum = minimum
        self._cap = cap
        self._delay = minimum

    @property
    def delay(self) -> float:
        """The delay the next failure waits."""
        return self._delay

    def failed(self) -> float:
        """Return the delay to wait now and double the next one (up to the cap)."""
        delay = self._delay
        self._delay = min(delay * 2, self._cap)
        return delay

    def reset(self) -> None:
        """Start again from the minimum (after a success)."""
        self._delay = self._minimum
