"""Modules imported on first use, so that ``import tensorrpc`` does not import torch.

torch takes seconds to import (numpy a fifth of one), and a process that never sees a
tensor (the command line, a client of plain values) never needs either. A module that
uses torch only inside functions binds the name to a `LazyModule`:

```python
if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())
```

The first attribute read (``torch.Tensor``) imports torch and rebinds the module's global
``torch`` to torch itself, so later reads cost what they did with a top-level import.
Only a path that involves a tensor reads the name: one that asks "is this a tensor?" of
a value that may be anything checks ``"torch" in sys.modules`` first (no value can be a
tensor of a module not yet imported).
"""

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
