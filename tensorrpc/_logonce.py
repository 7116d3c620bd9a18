"""Which repeated log lines were already said, sans-I/O: a bounded set of keys.

A refused engine (or client) retries its handshake every second; its refusal says the
same thing each time. `Said.first` tells a shell whether a line is new (log it at
WARNING) or a repeat (DEBUG). The set is bounded, oldest forgotten first, so strangers
that vary their ids cost constant memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Hashable

#: Keys remembered at most (the oldest is forgotten first, and may then be said again).
MAX_SAID: Final = 1024


class Said:
    """Keys of the lines already logged (at most ``limit``)."""

    __slots__ = ("_keys", "limit")

    def __init__(self, limit: int = MAX_SAID) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self.limit = limit

    def first(self, key: Hashable) -> bool:
        """Whether ``key`` is said for the first time (it is remembered from now on)."""
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            return False
        keys[key] = None
        while len(keys) > self.limit:
            keys.popitem(last=False)
        return True
