"""Client-side routing decisions, free of I/O: engine registry, handshake checks, balancing.

The client's I/O shell (`_client`) asks this module what to do and then does
it; nothing here touches a socket, a clock or an event loop (times are passed in).

Invariants:

1. An engine id maps to at most one *live* engine; a second HELLO under a live id is
   refused (``duplicate_id``) and the first engine keeps its place.
2. An engine leaves the registry when it is declared dead or says BYE; its id is then free.
3. ``in_flight`` of an engine equals the number of calls started on it and not yet ended;
   a call is ended exactly once (``end_call`` ignores unknown call ids).
4. Selection never returns an engine whose ``in_flight`` is at the per-engine bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tensorrpc._exceptions import EngineNotFoundError
from tensorrpc._protocol import MAX_SIGNATURE_CHARS

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "Balancing",
    "EngineInfo",
    "EngineRegistry",
    "EngineState",
    "StreamCredit",
    "check_hello",
]

#: Balancing policies for calls that do not name an engine.
Balancing = Literal["least_outstanding", "round_robin"]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine said about itself in its HELLO.

    Attributes:
        engine_id: The engine's id, unique among the live engines of one client.
        service: The service name the engine serves.
        fingerprint: Schema fingerprint of the engine's service.
        protocol_version: Wire protocol version the engine speaks.
        host_id: Identifies the engine's host (same value means same machine).
        pid: The engine's process id.
        transports: Tensor transports the engine offers.
        concurrency: How many calls the engine runs at once.
        heartbeat_ms: The engine's heartbeat interval.
        methods: Method names the engine serves.
        address: The address the client dialled to reach it, or ``None`` when the engine
            dialled in.
        streaming: The names of the methods that stream (meaningful only when
            ``signatures`` is not empty: older engines announce neither).
        signatures: One signature per entry of ``methods``, in the same order
            (``"add(a: int, b: int = 1) -> int"``), or empty when not announced.
        max_message_bytes: The largest message frame the engine accepts (its
            ``maxmsgsize``), or 0 when it has no limit or did not announce one.
        features: Optional protocol features the engine announced (``"trace_context"``,
            ``"statistics"``); empty for engines that predate them.
    """

    engine_id: str
    service: str
    fingerprint: str
    protocol_version: int
    host_id: str = ""
    pid: int = 0
    transports: tuple[str, ...] = ()
    concurrency: int = 0
    heartbeat_ms: int = 0
    methods: tuple[str, ...] = ()
    address: str | None = None
    streaming: tuple[str, ...] = ()
    signatures: tuple[str, ...] = ()
    max_message_bytes: int = 0
    features: tuple[str, ...] = ()


def check_hello(
    info: EngineInfo,
    *,
    service: str,
    fingerprint: str,
    protocol_version: int,
    signatures: Mapping[str, str] | None = None,
) -> tuple[str, str] | None:
    """Compare an engine's HELLO against what the client expects.

    Args:
        info: What the engine said.
        service: The client's service name.
        fingerprint: The client's schema fingerprint.
        protocol_version: The client's protocol version.
        signatures: The client's methods (name → signature); when given, a fingerprint
            mismatch names the methods that differ (see `schema_diff`).

    Returns:
        ``None`` when the engine is acceptable, else ``(reason, message)`` where ``reason``
        is a REJECT code (``"version"``, ``"service"``, ``"fingerprint"``) and ``message``
        says what differs (``"engine 'e1' has schema fingerprint X, client expects Y"``).
    """
    if info.protocol_version != protocol_version:
        return (
            "version",
            f"engine {info.engine_id!r} speaks protocol version {info.protocol_version}, "
            f"client speaks {protocol_version}",
        )
    if info.service != service:
        return (
            "service",
            f"engine {info.engine_id!r} serves {info.service!r}, client expects {service!r}",
        )
    if info.fingerprint != fingerprint:
        diff = schema_diff(signatures, info) if signatures is not None else ""
        return (
            "fingerprint",
            f"engine {info.engine_id!r} has schema fingerprint {info.fingerprint}, "
            f"client expects {fingerprint} ("
            + (diff or "the service's method signatures differ")
            + ")",
        )
    return None


#: Most methods named per category in a `schema_diff` (the rest are counted).
_DIFF_NAMES = 8


def schema_diff(ours: Mapping[str, str], info: EngineInfo) -> str:
    """Say which methods differ between the client's service and an engine's HELLO.

    Args:
        ours: The client's methods: name → signature (``MethodSpec.signature``).
        info: The engine's HELLO (its ``methods`` and, from engines that announce them,
            ``signatures``).

    Returns:
        ``"engine adds: ...; engine lacks: ...; changed: name: engine `...`, client
        `...`"`` (the parts that apply, at most 8 names each), or a sentence saying that
        the names and announced signatures are the same (the difference is then in types
        they name, such as a dataclass's fields).
    """
    theirs = dict.fromkeys(info.methods, "")
    if len(info.signatures) == len(info.methods):
        theirs = dict(zip(info.methods, info.signatures, strict=True))
    parts: list[str] = []
    added = [name for name in theirs if name not in ours]
    removed = [name for name in ours if name not in theirs]
    changed = [
        name
        for name in ours
        if name in theirs and theirs[name] and theirs[name] != _announced(ours[name])
    ]
    if added:
        parts.append("engine adds: " + _names(added, theirs))
    if removed:
        parts.append("engine lacks: " + _names(removed, ours))
    if changed:
        shown = "; ".join(
            f"{name}: engine `{theirs[name]}`, client `{_announced(ours[name])}`"
            for name in changed[:_DIFF_NAMES]
        )
        more = len(changed) - _DIFF_NAMES
        parts.append("changed: " + shown + (f"; and {more} more" if more > 0 else ""))
    if not parts:
        if not info.signatures:
            return "the engine does not announce its signatures; the method names are the same"
        return (
            "the method names and signatures are the same: the difference is in types "
            "they name (a dataclass's fields, an enum's values)"
        )
    return "; ".join(parts)


def _announced(signature: str) -> str:
    # What an engine puts in HELLO for this signature (it cuts long ones).
    if len(signature) <= MAX_SIGNATURE_CHARS:
        return signature
    return signature[: MAX_SIGNATURE_CHARS - 5] + " ..."


def _names(names: list[str], signatures: Mapping[str, str]) -> str:
    shown = ", ".join(f"`{signatures[n]}`" if signatures[n] else n for n in names[:_DIFF_NAMES])
    more = len(names) - _DIFF_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


@dataclass(slots=True, eq=False)
class EngineState:
    """One live engine as the client tracks it (mutable; owned by the registry)."""

    #: What the engine said in HELLO.
    info: EngineInfo
    #: ZMQ routing id of the engine's peer on the client's ROUTER socket.
    peer: bytes
    #: Monotonic time of the last message received from the engine.
    last_seen: float
    #: Call ids in flight on this engine (unary calls and streams).
    calls: set[int] = field(default_factory=set)
    #: Calls started on this engine.
    calls_total: int = 0
    #: Calls that ended in an error.
    errors: int = 0
    #: Bytes sent to the engine (headers, payloads and tensor frames).
    bytes_sent: int = 0
    #: Bytes received from the engine.
    bytes_received: int = 0
    #: False once the engine is dead or gone.
    alive: bool = True

    @property
    def engine_id(self) -> str:
        """The engine's id."""
        return self.info.engine_id

    @property
    def in_flight(self) -> int:
        """Number of calls in flight on this engine."""
        return len(self.calls)


class EngineRegistry:
    """The live engines of one client and the balancing decision between them.

    Args:
        balancing: ``"least_outstanding"`` (default) or ``"round_robin"``.
        max_in_flight: Bound on calls in flight per engine (at least 1).
    """

    def __init__(self, *, balancing: Balancing = "least_outstanding", max_in_flight: int) -> None:
        if balancing not in ("least_outstanding", "round_robin"):
            raise ValueError(f"unknown balancing policy {balancing!r}")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.balancing: Balancing = balancing
        self.max_in_flight = max_in_flight
        self._engines: dict[str, EngineState] = {}
        self._by_peer: dict[bytes, EngineState] = {}
        self._order: list[EngineState] = []
        self._cursor = 0
        #: engine id -> why it was refused at handshake (latest refusal wins).
        self.rejected: dict[str, str] = {}

    # -- membership ---------------------------------------------------------------------

    @property
    def engines(self) -> dict[str, EngineState]:
        """Live engines by id (the registry's own dict: do not mutate)."""
        return self._engines

    def live_ids(self) -> tuple[str, ...]:
        """Ids of the live engines, sorted."""
        return tuple(sorted(self._engines))

    def by_peer(self, peer: bytes) -> EngineState | None:
        """The live engine behind a routing id, if any."""
        return self._by_peer.get(peer)

    def admit(
        self,
        info: EngineInfo,
        peer: bytes,
        now: float,
        *,
        service: str,
        fingerprint: str,
        protocol_version: int,
        signatures: Mapping[str, str] | None = None,
    ) -> EngineState | tuple[str, str]:
        """Decide on a HELLO: admit the engine, or say why it is refused.

        A HELLO from a peer that is already the live engine of that id (a repeated HELLO)
        returns the existing state unchanged.

        Returns:
            The new (or existing) `EngineState`, or ``(reason, message)`` for a
            REJECT; refusals are also recorded in `rejected` as ``"reason: message"``.
        """
        current = self._engines.get(info.engine_id)
        if current is not None and current.peer == peer:
            current.last_seen = now
            return current
        refusal = check_hello(
            info,
            service=service,
            fingerprint=fingerprint,
            protocol_version=protocol_version,
            signatures=signatures,
        )
        if refusal is None and current is not None:
            refusal = (
                "duplicate_id",
                f"engine id {info.engine_id!r} is already served by a live "
                f"engine (pid {current.info.pid}); a restart may reuse it once that one is dead",
            )
        if refusal is None and peer in self._by_peer:
            old = self._by_peer[peer]
            refusal = (
                "other",
                f"peer already registered as engine {old.engine_id!r}",
            )
        if refusal is not None:
            self.rejected[info.engine_id] = f"{refusal[0]}: {refusal[1]}"
            return refusal
        state = EngineState(info=info, peer=peer, last_seen=now)
        self._engines[info.engine_id] = state
        self._by_peer[peer] = state
        self._order.append(state)
        self.rejected.pop(info.engine_id, None)
        return state

    def remove(self, engine_id: str) -> EngineState | None:
        """Take an engine out (dead or gone); its id becomes free.

        Returns:
            The removed state (its ``calls`` are the calls to fail), or ``None``.
        """
        state = self._engines.pop(engine_id, None)
        if state is None:
            return None
        state.alive = False
        self._by_peer.pop(state.peer, None)
        index = self._order.index(state)
        del self._order[index]
        if index < self._cursor:
            self._cursor -= 1
        return state

    def expired(self, now: float, dead_after: float) -> list[EngineState]:
        """Engines silent for longer than ``dead_after`` seconds (not removed here)."""
        limit = now - dead_after
        return [s for s in self._order if s.last_seen < limit]

    # -- selection ----------------------------------------------------------------------

    def select(self, engine_id: str | None) -> EngineState | None:
        """Pick the engine for a new call.

        Args:
            engine_id: The engine the call targets, or ``None`` to balance.

        Returns:
            The engine to use, or ``None`` when every candidate is at its in-flight bound
            (the caller waits or fails with OverloadedError).

        Raises:
            EngineNotFoundError: The targeted engine is not live, or no engine is live.
        """
        if engine_id is not None:
            state = self._engines.get(engine_id)
            if state is None:
                live = self.live_ids()
                raise EngineNotFoundError(
                    f"engine {engine_id!r} is not live; live engines: "
                    f"{', '.join(live) if live else '(none)'}",
                    live=live,
                )
            return state if len(state.calls) < self.max_in_flight else None
        order = self._order
        count = len(order)
        if count == 0:
            raise EngineNotFoundError("no live engines", live=())
        limit = self.max_in_flight
        start = self._cursor % count
        self._cursor = start + 1
        if self.balancing == "round_robin":
            for offset in range(count):
                state = order[(start + offset) % count]
                if len(state.calls) < limit:
                    self._cursor = start + offset + 1
                    return state
            return None
        # Least outstanding; ties go to the engine after the previous pick so that an idle
        # pool is used evenly rather than always hitting the first engine.
        best: EngineState | None = None
        best_load = limit
        for offset in range(count):
            state = order[(start + offset) % count]
            load = len(state.calls)
            if load < best_load:
                best, best_load = state, load
                if load == 0:
                    break
        return best

    def has_capacity(self, engine_id: str | None) -> bool:
        """Whether a call (targeted or balanced) could start now, without side effects."""
        if engine_id is not None:
            state = self._engines.get(engine_id)
            return state is None or len(state.calls) < self.max_in_flight
        return not self._order or any(len(s.calls) < self.max_in_flight for s in self._order)


class StreamCredit:
    """Flow-control credit on the client side of one stream.

    The engine may have up to ``window`` items sent and not yet granted back. The client
    grants credit in batches of about half a window as the consumer takes items, so that
    the engine keeps streaming while the consumer keeps up and stops when it does not.

    Args:
        window: Initial credit the engine was given (WELCOME's ``stream_window``).
    """

    __slots__ = ("_batch", "_pending", "window")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("stream window must be at least 1")
        self.window = window
        self._batch = max(1, window // 2)
        self._pending = 0

    def consumed(self, n: int = 1) -> int:
        """Record that the consumer took ``n`` items.

        Returns:
            The credit to send to the engine now (0: send nothing yet).
        """
        self._pending += n
        if self._pending >= self._batch:
            grant, self._pending = self._pending, 0
            return grant
        return 0


def unavailable_message(
    live: int,
    count: int,
    timeout: float | None,
    rejected: Mapping[str, str],
    failures: Sequence[str] = (),
) -> str:
    """The text of the error ``wait_for_engines`` raises when it gives up.

    Args:
        live: Engines live now.
        count: Engines waited for.
        timeout: The wait's timeout (seconds).
        rejected: Refused engine id → ``"reason: message"``.
        failures: Failed handshakes on the client's socket (CURVE refusals), most recent
            last; the last three distinct ones are named.

    Returns:
        ``"0 of 2 engines live after 5.0 s; refused: e1: fingerprint: ..."``, or, when
        none is live and engines were refused, ``"0 of 2 engines live: every engine
        that tried to join was refused; refused: ..."``.
    """
    if rejected and not live:
        text = f"{live} of {count} engines live: every engine that tried to join was refused"
    else:
        text = f"{live} of {count} engines live after {timeout} s"
    if rejected:
        text += "; refused: " + "; ".join(f"{k}: {v}" for k, v in sorted(rejected.items()))
    if failures:
        distinct = list(dict.fromkeys(reversed(failures)))[:3]
        text += "; handshakes failed (CURVE): " + "; ".join(reversed(distinct))
    return text
