"""Modules imported on first use, so that ``import tensorrpc`` does not import torch.

A module that uses torch only inside functions binds ``torch = LazyModule("torch",
globals())`` (under ``if not TYPE_CHECKING``); the first attribute read imports torch and
rebinds the global to it. A value that may be anything is asked "is this a tensor?" only
once ``"torch" in sys.modules``."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LazyModule"]


class LazyModule:
    """Stands in for the module ``name`` as the global ``alias`` of ``namespace``."""

    __slots__ = ("_alias", "_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any], alias: str | None = None) -> None:
        self._name = name
        self._namespace = namespace
        self._alias = alias or name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        module = importlib.import_module(self._name)
        self._namespace[self._alias] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"
