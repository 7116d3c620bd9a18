"""The client's engine table, sans-I/O: admission, aliases, counters, liveness, capacity.

The client's protocol machine (`tensorrpc._client_protocol`) asks this module what to
do and then does it; nothing here touches a socket, a clock or an event loop (times are
parameters, in seconds).

Invariants:

1. An engine id maps to at most one *live* engine, and a routing id (peer) to at most one.
2. An engine leaves the table when it is declared dead, says BYE, refuses us, becomes
   unreachable or is replaced by a new session at its peer; its id is then free.
3. ``in_flight`` of an engine equals the number of its calls in the call table.
4. Selection never returns an engine whose ``in_flight`` is at the per-engine bound.
5. Every table fed by strangers is bounded: refusals keep the latest
   `MAX_REJECTED` entries with their text cut to a fixed length, the counters of
   departed engines the latest `MAX_PAST` ids. A peer that is refused costs
   constant memory whatever it sends.
6. Capacity waits are woken one at a time: a freed slot wakes at most one waiter.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from tensorrpc._exceptions import EngineNotFoundError
from tensorrpc._protocol import MAX_SIGNATURE_CHARS
from tensorrpc._text import peer_text

if TYPE_CHECKING:
    from collections.abc import Hashable, Mapping, Sequence

__all__ = [
    "BYE_BULK",
    "BYE_CONTROL",
    "CONTROL_GONE",
    "MAX_PAST",
    "MAX_REJECTED",
    "Balancing",
    "CapacityWaiters",
    "Engine",
    "EngineInfo",
    "EngineTable",
    "FifoSet",
    "PastEngine",
    "Rejoins",
    "ShmCapability",
    "check_hello",
    "schema_diff",
    "unavailable_message",
]

#: Balancing policies for calls that do not name an engine.
Balancing = Literal["least_outstanding", "round_robin"]

#: Most refusals remembered (the oldest is forgotten first).
MAX_REJECTED: Final = 64
#: Most departed engine ids whose counters are kept for statistics.
MAX_PAST: Final = 1024
#: `Engine.byes`: a BYE came on the control connection, on the bulk connection; a send
#: on control failed while a bulk connection was bound (its BYE may be unread behind it).
BYE_CONTROL: Final = 1
BYE_BULK: Final = 2
CONTROL_GONE: Final = 4
#: Longest engine id kept as a key of the refusals, and longest refusal text, in chars.
MAX_REJECTED_KEY: Final = 128
MAX_REJECTED_TEXT: Final = 2048


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
        streaming: The names of the methods that stream.
        signatures: One signature per entry of ``methods``, in the same order
            (``"add(a: int, b: int = 1) -> int"``; cut, or empty, when the HELLO was
            too long).
        max_message_bytes: The largest message frame the engine accepts (its
            ``maxmsgsize``), or 0 when it has no limit.
        dead_after_ms: How long the engine waits without hearing from this client before
            it forgets it.
        compression: Compression codecs the engine decodes (``"zstd"``); empty: none.
        request_streaming: The names of the methods whose request is a stream.
        stream_window: Request stream items the client may send per stream before it
            needs the engine's CREDIT.
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
    dead_after_ms: int = 5000
    compression: tuple[str, ...] = ()
    request_streaming: tuple[str, ...] = ()
    stream_window: int = 16


def check_hello(
    info: EngineInfo,
    *,
    service: str,
    fingerprint: str,
    protocol_version: int,
    signatures: Mapping[str, str] | None = None,
) -> tuple[str, str] | None:
    """Compare an engine's HELLO against what the client expects: None when it is
    acceptable, else ``(reason, message)``, a REJECT code (``"version"``, ``"service"``,
    ``"fingerprint"``) and what differs (with ``signatures``, the client's methods by
    name, a fingerprint mismatch names the methods that differ: `schema_diff`)."""
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
        # The readable diff first; the hashes (64 hex) only shortened, for grepping.
        return (
            "fingerprint",
            f"engine {info.engine_id!r} has a different schema: "
            + (diff or "the service's method signatures differ")
            + f" (fingerprint {_short(info.fingerprint)}, client expects {_short(fingerprint)})",
        )
    return None


#: Hex digits of a fingerprint shown in messages (enough to tell two schemas apart).
SHORT_FINGERPRINT = 12


def _short(fingerprint: str) -> str:
    return fingerprint[:SHORT_FINGERPRINT] if len(fingerprint) > SHORT_FINGERPRINT else fingerprint


#: Most methods named per category in a `schema_diff` (the rest are counted).
_DIFF_NAMES = 8


def schema_diff(ours: Mapping[str, str], info: EngineInfo) -> str:
    """Which methods differ between ours (name → signature) and an engine's HELLO:
    ``"engine adds: ...; engine lacks: ...; changed: name: engine `...`, client `...`"``
    (the parts that apply, at most 8 names each), or a sentence saying that names and
    signatures are the same (the difference is in types they name)."""
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
        if not all(info.signatures):
            return "the method names are the same; the engine's HELLO cut its signatures"
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


@dataclass(slots=True)
class ShmCapability:
    """``torch_shm`` with one engine, as decided at handshake from the kernel's
    credentials of its connection.

    Attributes:
        pid: The engine process whose handles we resolve (as the kernel attested it).
        to_engine: We may send argument tensors by handle (cleared when the engine fails
            to attach to one).
        from_engine: The engine may send result tensors by handle (cleared when we fail
            to attach to one).
    """

    pid: int
    to_engine: bool = True
    from_engine: bool = True


@dataclass(slots=True, eq=False)
class Engine:
    """One live engine session as the client tracks it (mutable; owned by the table)."""

    #: What the engine said in HELLO.
    info: EngineInfo
    #: ZMQ routing id of the engine's peer on the client's ROUTER socket.
    peer: bytes
    #: The engine's session epoch (HELLO ``epoch``).
    epoch: int = 0
    #: Our session epoch with this engine (sent in WELCOME).
    client_epoch: int = 0
    #: When we last heard a well-formed message from the engine.
    heard: float = 0.0
    #: When we last sent the engine anything.
    sent: float = 0.0
    #: When the next heartbeat PING is due.
    next_ping: float = 0.0
    #: Seconds between heartbeats to this engine (ours, or less for its bound).
    ping_every: float = 1.0
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
    #: ``torch_shm`` with this engine, or ``None`` when not usable.
    shm: ShmCapability | None = None
    #: The transports our WELCOME to this engine lists (said again on a repeated HELLO).
    welcome_transports: tuple[str, ...] = ("frames",)
    #: The bulk token our WELCOME gives this session (b"": we announce no bulk endpoint).
    bulk_token: bytes = b""
    #: The engine's HELLO ``(bulk, bulk_token)``: its bulk endpoint and our token there.
    bulk_offer: tuple[str, str] = ("", "")
    #: The session's bulk connection is bound: a draining engine's BYE comes on it too.
    bulk_bound: bool = False
    #: The connections a BYE came on (`BYE_CONTROL`, `BYE_BULK`): non-zero, the engine is
    #: leaving (no new calls) and waits for the other BYE (design rule 4).
    byes: int = 0
    #: Result leases we are done with and have not returned yet (protocol §4 RELEASE,
    #: or the ``RELEASES`` bits of our next CALL).
    releases: list[int] = field(default_factory=list)
    #: The largest frame both ends take (0: no limit; -1: not known, check in full).
    frame_limit: int = -1
    #: The engine's id (``info.engine_id``; a field: read on every call).
    engine_id: str = field(init=False)
    #: The engine's announced bound in seconds: how long we may send it nothing before
    #: it forgets the session.
    dead_after: float = field(init=False)

    def __post_init__(self) -> None:
        self.engine_id = self.info.engine_id
        self.dead_after = self.info.dead_after_ms / 1000

    @property
    def in_flight(self) -> int:
        """Number of calls in flight on this engine."""
        return len(self.calls)

    def __repr__(self) -> str:
        return f"<Engine {self.engine_id!r} peer={self.peer!r}>"


@dataclass(slots=True)
class PastEngine:
    """Counters of an engine id summed over its sessions that ended."""

    calls: int = 0
    errors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class EngineTable:
    """The live engines of one client, their departed counters, refusals and balancing.

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
        self._engines: dict[str, Engine] = {}
        self._by_peer: dict[bytes, Engine] = {}
        self._order: list[Engine] = []
        self._cursor = 0
        #: Engine id -> why it was refused (latest refusal; at most MAX_REJECTED).
        self.rejected: OrderedDict[str, str] = OrderedDict()
        #: Refusals since the client opened (also those no longer in ``rejected``).
        self.rejected_total = 0
        #: Engine id -> counters of its ended sessions (at most MAX_PAST ids).
        self.past: OrderedDict[str, PastEngine] = OrderedDict()

    # -- membership ---------------------------------------------------------------------

    @property
    def engines(self) -> dict[str, Engine]:
        """Live engines by id (the table's own dict: do not mutate)."""
        return self._engines

    def live_ids(self) -> tuple[str, ...]:
        """Ids of the live engines, sorted."""
        return tuple(sorted(self._engines))

    def by_peer(self, peer: bytes) -> Engine | None:
        """The live engine behind a routing id, if any."""
        return self._by_peer.get(peer)

    def add(self, engine: Engine) -> None:
        """Enter an admitted engine; its id and peer must be free."""
        assert engine.engine_id not in self._engines
        assert engine.peer not in self._by_peer
        self._engines[engine.engine_id] = engine
        self._by_peer[engine.peer] = engine
        self._order.append(engine)
        self.rejected.pop(engine.engine_id, None)

    def refuse(self, engine_id: str, reason: str, message: str) -> None:
        """Remember a refusal (bounded: the oldest is forgotten first)."""
        key = peer_text(engine_id, MAX_REJECTED_KEY)
        rejected = self.rejected
        rejected.pop(key, None)
        rejected[key] = peer_text(f"{reason}: {message}", MAX_REJECTED_TEXT)
        while len(rejected) > MAX_REJECTED:
            rejected.popitem(last=False)
        self.rejected_total += 1

    def remove(self, engine: Engine) -> bool:
        """Take a live engine out (dead or gone); its id becomes free.

        Returns:
            False when it was not live (already removed).
        """
        if self._engines.get(engine.engine_id) is not engine:
            return False
        del self._engines[engine.engine_id]
        engine.alive = False
        self._by_peer.pop(engine.peer, None)
        index = self._order.index(engine)
        del self._order[index]
        if index < self._cursor:
            self._cursor -= 1
        past = self.past.pop(engine.engine_id, None) or PastEngine()
        past.calls += engine.calls_total
        past.errors += engine.errors
        past.bytes_sent += engine.bytes_sent
        past.bytes_received += engine.bytes_received
        self.past[engine.engine_id] = past
        while len(self.past) > MAX_PAST:
            self.past.popitem(last=False)
        return True

    def expired(self, now: float, dead_after: float) -> list[Engine]:
        """Engines not heard from for longer than ``dead_after`` seconds (not removed)."""
        limit = now - dead_after
        return [e for e in self._order if e.heard < limit]

    def forgot_us(self, now: float) -> list[Engine]:
        """Engines we sent nothing to for longer than their own bound.

        Such an engine has forgotten this client (and cancelled its calls), whatever it
        says next; this happens when the client's event loop stalls.
        """
        return [e for e in self._order if now - e.sent > e.dead_after]

    # -- selection ----------------------------------------------------------------------

    def select(self, engine_id: str | None) -> Engine | None:
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
            engine = self._engines.get(engine_id)
            if engine is None:
                live = self.live_ids()
                raise EngineNotFoundError(
                    f"engine {engine_id!r} is not live ({self.absence(engine_id)}); live "
                    f"engines: {', '.join(live) if live else '(none)'}",
                    live=live,
                )
            return engine if len(engine.calls) < self.max_in_flight else None
        order = self._order
        count = len(order)
        if count == 0:
            raise EngineNotFoundError(f"no live engines: {self.absence(None)}", live=())
        limit = self.max_in_flight
        start = self._cursor % count
        self._cursor = start + 1
        if self.balancing == "round_robin":
            for offset in range(count):
                engine = order[(start + offset) % count]
                if len(engine.calls) < limit and not engine.byes:
                    self._cursor = start + offset + 1
                    return engine
            return None
        # Least outstanding; ties go to the engine after the previous pick so that an idle
        # pool is used evenly rather than always hitting the first engine.
        best: Engine | None = None
        best_load = limit
        for offset in range(count):
            engine = order[(start + offset) % count]
            load = len(engine.calls)
            if load < best_load and not engine.byes:
                best, best_load = engine, load
                if load == 0:
                    break
        return best

    def absence(self, engine_id: str | None) -> str | None:
        """Why no engine can take a call for ``engine_id`` (``None``: any engine).

        Returns:
            ``None`` when one is live, else what the table knows: the engine (or every
            engine) left and has not rejoined, which is what a restart looks like; it
            was refused, with the refusal; or it never joined.
        """
        if engine_id is not None:
            if engine_id in self._engines:
                return None
            if engine_id in self.rejected:
                return f"it was refused: {self.rejected[engine_id]}"
            if engine_id in self.past:
                return "it left (died or stopped) and has not rejoined yet: restarting?"
            return "it never joined"
        if self._engines:
            return None
        reasons: list[str] = []
        if self.past:
            gone = list(self.past)[-_ABSENT_NAMES:]
            reasons.append(
                f"{_count(len(self.past), 'engine')} left (died or stopped) and none has "
                f"rejoined yet: restarting? ({', '.join(map(repr, gone))})"
            )
        if self.rejected:
            refused = list(self.rejected.items())[-_ABSENT_NAMES:]
            reasons.append(
                "every engine that tried to join was refused: "
                + "; ".join(f"{k}: {v}" for k, v in refused)
            )
        return "; ".join(reasons) or "no engine has joined yet"


#: Engines named in an `EngineTable.absence` text (the latest; the rest are counted).
_ABSENT_NAMES: Final = 3


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Rejoins:
    """Engines expected back after they forgot this client's session (the client stalled).

    An entry's wait starts at the first `expire` after the loss, since the loop that
    found the loss may still be busy (with the very calls that stalled it); ``None``
    marks a wait not started yet.

    Args:
        wait: Seconds to wait for each engine (the client's ``dead_after``).
    """

    __slots__ = ("_wait", "until")

    def __init__(self, wait: float) -> None:
        self._wait = wait
        #: Engine id -> until when callers wait for it (None: not started).
        self.until: dict[str, float | None] = {}

    def forgotten(self, engine_id: str) -> None:
        """``engine_id`` forgot the session: wait for it to rejoin."""
        self.until[engine_id] = None

    def rejoined(self, engine_id: str) -> None:
        """``engine_id`` is live again."""
        self.until.pop(engine_id, None)

    def expected(self, engine_id: str | None, now: float | None) -> bool:
        """Whether ``engine_id`` (None: any engine) is expected back at ``now``."""
        until = self.until
        if not until or now is None:
            return False
        if engine_id is None:
            return any(t is None or t > now for t in until.values())
        if engine_id not in until:
            return False
        t = until[engine_id]
        return t is None or t > now

    def expire(self, now: float) -> list[str]:
        """Start the waits not started; end those past due: their engine ids."""
        until = self.until
        gone: list[str] = []
        for engine_id, t in list(until.items()):
            if t is None:
                until[engine_id] = now + self._wait
            elif t <= now:
                del until[engine_id]
                gone.append(engine_id)
        return gone

    def due(self, now: float) -> float:
        """When `expire` has something to do (``inf``: nothing)."""
        return min((now if t is None else t for t in self.until.values()), default=math.inf)


class FifoSet:
    """Tokens in arrival order with O(1) ``add``, ``discard`` and ``take`` (amortized).

    A dict used as an ordered set is not enough: CPython leaves a hole for each entry
    deleted from the front, and ``next(iter(d))`` scans every hole, so taking N tokens in
    order cost O(N²) (21 s of CPU for 100,000 waiting callers). Here a deque holds the
    order and a set the members; a discarded token stays in the deque as a tombstone,
    skipped when reached and swept when tombstones outnumber members. ``work`` counts
    the deque entries looked at, so a test can check the cost per token.
    """

    __slots__ = ("_live", "_order", "work")

    def __init__(self) -> None:
        self._order: deque[Hashable] = deque()
        self._live: set[Hashable] = set()
        #: Deque entries looked at (taken, skipped or swept).
        self.work = 0

    def __len__(self) -> int:
        return len(self._live)

    def add(self, token: Hashable) -> None:
        """Append ``token`` (each token is added once; a member stays where it is)."""
        if token not in self._live:
            self._live.add(token)
            self._order.append(token)

    def discard(self, token: Hashable) -> None:
        """Remove ``token`` if present."""
        live = self._live
        if token in live:
            live.remove(token)
            order = self._order
            if len(order) > 2 * len(live) + 64:  # sweep the tombstones
                self.work += len(order)
                self._order = deque(t for t in order if t in live)

    def take(self) -> Hashable | None:
        """Remove and return the oldest token (None: empty)."""
        order = self._order
        live = self._live
        while order:
            token = order.popleft()
            self.work += 1
            if token in live:
                live.remove(token)
                return token
        return None


class CapacityWaiters:
    """Callers waiting for an in-flight slot, woken one per freed slot, in order.

    A waiter waits either for a given engine id or for any engine (``None``). The tokens
    are the I/O shell's (futures, events); this class only says which to wake. Waking
    every waiter on every freed slot made N queued calls cost O(N²); here a freed slot
    wakes one waiter, and a woken waiter that finds no slot queues again. Each queue
    is a `FifoSet`: adding, cancelling and waking a waiter cost O(1).
    """

    __slots__ = ("_any", "_by_engine", "_work_done", "wakeups")

    def __init__(self) -> None:
        self._any = FifoSet()
        self._by_engine: dict[str, FifoSet] = {}
        self._work_done = 0  # work of queues dropped when they emptied
        #: Wake-ups handed out (for tests and statistics).
        self.wakeups = 0

    def __len__(self) -> int:
        return len(self._any) + sum(map(len, self._by_engine.values()))

    @property
    def work(self) -> int:
        """Queue entries looked at so far (O(1) per waiter: tests check it)."""
        queues = self._by_engine.values()
        return self._work_done + self._any.work + sum(q.work for q in queues)

    def queued(self, target: str | None) -> bool:
        """Whether callers already wait for ``target`` (a new caller then queues too)."""
        if target is None:
            return bool(self._any._live)  # the set itself: no __len__ call (hot path)
        return target in self._by_engine  # a queue is dropped when it empties

    def add(self, target: str | None, token: Hashable) -> None:
        """Queue a waiter for ``target`` (an engine id, or ``None`` for any engine)."""
        if target is None:
            self._any.add(token)
            return
        queue = self._by_engine.get(target)
        if queue is None:
            queue = self._by_engine[target] = FifoSet()
        queue.add(token)

    def discard(self, target: str | None, token: Hashable) -> None:
        """Forget a waiter that stopped waiting (cancelled, timed out)."""
        if target is None:
            self._any.discard(token)
            return
        queue = self._by_engine.get(target)
        if queue is not None:
            queue.discard(token)
            if not queue:
                self._drop(target, queue)

    def _drop(self, target: str, queue: FifoSet) -> None:
        self._work_done += queue.work
        del self._by_engine[target]

    def _take(self, target: str | None, limit: int) -> list[Any]:
        queue = self._any if target is None else self._by_engine.get(target)
        out: list[Any] = []
        if queue is None:
            return out
        while queue and len(out) < limit:
            out.append(queue.take())
        if target is not None and not queue:
            self._drop(target, queue)
        self.wakeups += len(out)
        return out

    def released(self, engine_id: str | None) -> Sequence[Any]:
        """A slot on ``engine_id`` became free: the (at most one) waiter to wake.

        ``None`` hands a slot of an unknown engine to the first waiter for any engine.
        """
        if not self._any._live and engine_id not in self._by_engine:  # the hot path
            return ()
        if engine_id is not None:
            woken = self._take(engine_id, 1)
            if woken:
                return woken
        return self._take(None, 1)

    def joined(self, engine_id: str, slots: int) -> list[Any]:
        """An engine with ``slots`` free slots joined: the waiters to wake."""
        woken = self._take(engine_id, slots)
        return woken + self._take(None, slots - len(woken))

    def lost(self, engine_id: str, *, none_left: bool) -> list[Any]:
        """An engine left: its targeted waiters (and, if no engine is left, all) wake."""
        woken = self._take(engine_id, len(self._by_engine.get(engine_id, ())))
        if none_left:
            woken += self._take(None, len(self._any))
        return woken

    def everyone(self) -> list[Any]:
        """Every waiter (the client is closing)."""
        woken = self._take(None, len(self._any))
        for engine_id in list(self._by_engine):
            woken += self._take(engine_id, len(self._by_engine[engine_id]))
        return woken


def unavailable_message(
    live: int,
    count: int,
    timeout: float | None,
    rejected: Mapping[str, str],
    failures: Sequence[str] = (),
    earlier: int = 0,
) -> str:
    """The text of the error ``wait_for_engines`` raises when it gives up: ``live`` of
    ``count`` engines, the refusals (engine id → ``"reason: message"``; ``earlier``: those
    no longer kept) and the last three distinct failed CURVE handshakes (``failures``)."""
    if rejected and not live:
        text = f"{live} of {count} engines live: every engine that tried to join was refused"
    else:
        text = f"{live} of {count} engines live after {timeout} s"
    if rejected:
        text += "; refused: " + "; ".join(f"{k}: {v}" for k, v in sorted(rejected.items()))
        if earlier > 0:
            text += f" (and {earlier} earlier refusals)"
    if failures:
        distinct = list(dict.fromkeys(reversed(failures)))[:3]
        text += "; handshakes failed (CURVE): " + "; ".join(reversed(distinct))
    return text
