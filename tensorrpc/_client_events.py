"""What the client's protocol machine is configured with and what it reports, sans-I/O.

`tensorrpc._client_protocol.ClientProtocol` takes a `ClientConfig` and hands its shell the
events below through ``next_events`` (with the `tensorrpc._calls.Call` a reply resolved).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Final

from tensorrpc._calls import Call
from tensorrpc._liveness import Backoff, check_heartbeat
from tensorrpc._streams import CreditGranted

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from typing_extensions import Buffer

    from tensorrpc._engines import Balancing, Engine, EngineInfo
    from tensorrpc._protocol import Hello
    from tensorrpc.transports._peer import PeerFacts, ShmTerms

__all__ = [
    "DIAL_RETRY_MIN_S",
    "CheckReachable",
    "ClientConfig",
    "Dial",
    "Dropped",
    "EngineJoined",
    "EngineLost",
    "EngineRefused",
    "Event",
    "FactsNeeded",
    "Heartbeat",
    "Ignored",
    "LeasesFreed",
    "Peer",
    "PeerState",
    "Pong",
]

#: First retry delay of a hello request whose send failed (connection not up yet).
DIAL_RETRY_MIN_S: Final = 0.005


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One side's liveness settings.

    Attributes:
        interval: Seconds between PINGs when the peer announced no shorter need.
        dead_after: Seconds of silence after which a peer is declared dead; announced
            to the peer (in milliseconds) in the handshake.
    """

    interval: float = 1.0
    dead_after: float = 5.0

    def __post_init__(self) -> None:
        check_heartbeat(self.interval, self.dead_after)


_DEFAULT_HEARTBEAT: Final = Heartbeat()


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """What a client says in its WELCOMEs and expects of HELLOs, and its bounds (the
    `tensorrpc.Client` keywords of the same names). ``signatures`` (name → signature)
    let a fingerprint refusal name the methods that differ; ``engine_keys`` binds
    engine ids to the z85 CURVE key their HELLO must come with (None: first come);
    ``shm_transports`` is what our WELCOME lists to an engine we may use torch_shm with.
    """

    service: str
    fingerprint: str
    client_id: str
    host_id: str = ""
    pid: int = 0
    heartbeat: Heartbeat = _DEFAULT_HEARTBEAT
    stream_window: int = 16
    max_message_bytes: int = 0
    balancing: Balancing = "least_outstanding"
    max_in_flight: int = 1024
    schemaless: bool = False
    signatures: Mapping[str, str] | None = None
    engine_keys: Mapping[str, str] | None = None
    shm_transports: tuple[str, ...] = ("frames",)
    shm_trust_unattested: bool = False
    compression: tuple[str, ...] = ()
    #: Our bulk endpoint, announced in WELCOME with a per-session token (docs/design.md,
    #: "a bulk connection per peer"); "" when there is none.
    bulk_address: str = ""


@dataclass(frozen=True, slots=True)
class EngineJoined:
    """An engine was welcomed; ``shm``: torch_shm with it, as its HELLO's kernel
    facts decided (the shell links it: handles resolve against ``shm.kernel``)."""

    engine: Engine
    shm: ShmTerms | None = None


@dataclass(frozen=True, slots=True)
class EngineLost:
    """An engine's session ended; ``calls`` are the calls that failed with it."""

    engine: Engine
    why: str
    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class EngineRefused:
    """A handshake was refused: by us (``by_client``) or by the engine (its REJECT)."""

    engine_id: str
    reason: str
    message: str
    by_client: bool


@dataclass(frozen=True, slots=True)
class Dropped:
    """A RESULT or STREAM_ITEM nobody will decode (its ``torch_shm`` leases need release).

    ``call`` is the call it ended on a protocol violation, if any.
    """

    engine: Engine
    payload: Buffer
    buffers: Sequence[Buffer]
    call: Call | None = None
    #: The call id of a reply to no call in flight (a call we gave up on, perhaps).
    call_id: int = 0


@dataclass(frozen=True, slots=True)
class LeasesFreed:
    """Argument leases of calls we gave up on that the engine is done with (its RELEASE,
    or a late reply): the shell frees their memory. ``refused`` counts the ids of a
    RELEASE that named no lease kept for this engine (nothing freed for them)."""

    engine: Engine
    leases: tuple[int, ...]
    refused: int = 0


@dataclass(frozen=True, slots=True)
class CheckReachable:
    """A HELLO names an engine id live on another peer: is that peer still reachable?

    A PING to ``peer`` is queued in `frames_to_send`; the shell sends what is queued
    without waiting and answers `ClientProtocol.reachable` with whether that PING went:
    a live engine keeps its id (the HELLO is refused as ``duplicate_id``), a gone one is
    replaced.
    """

    peer: bytes
    #: The peer whose HELLO waits for the answer, and what it said.
    hello_peer: bytes
    hello: Hello
    info: EngineInfo
    current: Engine
    #: What the shell gathered about the HELLO's connection (torch_shm's input).
    facts: PeerFacts | None


@dataclass(frozen=True, slots=True)
class Pong:
    """An engine answered one of our heartbeat PINGs (sent at ``nonce`` nanoseconds)."""

    engine: Engine
    nonce: int


@dataclass(frozen=True, slots=True)
class FactsNeeded:
    """A HELLO came while torch_shm is on here and ``receive`` was given no facts: the
    shell gathers what the kernel says about the connection it came on and gives the
    same message (``frames``, ``key``) to ``receive`` again with them (nothing was done
    with it yet)."""

    peer: bytes
    frames: Sequence[Buffer]
    key: str | None = None


@dataclass(frozen=True, slots=True)
class Ignored:
    """A message that was dropped; ``why`` is for the log."""

    peer: bytes
    why: str


#: What `ClientProtocol.next_events` gives; a `Call` there is one a reply (or the
#: client's end) concerned: its state says what happened (the hot path allocates no
#: event for it).
Event = (
    Call
    | CreditGranted
    | EngineJoined
    | EngineLost
    | EngineRefused
    | CheckReachable
    | Dropped
    | LeasesFreed
    | Pong
    | Ignored
    | FactsNeeded
)


class Dial:
    """An address the client dials: its hello-request schedule."""

    __slots__ = ("address", "backoff", "due")

    def __init__(self, address: str, interval: float) -> None:
        self.address = address
        self.backoff = Backoff(DIAL_RETRY_MIN_S, max(DIAL_RETRY_MIN_S, interval))
        self.due = 0.0


class PeerState(Enum):
    """Where the client stands with one routing id (docs/protocol.md §13)."""

    #: No session, not dialled (never stored).
    NONE = "none"
    #: An address we dial, no session yet.
    DIALING = "dialing"
    #: A welcomed engine.
    LIVE = "live"


class Peer:
    """One routing id the client dials or has a session with: its one state field."""

    __slots__ = ("dial", "engine", "state")

    def __init__(self, state: PeerState, dial: Dial | None = None) -> None:
        self.state = state
        self.dial = dial
        self.engine: Engine | None = None
