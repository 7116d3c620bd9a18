"""Tensor transports: where the bytes of a large tensor travel.

The codec talks to a transport through two small protocols, :class:`TensorPlacer`
(sending side) and :class:`TensorResolver` (receiving side).
"""

from __future__ import annotations

from tensorrpc.transports._base import TensorPlacer, TensorResolver

__all__ = ["TensorPlacer", "TensorResolver"]
