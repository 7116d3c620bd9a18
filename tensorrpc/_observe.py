"""Observation hooks: what clients and engines tell observers (tracing, your own).

A `Client` and a `Server` hold one `Observer` or ``None`` (the default: then every call
site is one ``is not None`` test). The call sites are listed in docs/internals.md
(``_observe.py``). Counting is not theirs: the counters of clients and engines are their
machines' statistics (`tensorrpc._statistics`), which Prometheus, the built-in statistics
method and ``tensorrpc top`` read. This module imports nothing outside the standard
library and tensorrpc.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from tensorrpc import _exceptions as _e
from tensorrpc._statistics import LATENCY_BUCKETS_PER_OCTAVE

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from tensorrpc._security import CurveConfig

__all__ = [
    "STATISTICS_METHOD",
    "CallObservation",
    "Observer",
    "install",
    "installed",
    "outcome_of",
    "resolve",
    "uninstall",
]


#: The built-in engine method that answers with the engine's statistics (a map), read by
#: ``tensorrpc top``. A dot never appears in a service's method names, so it cannot clash.
STATISTICS_METHOD: Final = "_tensorrpc.statistics"


class CallObservation:
    """What an observer learns about one call; every method here does nothing.

    Made by [`Observer.client_call`][tensorrpc.Observer.client_call] or
    [`Observer.engine_call`][tensorrpc.Observer.engine_call]; subclasses override what
    they need.
    """

    __slots__ = ()

    def trace_context(self) -> bytes:
        """Client side: the binary W3C trace context to send with the CALL, or ``b""``.

        Returns:
            26 bytes (version 0, trace id, span id, trace flags), or empty for none.
        """
        return b""

    def started(self) -> None:
        """Engine side: the handler is about to run (in the task that runs it)."""

    def item(self) -> None:
        """A stream item was taken (client) or sent (engine)."""

    def error(self, code: str) -> None:
        """Engine side: an ERROR reply with this code name (``"REMOTE"``, ...) was sent."""

    def finished(self, outcome: str, nbytes: int) -> None:
        """The call is over.

        Args:
            outcome: ``"ok"``, ``"cancelled"`` (the caller or the client gave up) or the
                ERROR code's name (``"REMOTE"``, ``"DEADLINE_EXCEEDED"``, ...; on the
                client, the code of the error the call ended with, see `outcome_of`,
                and ``"UNAVAILABLE"`` when no engine could answer).
            nbytes: Client side: bytes of the reply (0 when none); engine side: 0.
        """


class Observer:
    """Receives a client's or an engine's events; the base class ignores them all.

    Pass one (or a list) as ``observer=`` to [`Client`][tensorrpc.Client],
    [`Server`][tensorrpc.Server] or [`serve`][tensorrpc.serve], or
    ``install`` it (``tensorrpc.tracing.instrument()`` does) for every client and engine made
    afterwards. One observer may watch several clients and engines at once. Hooks run on
    the event loop, inline with the call: they must be quick and must not raise.
    """

    __slots__ = ()

    def opened(self, target: Any) -> None:
        """A client or engine (``target``) started; its ``statistics()`` may be read now."""

    def closed(self, target: Any) -> None:
        """A client or engine that was ``opened`` closed."""

    def client_call(
        self, service: str, method: str, engine: str, stream: bool, nbytes: int, transport: str
    ) -> CallObservation | None:
        """A client sent a CALL (in the caller's task: its context is the caller's).

        Args:
            service: The service name (of the engine's HELLO).
            method: The method name.
            engine: The engine id it went to.
            stream: Whether it is a streaming call.
            nbytes: Bytes of its payload and tensor frames.
            transport: How its tensors travel: ``"torch_shm"`` (some by shared-memory
                handle), ``"frames"`` (out-of-band frames) or ``"inline"`` (none out of
                band).

        Returns:
            An observation of this call, or None to ignore it.
        """
        return None

    def engine_call(
        self,
        service: str,
        method: str,
        engine: str,
        client: str,
        stream: bool,
        trace: bytes,
        nbytes: int,
    ) -> CallObservation | None:
        """An engine accepted a CALL (queued for a worker).

        Args:
            service: The service name.
            method: The method name.
            engine: This engine's id.
            client: The calling client's id.
            stream: Whether it is a streaming call.
            trace: The binary W3C trace context the CALL carried, or ``b""``.
            nbytes: Bytes of its payload and tensor frames.

        Returns:
            An observation of this call, or None to ignore it.
        """
        return None

    def engine_batch(
        self, service: str, method: str, engine: str, size: int, items: Sequence[bytes]
    ) -> CallObservation | None:
        """An engine starts a batch (or a continuous batch's step) of a batched method.

        Args:
            service: The service name.
            method: The method name.
            engine: This engine's id.
            size: Items in the batch (step).
            items: Each item's trace context (binary W3C, ``b""`` when it has none), as
                the engine's span of that item's call saw it.

        Returns:
            An observation of the batch (``finished`` when it is done), or None.
        """
        return None

    def engine_event(self, client: str, engine: str, event: str) -> None:
        """A client's engine ``"joined"``, ``"rejoined"`` (seen before) or was ``"lost"``."""

    def heartbeat(self, client: str, engine: str, rtt: float) -> None:
        """A client's heartbeat PING to ``engine`` came back after ``rtt`` seconds."""


# -- several observers --------------------------------------------------------------------


def _each(name: str) -> Any:
    """A fan-out hook: call ``name`` on each of ``self``'s members."""

    def hook(self: Any, *args: Any) -> None:
        for member in self.members:
            getattr(member, name)(*args)

    return hook


def _calls(name: str) -> Any:
    """A fan-out hook that returns a `CallObservation`: the members', fanned out too."""

    def hook(self: Any, *args: Any) -> CallObservation | None:
        kept = [c for o in self.members if (c := getattr(o, name)(*args)) is not None]
        if not kept:
            return None
        return kept[0] if len(kept) == 1 else _FanoutCall(kept)

    return hook


class _FanoutCall(CallObservation):
    __slots__ = ("members",)

    def __init__(self, members: list[CallObservation]) -> None:
        self.members = members

    def trace_context(self) -> bytes:
        return next((t for c in self.members if (t := c.trace_context())), b"")

    started = _each("started")
    item = _each("item")
    error = _each("error")
    finished = _each("finished")


class _Fanout(Observer):
    """Several observers seen as one."""

    __slots__ = ("members",)

    def __init__(self, members: Sequence[Observer]) -> None:
        self.members = tuple(members)

    opened = _each("opened")
    closed = _each("closed")
    client_call = _calls("client_call")
    engine_call = _calls("engine_call")
    engine_batch = _calls("engine_batch")
    engine_event = _each("engine_event")
    heartbeat = _each("heartbeat")


def combine(*observers: Observer | None) -> Observer | None:
    """One observer standing for all the given ones (None when none is given)."""
    flat: list[Observer] = []
    for o in observers:
        if isinstance(o, _Fanout):
            flat.extend(o.members)
        elif o is not None:
            flat.append(o)
    flat = list(dict.fromkeys(flat))  # the same observer once
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else _Fanout(flat)


# -- the trace context of the running call ------------------------------------------------

#: Set by ``tensorrpc.tracing`` when imported: the binary trace context of the span that
#: is current in the calling task (an engine's call span, inside a worker), or ``b""``.
current_trace: Callable[[], bytes] = bytes


# -- process-wide observers ---------------------------------------------------------------

_installed: list[Observer] = []


def install(observer: Observer) -> None:
    """Give ``observer`` to every client and engine created from now on (idempotent)."""
    if observer not in _installed:
        _installed.append(observer)


def uninstall(observer: Observer) -> None:
    """Undo ``install`` (clients and engines already made keep the observer)."""
    if observer in _installed:
        _installed.remove(observer)


def installed() -> tuple[Observer, ...]:
    """The observers installed process-wide."""
    return tuple(_installed)


def resolve(observer: Observer | Sequence[Observer] | None) -> Observer | None:
    """The observer a new client or engine uses: its ``observer=`` and the installed ones.

    Raises:
        TypeError: ``observer`` is not an Observer (or a sequence of them).
    """
    own: list[Observer] = []
    if isinstance(observer, Observer):
        own.append(observer)
    elif observer is not None:
        for o in observer:
            if not isinstance(o, Observer):
                raise TypeError(f"observer must be a tensorrpc Observer, not {type(o).__name__}")
            own.append(o)
    return combine(*_installed, *own)


# -- helpers for the call sites -----------------------------------------------------------


#: A client call's outcome by the exception it ended with (the first class of its MRO
#: listed): the name of the ERROR code an engine answers for it, so that a client and an
#: engine label one call alike; ``UNAVAILABLE`` when no engine could answer.
_OUTCOMES: Final[dict[type[BaseException], str]] = {
    _e.MethodNotFoundError: "METHOD_NOT_FOUND",
    _e.InvalidArgumentError: "INVALID_ARGUMENT",
    _e.ValidationError: "INVALID_ARGUMENT",
    _e.EncodeError: "INVALID_ARGUMENT",
    _e.DecodeError: "DECODE",
    _e.CallTimeoutError: "DEADLINE_EXCEEDED",
    _e.OverloadedError: "OVERLOADED",
    _e.DrainingError: "DRAINING",
    _e.PermissionDeniedError: "PERMISSION_DENIED",
    _e.MetadataError: "INVALID_ARGUMENT",
    _e.TensorTransportError: "TENSOR_TRANSPORT",
    _e.ProtocolError: "PROTOCOL",
    _e.TransportError: "UNAVAILABLE",
    _e.EngineNotFoundError: "UNAVAILABLE",
    _e.ClosedError: "cancelled",
}


def outcome_of(exc: BaseException | None) -> str:
    """The outcome label of a client call that ended with ``exc`` (None: ``"ok"``).

    ``"ok"``, ``"cancelled"`` (the caller gave up, or closed the client), or an ERROR
    code's name as the engine labels the same call (``"REMOTE"``, ``"DEADLINE_EXCEEDED"``,
    ...), ``"UNAVAILABLE"`` when no engine could answer, ``"INTERNAL"`` for anything else.
    """
    if exc is None:
        return "ok"
    if not isinstance(exc, Exception):
        return "cancelled"  # the caller's task was cancelled (or the process is exiting)
    if isinstance(exc, _e.RemoteError):
        return exc.code.name
    return next((_OUTCOMES[c] for c in type(exc).__mro__ if c in _OUTCOMES), "INTERNAL")


class _Reply(Protocol):
    reply_payload: Any
    reply_buffers: Sequence[Any]


def reply_bytes(call: _Reply) -> int:
    """Bytes of the reply a client call holds (payload and tensor frames)."""
    return sum(memoryview(b).nbytes for b in (call.reply_payload, *call.reply_buffers))


def client_call(
    observer: Observer,
    service: str,
    method: str,
    engine: str,
    stream: bool,
    nbytes: int,
    shm_tensors: int,
    frames: int,
) -> tuple[CallObservation | None, bytes]:
    """Client call site: the observation of a CALL about to be sent (or None) and the
    trace context the CALL carries (the observation's, else ``b""``)."""
    transport = "torch_shm" if shm_tensors else "frames" if frames else "inline"
    observation = observer.client_call(service, method, engine, stream, nbytes, transport)
    return observation, b"" if observation is None else observation.trace_context()


def statistics_allowed(curve: CurveConfig | None) -> bool:
    """Whether an engine answers the statistics method (peers must be authenticated).

    Without CURVE there is no authentication to ask for. With CURVE, a server socket that
    accepts any client key (``allowed_clients=None``) encrypts but does not authenticate,
    so it refuses; with an allow-list, or as a CURVE client (the peer proved the server
    key we asked for), every peer is authenticated.
    """
    return curve is None or getattr(curve, "allowed_clients", ()) is not None


# -- the built-in statistics method -------------------------------------------------------


def _counters(c: Any) -> dict[str, int]:
    return {
        "tensors_sent": c.tensors_sent,
        "bytes_sent": c.bytes_sent,
        "tensors_received": c.tensors_received,
        "bytes_received": c.bytes_received,
        "fallbacks": c.fallbacks,
    }


def statistics_body(stats: Any, *, service: str, pid: int, started: float) -> dict[str, Any]:
    """The map the statistics method answers with (documented in docs/protocol.md), from
    the engine's ``ServerStatistics``; ``started`` is its ``time.time()`` at start."""
    clients = stats.clients
    detail = stats.transports.torch_shm_detail
    return {
        "engine_id": stats.engine_id,
        "service": service,
        "pid": pid,
        "time": time.time(),
        "uptime_s": max(0.0, time.time() - started),
        "calls": stats.calls,
        "errors": stats.errors,
        "in_flight": stats.in_flight,
        "queued": stats.queued,
        "overloaded": stats.overloaded,
        "dropped": stats.dropped,
        "clients": sum(1 for c in clients if c.state == "live"),
        "bytes_in": sum(c.bytes_in for c in clients),
        "bytes_out": sum(c.bytes_out for c in clients),
        "transports": {
            "frames": _counters(stats.transports.frames),
            "torch_shm": {
                **_counters(stats.transports.torch_shm),
                "releases_refused": 0 if detail is None else int(detail.releases_refused),
            },
        },
        "latency_buckets_per_octave": LATENCY_BUCKETS_PER_OCTAVE,
        "methods": {
            name: {"calls": m["calls"], "errors": m["errors"], "latency": m["latency"]}
            for name, m in sorted(stats.methods.items())
            if m["calls"]
        },
        "batching": {name: dict(b) for name, b in stats.batching.items()},
    }
