"""The standard health service (sans-I/O): the built-in method, its request and its answer.

Like ``grpc.health.v1``: a peer asks an engine whether it serves (overall, or one
service) and gets ``SERVING``, ``NOT_SERVING`` or ``SERVICE_UNKNOWN``. The engine's
protocol machine answers the CALL itself, on the loop, without a worker and while it
drains (then ``NOT_SERVING``), so that a probe is answered however busy the engine is.
docs/protocol.md (§10, "Built-in health method") is the wire specification.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Final

import ormsgpack

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "HEALTH_METHOD",
    "MAX_REQUEST_BYTES",
    "HealthChange",
    "HealthStatus",
    "decode_answer",
    "encode_answer",
    "parse_request",
]

#: The built-in method that answers an engine's health. It holds a dot, which no service
#: method name can, so it cannot clash with a service's methods.
HEALTH_METHOD: Final = "_tensorrpc.health"
#: The largest health request payload an engine reads (a service name of 1024 characters
#: fits with room to spare); a larger one is refused as ``INVALID_ARGUMENT``.
MAX_REQUEST_BYTES: Final = 4352
_MAX_SERVICE_CHARS: Final = 1024


class HealthStatus(StrEnum):
    """What an engine says about its health (``grpc.health.v1``'s statuses).

    ``UNKNOWN`` is never sent by an engine: a client reports it for an engine that did
    not answer (gone, unreachable, or no reply in time).
    """

    SERVING = "SERVING"
    """The engine (or the service asked about) takes calls."""
    NOT_SERVING = "NOT_SERVING"
    """The engine drains (shutting down) or its application said it cannot serve."""
    SERVICE_UNKNOWN = "SERVICE_UNKNOWN"
    """The engine does not serve the service asked about."""
    UNKNOWN = "UNKNOWN"
    """No answer: the engine is gone or did not answer in time (client side only)."""


#: The statuses an engine may send.
_WIRE: Final = frozenset({"SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"})


@dataclass(frozen=True, slots=True)
class HealthChange:
    """One change seen by [`Client.watch_health`][tensorrpc.Client.watch_health].

    Attributes:
        engine_id: The engine whose status changed.
        status: Its status now (``UNKNOWN``: it left or did not answer).
        previous: Its status before (None: the first status seen for this engine).
    """

    engine_id: str
    status: HealthStatus
    previous: HealthStatus | None


def parse_request(payload: Buffer) -> str:
    """The service a health CALL asks about (``""``: the engine as a whole).

    The arguments are a codec payload: an empty array or map, ``[service]``, or
    ``{"service": service}``.

    Raises:
        ValueError: Anything else (the engine answers ``INVALID_ARGUMENT``).
    """
    data = memoryview(payload)
    if data.nbytes > MAX_REQUEST_BYTES:
        raise ValueError(f"a health request is at most {MAX_REQUEST_BYTES} bytes")
    try:
        args = ormsgpack.unpackb(data)
    except (ValueError, TypeError) as exc:  # MsgpackDecodeError is a ValueError
        raise ValueError("a health request must be msgpack") from exc
    if isinstance(args, list):
        if len(args) > 1:
            raise ValueError("a health request takes one argument, the service")
        service = args[0] if args else ""
    elif isinstance(args, dict):
        if set(args) - {"service"}:
            raise ValueError("a health request takes one argument, the service")
        service = args.get("service", "")
    else:
        raise ValueError("a health request's arguments must be an array or a map")
    if not isinstance(service, str) or len(service) > _MAX_SERVICE_CHARS:
        raise ValueError(f"the service must be a str of at most {_MAX_SERVICE_CHARS} characters")
    return service


def encode_answer(service: str, status: HealthStatus) -> bytes:
    """The RESULT payload of a health CALL: ``{"status": ..., "service": ...}``."""
    if status.value not in _WIRE:
        raise ValueError(f"an engine does not send {status.value}")
    return ormsgpack.packb({"status": status.value, "service": service})


def decode_answer(value: object) -> HealthStatus:
    """The status in a decoded health RESULT (a map with ``status``).

    Raises:
        ValueError: Not such a map, or a status an engine may not send.
    """
    status = value.get("status") if isinstance(value, dict) else None
    if not isinstance(status, str) or status not in _WIRE:
        raise ValueError("the engine's health answer is not a map with a known status")
    return HealthStatus(status)
