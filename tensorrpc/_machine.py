"""The output convention both protocol machines share (h11's shape), sans-I/O.

Inputs return nothing; every frame comes out of `Machine.frames_to_send` and every event
out of `Machine.next_events`, in order (docs/internals.md, "One output convention")."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from tensorrpc._protocol import MessageKind, Release, encode_control

if TYPE_CHECKING:
    from collections.abc import Hashable, Iterable, Sequence

__all__ = [
    "MAX_RELEASE_LEASES",
    "Machine",
    "Send",
    "Transition",
    "release_frames",
    "render_transitions",
]

#: Lease ids per RELEASE message (docs/protocol.md §4, Release): longer lists are split.
MAX_RELEASE_LEASES: Final = 4096

P = TypeVar("P", bound="Hashable")
E = TypeVar("E")
S = TypeVar("S", bound=Enum)

#: One message to send: the peer (routing id or key) and its frames after the routing id.
Send = tuple[P, list[Any]]


class Machine(Generic[P, E]):
    """Frames to send (to peers named by a ``P``) and events (``E``), queued by a
    protocol machine for its shell."""

    def __init__(self) -> None:
        self._sends: list[Send[P]] = []
        self._events: list[E] = []

    @property
    def pending(self) -> bool:
        """Whether frames or events wait for the shell."""
        return bool(self._sends or self._events)

    def frames_to_send(self) -> list[Send[P]]:
        """Take the messages to send, each ``(peer, frames)``, oldest first."""
        out, self._sends = self._sends, []
        return out

    def next_events(self) -> list[E]:
        """Take the events since the shell last looked, oldest first."""
        out, self._events = self._events, []
        return out


def release_frames(leases: Sequence[int]) -> list[list[bytes]]:
    """RELEASE messages naming ``leases`` (each id once), split at `MAX_RELEASE_LEASES`."""
    unique = tuple(dict.fromkeys(leases))
    return [
        encode_control(MessageKind.RELEASE, Release(unique[i : i + MAX_RELEASE_LEASES]))
        for i in range(0, len(unique), MAX_RELEASE_LEASES)
    ]


@dataclass(frozen=True, slots=True)
class Transition(Generic[S]):
    """One row of a machine's transition table (docs/protocol.md renders the tables).

    ``kinds`` are the message kinds the machine dispatches the row on: rows that share a
    (state, kind) share a handler, which tells them apart (the ``input`` says how);
    empty for a timer, a local input, or a row about every kind.
    """

    state: S
    kinds: tuple[MessageKind, ...]
    input: str
    action: str
    next: S


def render_transitions(rows: Iterable[Transition[Any]]) -> str:
    """The Markdown table docs/protocol.md shows for ``rows``."""
    lines = ["| state | input | action | next state |", "|---|---|---|---|"]
    lines += [f"| {r.state.value} | {r.input} | {r.action} | {r.next.value} |" for r in rows]
    return "\n".join(lines) + "\n"
