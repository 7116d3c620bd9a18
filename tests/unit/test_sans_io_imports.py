from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tensorrpc"
SANS_IO_FILES = (
    "_exceptions.py",
    "_schema.py",
    "_service.py",
    "_codec.py",
    "_protocol.py",
    "_calls.py",
    "_engines.py",
    "_liveness.py",
    "_health.py",
    "_machine.py",
    "_client_protocol.py",
    "_client_events.py",
    "_client_leases.py",
    "_client_sessions.py",
    "_server_protocol.py",
    "_server_calls.py",
    "_streams.py",
    "_batching.py",
    "_bulk.py",
    "_metadata.py",
    "_statistics.py",
    "transports/_base.py",
)
FORBIDDEN = frozenset(
    {"zmq", "asyncio", "anyio", "trio", "sniffio", "time", "threading", "pickle", "_pickle", "dill"}
)


def imported_top_level_modules(source: str) -> set[str]:
    """Every module an import statement in ``source`` names, by its top-level package."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name | ast.Attribute)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value.split(".")[0])
    return names


@pytest.mark.parametrize("relative", SANS_IO_FILES)
def test_sans_io_module_imports_no_io_or_pickle(relative: str):
    path = PACKAGE / relative
    assert path.is_file(), f"{relative} is gone: take it off SANS_IO_FILES"
    bad = imported_top_level_modules(path.read_text(encoding="utf-8")) & FORBIDDEN
    assert not bad, f"{relative} imports {sorted(bad)}"


def test_the_import_scanner_sees_every_import_form():
    source = (
        "import zmq.asyncio\n"
        "from anyio import to_thread\n"
        "if True:\n    import pickle as p\n"
        "def f():\n    import trio\n"
        "importlib.import_module('sniffio')\n"
        "from . import _codec\n"
    )
    assert imported_top_level_modules(source) >= {"zmq", "anyio", "pickle", "trio", "sniffio"}
