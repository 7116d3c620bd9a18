"""The public surface stays honest: ``tensorrpc.__all__`` is sorted, complete and documented.

Modelled on httpx's ``tests/test_exported_members.py`` and trio's export tests.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import tensorrpc

from ._fresh_imports import report

INIT = Path(tensorrpc.__file__).resolve()

#: Exported names that are plain values, not classes or functions: they cannot carry a
#: docstring of their own (the docs describe them).
CONSTANTS = frozenset({"PROTOCOL_VERSION"})
# Type aliases: unions and literals, documented on the pages that use them.
TYPE_ALIASES = frozenset({"CurveConfig", "TransportName"})


def isort_style_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 calls "isort-style": SCREAMING_CASE, then CamelCase, then the rest.

    Within each group names sort case-sensitively (plain ``str`` order; ruff's natural
    sort differs only for names with digits, which ``__all__`` does not have).
    """
    if len(name) > 1 and name.isupper():
        return (0, name)
    if name[:1].isupper():
        return (1, name)
    return (2, name)


def _names_bound_in_init() -> set[str]:
    """Every name ``tensorrpc/__init__.py`` binds at module level (imports and assignments)."""
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    names: set[str] = set()
    body = list(tree.body)
    for node in body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            body.extend(node.body)  # the imports type checkers read (see _EXPORTS)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def test_all_is_sorted_isort_style() -> None:
    assert list(tensorrpc.__all__) == sorted(tensorrpc.__all__, key=isort_style_key)


def test_all_order_agrees_with_ruff_ruf022() -> None:
    # The project's ruff config ignores RUF022; ask ruff directly, ignoring that config.
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is a dev dependency: pip install -e '.[dev]'"
    proc = subprocess.run(
        [ruff, "check", "--isolated", "--select", "RUF022", "--output-format", "concise", INIT],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_all_has_no_duplicates() -> None:
    assert len(set(tensorrpc.__all__)) == len(tensorrpc.__all__)


def test_every_name_in_all_exists() -> None:
    missing = [name for name in tensorrpc.__all__ if not hasattr(tensorrpc, name)]
    assert missing == []


def test_every_public_name_defined_in_init_is_in_all() -> None:
    public = {
        name
        for name in _names_bound_in_init()
        if not name.startswith("_") and name not in {"annotations", "TYPE_CHECKING"}
    }
    assert sorted(public - set(tensorrpc.__all__)) == []


def test_the_lazy_exports_are_the_imports_type_checkers_read() -> None:
    # `import tensorrpc` imports nothing; each name is imported from its module on first
    # use (_EXPORTS), and type checkers read the TYPE_CHECKING imports: both must agree.
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    (block,) = (n for n in tree.body if isinstance(n, ast.If))
    imported = {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == tensorrpc._EXPORTS
    assert set(imported) == set(tensorrpc.__all__)


def test_every_public_attribute_of_the_package_is_exported() -> None:
    # Submodules (tensorrpc.transports, tensorrpc._codec, ...) are attributes once imported;
    # everything else without an underscore must be in __all__.
    stray = [
        name
        for name, value in vars(tensorrpc).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and name not in {"annotations", "TYPE_CHECKING"}
        and name not in tensorrpc.__all__
    ]
    assert stray == []


def _own_docstring(value: object) -> str:
    """The docstring written for ``value`` itself: not inherited, not dataclass-generated."""
    if inspect.isclass(value):
        doc = vars(value).get("__doc__") or ""
        if dataclasses.is_dataclass(value) and doc.startswith(f"{value.__name__}("):
            return ""  # @dataclass writes the signature when the class has no docstring
        return str(doc)
    return getattr(value, "__doc__", None) or ""


def test_every_exported_class_and_function_has_a_docstring() -> None:
    undocumented = []
    for name in tensorrpc.__all__:
        if name in CONSTANTS | TYPE_ALIASES:
            continue
        value = getattr(tensorrpc, name)
        assert inspect.isclass(value) or callable(value), f"{name} is neither class nor function"
        if not _own_docstring(value).strip():
            undocumented.append(name)
    assert undocumented == []


def test_own_docstring_ignores_inherited_and_generated_ones() -> None:
    class Plain(Exception):
        pass

    @dataclasses.dataclass
    class Data:
        x: int

    def fn() -> None:
        """Documented."""

    assert _own_docstring(Plain) == ""
    assert _own_docstring(Data) == ""
    assert _own_docstring(fn) == "Documented."


def test_constants_are_plain_values() -> None:
    for name in CONSTANTS:
        value = getattr(tensorrpc, name)
        assert isinstance(value, int | str | bytes), name
    for name in TYPE_ALIASES:
        assert typing.get_origin(getattr(tensorrpc, name)) in (types.UnionType, typing.Literal), (
            name
        )


def test_isort_style_key_orders_the_three_groups() -> None:
    names = ["serve", "Client", "PROTOCOL_VERSION", "CallError", "rpc", "ABC", "Abc"]
    assert sorted(names, key=isort_style_key) == [
        "ABC",
        "PROTOCOL_VERSION",
        "Abc",
        "CallError",
        "Client",
        "rpc",
        "serve",
    ]


def test_import_tensorrpc_never_imports_the_optional_integrations() -> None:
    """prometheus_client, opentelemetry, rich and ray are extras: only their modules load them."""
    found = report()
    assert found["optional imported"] == []
    # ...and the integration modules do load them (so the check above can fail)
    assert found["tensorrpc.metrics imports prometheus_client"] is True


def test_import_tensorrpc_imports_no_module_of_its_own() -> None:
    # Each name is imported on first use (tensorrpc/__init__.py); torch's import is seconds.
    assert report()["import tensorrpc loads"] == ["tensorrpc"]


def test_the_version_command_imports_neither_torch_nor_numpy() -> None:
    assert report()["tensorrpc --version imports"] == []


def test_a_call_of_plain_values_imports_neither_torch_nor_numpy() -> None:
    found = report()
    assert found["plain call"] == 7  # an engine and a client in one process, one call
    assert found["a plain call imports"] == []


def test_tensors_work_when_torch_is_imported_after_tensorrpc() -> None:
    # The same process, after the plain call: the codec's dtype tables and the validators'
    # Tensor type are filled in on first use.
    found = report()
    assert found["tensor call"] == [[0, 2, 4], [1.0, 1.0]]
    assert found["tensor refused"] == "Tensors.double: req.x: expected Tensor, got list ([1])"


def test_import_tensorrpc_does_not_import_ray() -> None:
    assert [m for m in report()["optional imported"] if m.split(".")[0] == "ray"] == []


def test_tensorrpc_ray_without_ray_names_the_extra() -> None:
    assert "pip install 'tensorrpc[ray]'" in str(report()["tensorrpc.ray"])
