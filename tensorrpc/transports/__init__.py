"""Tensor transports: where the bytes of a large tensor travel.

The codec talks to a transport through two small protocols, `TensorPlacer`
(sending side) and `TensorResolver` (receiving side). The runtime picks a transport
per call (``client.with_options(transport="auto" | "frames" | "torch_shm").stub()``, see
docs/transports.md) and reports what each moved in ``statistics().transports``
([`TransportStatistics`][tensorrpc.TransportStatistics]).
"""

from __future__ import annotations

from tensorrpc.transports._base import TensorPlacer, TensorResolver
from tensorrpc.transports._policy import (
    DEFAULT_SHM_THRESHOLD,
    TransportCounters,
    TransportName,
    TransportStatistics,
)
from tensorrpc.transports.torch_shm import TorchShmStatistics, TorchShmTransport

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "TensorPlacer",
    "TensorResolver",
    "TorchShmStatistics",
    "TorchShmTransport",
    "TransportCounters",
    "TransportName",
    "TransportStatistics",
]
