"""The observer a new client or engine uses: its own, the installed ones, and metrics.

Apart from `tensorrpc._observe` so that `tensorrpc.metrics`, which builds on the hooks
there, is imported by the shells that ask for it and by nothing it imports (no cycle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorrpc._observe import Observer, combine, installed

if TYPE_CHECKING:
    from collections.abc import Sequence


def resolve(
    observer: Observer | Sequence[Observer] | None, metrics_port: int | None
) -> Observer | None:
    """The observer a new client or engine uses: its own, the installed ones, and metrics.

    Args:
        observer: What the user passed as ``observer=``.
        metrics_port: ``metrics_port=``: also export Prometheus metrics (the default
            registry) over HTTP on this port of 127.0.0.1... see ``tensorrpc.metrics``.

    Returns:
        The combined observer, or None when there is nothing to observe.

    Raises:
        TypeError: ``observer`` is not an Observer (or a sequence of them).
        ImportError: ``metrics_port`` is given without the ``metrics`` extra.
    """
    own: list[Observer] = []
    if isinstance(observer, Observer):
        own.append(observer)
    elif observer is not None:
        for o in observer:
            if not isinstance(o, Observer):
                raise TypeError(f"observer must be a tensorrpc Observer, not {type(o).__name__}")
            own.append(o)
    if metrics_port is not None:
        from tensorrpc import metrics  # the optional extra, only when asked for

        own.append(metrics.exporter(metrics_port))
    return combine(*installed(), *own)
