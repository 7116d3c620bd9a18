"""Type hints → compiled validators and converters (sans-I/O).

`compile_type` turns one annotation into a `CompiledType` with two jobs: ``check`` (send
side) verifies a Python value and returns what goes on the wire (the value itself almost
always; an ``int`` for a ``float`` becomes a ``float``, scalar subclasses such as
``IntEnum`` become the plain type; tensors are never copied), and ``from_wire`` (receive
side) verifies what the codec decoded and builds the typed value (a ``tuple`` from a list,
a dataclass from a map, an ``Enum`` member from its value). Both raise
[`ValidationError`][tensorrpc.ValidationError] naming the path of the bad value.

Internally each node is a pair of closures raising the cheap `_Invalid`; the path is
assembled only when a value is rejected. Containers of plain scalars are checked in one
C-level pass (``[*map(type, value)].count(int) == len(value)``) and returned without a
copy (an ``int`` beyond 64 bits inside one is refused by the codec's encoder instead);
records get generated straight-line code. ``tests/unit/schema_oracle.py`` is the
independent reference the tests hold all of it to. docs/services.md lists the supported
annotations; anything else is a [`ServiceDefinitionError`][tensorrpc.ServiceDefinitionError].
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import inspect
import operator
import reprlib
import sys
import types
import typing
import weakref
from collections.abc import Callable, Collection, Mapping
from keyword import iskeyword
from typing import TYPE_CHECKING, Any

from tensorrpc._exceptions import ServiceDefinitionError, ValidationError, path_parts
from tensorrpc._lazy import LazyModule

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = LazyModule("numpy", globals(), "np")
    torch = LazyModule("torch", globals())

__all__ = [
    "CompiledType",
    "bad_result_message",
    "compile_type",
    "describe_value",
    "json_schemas",
    "too_deep",
]

#: Takes a value, returns the converted value or raises `_Invalid`.
Converter = Callable[[Any], Any]

_NoneType = type(None)
_I64_MIN = -(1 << 63)
_U64_END = 1 << 64

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 4
_repr.maxlevel = 2


def describe_value(value: object) -> str:
    """Describe a rejected value briefly: its type and a truncated repr (``str ('x')``).

    Tensors and arrays are described by dtype and shape, never by their contents.
    """
    if value is None:
        return "None"
    # A value can be a tensor (an array) only once torch (numpy) has been imported.
    if "torch" in sys.modules and isinstance(value, torch.Tensor):
        return f"Tensor(dtype={value.dtype}, shape={tuple(value.shape)})"
    if "numpy" in sys.modules and isinstance(value, np.ndarray):
        return f"ndarray(dtype={value.dtype}, shape={value.shape})"
    return f"{type(value).__name__} ({_repr.repr(value)})"


class _Invalid(Exception):
    """Cheap internal rejection; containers append their path segment and re-raise."""

    def __init__(self, expected: str, value: object, reason: str | None = None) -> None:
        super().__init__(expected)
        self.expected = expected
        self.value = value
        self.reason = reason
        #: Innermost first: a field name, an index (``int``) or a map key (``(key,)``).
        self.segments: list[str | int | tuple[object]] = []
        #: An exception raised by user code (a dataclass ``__post_init__``), if any.
        self.cause: BaseException | None = None

    def path(self, root: str) -> str:
        return root + "".join(map(_render_segment, reversed(self.segments)))

    def field_path(self, root: str) -> list[str | int]:
        head = list(path_parts(root))  # "req.items", "chunks[3]": the root's own parts
        for seg in reversed(self.segments):
            head.append(seg[0] if isinstance(seg, tuple) else seg)  # type: ignore[arg-type]
        return head

    def message(self, root: str) -> str:
        reason = self.reason or f"expected {self.expected}, got {describe_value(self.value)}"
        return f"{self.path(root)}: {reason}"

    def to_error(self, method: str, root: str) -> ValidationError:
        """The public error; ``method`` is ``Service.method`` or ``""``."""
        text = self.message(root)
        return ValidationError(
            f"{method}: {text}" if method else text,
            method=method,
            path=self.path(root),
            expected=self.expected,
            field_path=self.field_path(root),
        )


def _render_segment(seg: str | int | tuple[object]) -> str:
    if isinstance(seg, str):
        return f".{seg}"
    return f"[{seg}]" if isinstance(seg, int) else f"[{seg[0]!r}]"


def too_deep(method: str, root: str) -> ValidationError:
    """The error for a value nested beyond Python's recursion limit (recursive dataclasses)."""
    reason = "value is nested too deeply to validate"
    return _Invalid("a less deeply nested value", None, reason).to_error(method, root)


def guarded(conv: Converter, method: str, root: str) -> Callable[[object], object]:
    """``conv`` raising the public `ValidationError` (``method``: ``Service.method`` or "")."""

    def run(value: object) -> object:
        try:
            return conv(value)
        except _Invalid as exc:
            raise exc.to_error(method, root) from exc.cause
        except RecursionError:
            raise too_deep(method, root) from None

    return run


class CompiledType:
    """One compiled annotation: a stable description and two converters.

    Attributes:
        description: Normalised, stable text for the type (``list[int]``, ...).
        fast_check: Send-side converter raising the internal ``_Invalid`` (hot path).
        fast_from_wire: Receive-side converter raising the internal ``_Invalid``.
        exact: When not ``None``, the exact Python types for which both converters return
            the value unchanged; containers use it to check scalar elements in one pass.
        inline: When not ``None``, a Python expression over ``{x}`` that is true exactly
            when both converters would return ``x`` unchanged; generated record code tests
            it in place of calling them. It names only builtins and `_INLINE_NAMESPACE`.
    """

    __slots__ = ("description", "exact", "fast_check", "fast_from_wire", "inline")

    def __init__(
        self,
        description: str,
        fast_check: Converter,
        fast_from_wire: Converter,
        exact: frozenset[type] | None = None,
        inline: str | None = None,
    ) -> None:
        self.description = description
        self.fast_check = fast_check
        self.fast_from_wire = fast_from_wire
        self.exact = exact
        self.inline = inline

    def check(self, value: object, path: str) -> object:
        """The value to put on the wire for ``value`` (a `ValidationError` under ``path``)."""
        return guarded(self.fast_check, "", path)(value)

    def from_wire(self, value: object, path: str) -> object:
        """The typed value for a decoded one (a `ValidationError` under ``path``)."""
        return guarded(self.fast_from_wire, "", path)(value)

    def __repr__(self) -> str:
        return f"<CompiledType {self.description}>"


# --------------------------------------------------------------------------- scalars


def _none_conv(v: Any) -> Any:
    if v is None:
        return None
    raise _Invalid("None", v)


def _bool_conv(v: Any) -> Any:
    if v is True or v is False:
        return v
    raise _Invalid("bool", v)


def _int_check(v: Any) -> Any:
    if type(v) is int:
        if _I64_MIN <= v < _U64_END:
            return v
    elif isinstance(v, int) and not isinstance(v, bool):
        return _int_check(int(v))
    raise _Invalid("int", v, None if type(v) is not int else _int_range_reason(v))


def _int_range_reason(v: int) -> str:
    return f"int {v} is outside the 64-bit range msgpack can carry"


def _float_check(v: Any) -> Any:
    if type(v) is float:
        return v
    if isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool)):
        try:
            return float(v)
        except OverflowError:
            raise _Invalid("float", v, f"int {v} is too large for a float") from None
    raise _Invalid("float", v)


def _float_from_wire(v: Any) -> Any:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise _Invalid("float", v)


def _plain_or_subclass(cls: type, accepts: tuple[type, ...], convert: Converter) -> Converter:
    """``str``/``bytes``: the value itself, or an accepted subclass converted (send side)."""

    def check(v: Any) -> Any:
        if type(v) is cls:
            return v
        if isinstance(v, accepts):
            return convert(v)
        raise _Invalid(cls.__name__, v)

    return check


def _instance_of(cls: type, name: str) -> Converter:
    def instance(v: Any) -> Any:
        if isinstance(v, cls):
            return v
        raise _Invalid(name, v)

    return instance


# Inline tests (see ``CompiledType.inline``): true exactly when both converters return the
# value itself. For ``int`` that includes the 64-bit range check of ``_int_check``.
_INLINE_NAMESPACE: dict[str, object] = {}

_NONE = CompiledType("None", _none_conv, _none_conv, frozenset({_NoneType}), "{x} is None")
_BOOL = CompiledType(
    "bool", _bool_conv, _bool_conv, frozenset({bool}), "({x} is True or {x} is False)"
)
# Containers of exact ints skip the 64-bit range check (a C-level pass over the element
# types is all they pay); an out-of-range int there is refused by the codec's encoder.
_INT = CompiledType(
    "int",
    _int_check,
    _int_check,
    frozenset({int}),
    f"(type({{x}}) is int and {_I64_MIN} <= {{x}} < {_U64_END})",
)
_FLOAT = CompiledType(
    "float", _float_check, _float_from_wire, frozenset({float}), "type({x}) is float"
)
_STR = CompiledType(
    "str",
    _plain_or_subclass(str, (str,), str.__str__),
    _plain_or_subclass(str, (), str),
    frozenset({str}),
    "type({x}) is str",
)
_BYTES = CompiledType(
    "bytes",
    _plain_or_subclass(bytes, (bytes, bytearray), bytes),
    _plain_or_subclass(bytes, (), bytes),
    frozenset({bytes}),
    "type({x}) is bytes",
)
#: How an inline test names an exact element type (builtins or ``_INLINE_NAMESPACE``).
_INLINE_TYPE_NAMES: dict[object, str] = {t: t.__name__ for t in (bool, int, float, str, bytes)}
_SCALARS: dict[object, CompiledType] = {
    None: _NONE,
    _NoneType: _NONE,
    bool: _BOOL,
    int: _INT,
    float: _FLOAT,
    str: _STR,
    bytes: _BYTES,
}
# torch.Tensor and numpy.ndarray join the tables once an annotation may name them (torch or
# numpy imported: `compile_type` checks), so that importing tensorrpc does not import them.
_arrays_registered = False


def _register_arrays() -> None:
    """Import torch and numpy and add ``torch.Tensor`` and ``numpy.ndarray`` to the tables."""
    global _arrays_registered
    for cls, name, alias in (
        (torch.Tensor, "Tensor", "_Tensor"),
        (np.ndarray, "ndarray", "_ndarray"),
    ):
        conv = _instance_of(cls, name)
        # ``exact`` lets containers of them take the one-pass check (a subclass still goes
        # element by element); any instance passes unchanged.
        _SCALARS[cls] = CompiledType(
            name, conv, conv, frozenset({cls}), f"isinstance({{x}}, {alias})"
        )
        _INLINE_NAMESPACE[alias] = cls
        _INLINE_TYPE_NAMES[cls] = alias
    # numpy.typing.NDArray[...] and np.ndarray[shape, dtype]
    _BY_ORIGIN[np.ndarray] = lambda *_: _SCALARS[np.ndarray]
    _arrays_registered = True


# ------------------------------------------------------------------------ containers

#: Whether every element of a list, tuple or ``dict.values()`` is exactly right as is.
AllExact = Callable[[Collection[Any]], bool]


def _never(values: Collection[Any]) -> bool:
    return False


def _all_exact(elem: CompiledType) -> AllExact:
    """The one-pass element check of a container of ``elem``: ``list.count`` over the
    element types runs in C and matches by identity (half the cost of a set of types)."""
    exact = elem.exact
    if exact is None:
        return _never
    if len(exact) == 1:
        (only,) = exact

        def all_one(values: Collection[Any]) -> bool:
            return [*map(type, values)].count(only) == len(values)

        return all_one
    allowed = tuple(exact)

    def all_of(values: Collection[Any]) -> bool:
        return sum(map([*map(type, values)].count, allowed)) == len(values)

    return all_of


def _list_node(elem: CompiledType) -> CompiledType:
    desc = f"list[{elem.description}]"
    echeck = elem.fast_check
    efrom = elem.fast_from_wire
    all_exact = _all_exact(elem)

    def check(v: Any) -> Any:
        if type(v) is not list:
            raise _Invalid(desc, v)
        if all_exact(v):
            return v
        out: list[Any] | None = None
        i = 0
        try:
            for i, x in enumerate(v):
                y = echeck(x)
                if y is not x and out is None:
                    out = v[:i]
                if out is not None:
                    out.append(y)
        except _Invalid as exc:
            exc.segments.append(i)
            raise
        return v if out is None else out

    def from_wire(v: Any) -> Any:
        if type(v) is not list:
            if type(v) is tuple:
                v = list(v)
            else:
                raise _Invalid(desc, v)
        if all_exact(v):
            return v
        return _map_indexed(efrom, v)

    # Generated record code runs ``all_exact``'s test in place.
    only = next(iter(elem.exact)) if elem.exact is not None and len(elem.exact) == 1 else None
    name = _INLINE_TYPE_NAMES.get(only)
    inline = (
        None
        if name is None
        else f"(type({{x}}) is list and [*map(type, {{x}})].count({name}) == len({{x}}))"
    )
    return CompiledType(desc, check, from_wire, None, inline)


def _map_indexed(conv: Converter, values: list[Any] | tuple[Any, ...]) -> list[Any]:
    """``[conv(x) for x in values]``, naming the index of a rejected element: what the
    iterator had consumed (a second pass would be exponential in a recursive type's depth)."""
    it = iter(values)
    try:
        return list(map(conv, it))
    except _Invalid as exc:
        exc.segments.append(len(values) - operator.length_hint(it) - 1)
        raise


def _var_tuple_node(elem: CompiledType) -> CompiledType:
    desc = f"tuple[{elem.description}, ...]"
    echeck = elem.fast_check
    efrom = elem.fast_from_wire
    all_exact = _all_exact(elem)

    def check(v: Any) -> Any:
        if type(v) is not tuple:
            if not isinstance(v, tuple):
                raise _Invalid(desc, v)
            v = tuple(v)  # a NamedTuple subclass travels as a plain tuple
        if all_exact(v):
            return v
        return tuple(_map_indexed(echeck, v))

    def from_wire(v: Any) -> Any:
        if type(v) is not list and type(v) is not tuple:
            raise _Invalid(desc, v)
        if all_exact(v):
            return tuple(v)
        return tuple(_map_indexed(efrom, v))

    return CompiledType(desc, check, from_wire)


def _fixed_tuple_node(elems: list[CompiledType]) -> CompiledType:
    desc = "tuple[" + (", ".join(e.description for e in elems) if elems else "()") + "]"
    n = len(elems)
    apply_checks = _tuple_apply(tuple(e.fast_check for e in elems))

    def check(v: Any) -> Any:
        if not isinstance(v, tuple):
            raise _Invalid(desc, v)
        if len(v) != n:
            raise _Invalid(desc, v, f"expected {desc} of length {n}, got length {len(v)}")
        return apply_checks(v)

    froms = _tuple_apply(tuple(e.fast_from_wire for e in elems))
    return CompiledType(desc, check, _array_of(desc, n, froms))


def _array_of(desc: str, n: int, apply: Converter) -> Converter:
    """``from_wire`` of an array of ``n`` elements that ``apply`` converts."""

    def from_wire(v: Any) -> Any:
        if type(v) is not list and type(v) is not tuple:
            raise _Invalid(desc, v)
        if len(v) != n:
            raise _Invalid(desc, v, f"expected {desc} of length {n}, got length {len(v)}")
        return apply(v)

    return from_wire


def _tuple_apply(
    convs: tuple[Converter, ...], as_list: bool = False, labels: tuple[str, ...] = ()
) -> Converter:
    """``(convs[0](v[0]), ..., convs[n-1](v[n-1]))`` (a list with ``as_list``) as
    straight-line code (half the cost of ``map`` for a few elements); an ``_Invalid`` gets
    the failing index, or its name in ``labels``. The source is built from integers only."""
    n = len(convs)
    segment: Any = labels or range(n)
    if n > 32 or n == 0:
        build = list if as_list else tuple

        def apply(v: Any) -> Any:
            it = iter(v)
            try:
                return build(map(operator.call, convs, it))
            except _Invalid as exc:  # one pass, as in _map_indexed
                exc.segments.append(segment[n - operator.length_hint(it) - 1])
                raise

        return apply
    items = "".join(f"a{i}, " for i in range(n))
    lines = ["def apply(v):", "    i = 0", "    try:"]
    for i in range(n):
        lines.append(f"        a{i} = c{i}(v[{i}])")
        if i + 1 < n:
            lines.append(f"        i = {i + 1}")
    lines += [
        "    except _Invalid as exc:",
        "        exc.segments.append(_segment[i])",
        "        raise",
        f"    return [{items}]" if as_list else f"    return ({items})",
    ]
    namespace: dict[str, Any] = {f"c{i}": c for i, c in enumerate(convs)}
    namespace.update(_Invalid=_Invalid, _segment=segment)
    exec("\n".join(lines) + "\n", namespace)
    fn: Converter = namespace["apply"]
    return fn


def _keys_check(desc: str, key: type) -> Callable[[Any], None]:
    """Every key of a ``dict[str, ...]`` (``dict[int, ...]``) is exactly a ``str`` (a 64-bit
    ``int``)."""
    keys_exact = _all_exact(_SCALARS[key])

    def _keys_ok(v: dict[Any, Any]) -> None:
        if not keys_exact(v):
            for k in v:
                if type(k) is not key:
                    raise _Invalid(
                        desc, v, f"expected {desc}, got a key of type {describe_value(k)}"
                    )
        if key is int and v and (min(v) < _I64_MIN or max(v) >= _U64_END):
            k = min(v) if min(v) < _I64_MIN else max(v)
            raise _Invalid(desc, v, f"key {_int_range_reason(k)}")

    return _keys_ok


def _dict_node(val: CompiledType, key: type = str) -> CompiledType:
    desc = f"dict[{key.__name__}, {val.description}]"
    vcheck = val.fast_check
    vfrom = val.fast_from_wire
    all_exact = _all_exact(val)
    _keys_ok = _keys_check(desc, key)

    def _apply(conv: Converter, v: dict[Any, Any]) -> dict[Any, Any]:
        _keys_ok(v)
        if not v or all_exact(v.values()):
            return v
        out: dict[Any, Any] = {}
        changed = False
        key = ""
        try:
            for key, x in v.items():
                y = conv(x)
                changed = changed or y is not x
                out[key] = y
        except _Invalid as exc:
            exc.segments.append((key,))
            raise
        return out if changed else v

    def check(v: Any) -> Any:
        if not isinstance(v, dict):
            raise _Invalid(desc, v)
        return _apply(vcheck, v)

    def from_wire(v: Any) -> Any:
        if type(v) is not dict:
            raise _Invalid(desc, v)
        return _apply(vfrom, v)

    return CompiledType(desc, check, from_wire)


def _union_node(alts: list[CompiledType]) -> CompiledType:
    others = [a for a in alts if a is not _NONE]
    exact: frozenset[type] | None = frozenset()
    for a in alts:
        exact = exact | a.exact if (exact is not None and a.exact is not None) else None
    if len(others) == 1 and len(others) < len(alts):
        return _optional_node(others[0], exact)
    desc = "Union[" + ", ".join(a.description for a in alts) + "]"
    # An int must stay an int: try `int` before `float`, which would also accept it.
    order = sorted(alts, key=lambda a: 0 if a is _INT else 1)
    fast_types = frozenset().union(*(a.exact for a in alts if a.exact is not None))

    def first_accepting(convs: list[Converter]) -> Converter:
        def convert(v: Any) -> Any:
            if type(v) in fast_types:
                return v
            best: _Invalid | None = None
            for conv in convs:
                try:
                    return conv(v)
                except _Invalid as exc:
                    # Prefer the error of an alternative that got furthest inside the value.
                    if exc.segments and (best is None or len(exc.segments) > len(best.segments)):
                        best = exc
            raise best if best is not None else _Invalid(desc, v)

        return convert

    checks = first_accepting([a.fast_check for a in order])
    return CompiledType(desc, checks, first_accepting([a.fast_from_wire for a in order]), exact)


def _optional_node(other: CompiledType, exact: frozenset[type] | None) -> CompiledType:
    """``Optional[T]``: None, or what ``T`` accepts."""
    desc = f"Optional[{other.description}]"

    def optional(conv: Converter) -> Converter:
        def convert(v: Any) -> Any:
            if v is None:
                return None
            try:
                return conv(v)
            except _Invalid as exc:
                if exc.segments:
                    raise
                raise _Invalid(desc, v) from None

        return convert

    inner = other.inline
    inline = None if inner is None else f"({{x}} is None or ({inner}))"
    return CompiledType(
        desc, optional(other.fast_check), optional(other.fast_from_wire), exact, inline
    )


_LITERAL_TYPES = (type(None), bool, int, str, bytes)


def _literal_node(values: tuple[Any, ...], where: str) -> CompiledType:
    parts: list[str] = []
    # (exact wire type, wire value, python value)
    table: list[tuple[type, object, object]] = []
    for lit in values:
        if isinstance(lit, enum.Enum):
            wire = lit.value
            if type(wire) not in _LITERAL_TYPES:
                raise ServiceDefinitionError(
                    f"{where}: Literal member {lit!r} has a value of unsupported type "
                    f"{type(wire).__name__}"
                )
            parts.append(f"{type(lit).__name__}.{lit.name}={wire!r}")
            table.append((type(wire), wire, lit))
        elif type(lit) in _LITERAL_TYPES:
            parts.append(repr(lit))
            table.append((type(lit), lit, lit))
        else:
            raise ServiceDefinitionError(
                f"{where}: unsupported Literal value {lit!r} (use None, bool, int, str, bytes "
                "or Enum members)"
            )
    desc = "Literal[" + ", ".join(parts) + "]"

    def check(v: Any) -> Any:
        for _, _, py in table:
            if v is py or (type(v) is type(py) and v == py):
                return v
        raise _Invalid(desc, v)

    def from_wire(v: Any) -> Any:
        for wt, wv, py in table:
            if type(v) is wt and v == wv:
                return py
        raise _Invalid(desc, v)

    return CompiledType(desc, check, from_wire)


_ENUM_VALUE_TYPES = (type(None), bool, int, float, str, bytes)


def _enum_node(cls: type[enum.Enum], where: str) -> CompiledType:
    members = list(cls.__members__.items())
    if not members:
        raise ServiceDefinitionError(f"{where}: Enum {cls.__name__} has no members")
    by_value: dict[tuple[type, object], enum.Enum] = {}
    parts = []
    for name, member in members:
        value = member.value
        if type(value) not in _ENUM_VALUE_TYPES:
            raise ServiceDefinitionError(
                f"{where}: Enum {cls.__name__}.{name} has a value of type "
                f"{type(value).__name__}; only None, bool, int, float, str and bytes values "
                "can travel"
            )
        by_value.setdefault((type(value), value), member)
        parts.append(f"{name}={value!r}")
    is_flag = issubclass(cls, enum.Flag)
    desc = f"{'flag' if is_flag else 'enum'} {cls.__name__}{{{', '.join(parts)}}}"

    def check(v: Any) -> Any:
        if isinstance(v, cls):
            return v
        raise _Invalid(desc, v)

    def from_wire(v: Any) -> Any:
        try:
            return by_value[(type(v), v)]
        except (KeyError, TypeError):
            pass
        if is_flag and type(v) is int:
            try:
                return cls(v)
            except ValueError:
                pass
        raise _Invalid(desc, v)

    return CompiledType(desc, check, from_wire)


class _Ctx:
    """State of one `compile_type` call: where, localns, dataclasses in progress."""

    __slots__ = ("in_progress", "localns", "where")

    def __init__(self, where: str, localns: Mapping[str, Any] | None) -> None:
        self.where = where
        self.localns = localns
        self.in_progress: dict[type, CompiledType] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    """One compiled dataclass field."""

    name: str
    check: Converter
    from_wire: Converter
    required: bool
    kw_only: bool
    inline: str | None


def _ctor_rejected(cls: type, desc: str, value: object, exc: Exception) -> _Invalid:
    err = _Invalid(desc, value, f"{cls.__name__}(...) rejected the value: {exc!r}")
    err.cause = exc
    return err


#: One declared field of a record type: name, annotation, required, keyword-only.
_Decl = tuple[str, Any, bool, bool]


def _record_node(cls: type, ctx: _Ctx, kind: str) -> CompiledType:
    """A type whose values are named fields: a dataclass, a msgspec ``Struct``, a pydantic
    model or a ``TypedDict`` (``kind``), a map of its field names on the wire; or a
    ``NamedTuple``, an array of its fields in order."""
    placeholder = ctx.in_progress.get(cls)
    if placeholder is not None:
        return placeholder  # recursive reference: the node is filled in below
    decls = _DECLARED[kind](cls, _record_hints(cls, ctx, kind), ctx)
    # Recursive references (compiled below, before the converters exist) call these.
    impl_check: Converter
    impl_from_wire: Converter

    def entry_check(v: Any) -> Any:
        return impl_check(v)

    def entry_from_wire(v: Any) -> Any:
        return impl_from_wire(v)

    node = CompiledType(f"{kind} {cls.__name__}", entry_check, entry_from_wire)
    ctx.in_progress[cls] = node
    try:
        fields, parts = _compile_fields(cls, kind, decls, ctx)
    finally:
        del ctx.in_progress[cls]
    node.description = desc = f"{kind} {cls.__name__}{{{', '.join(parts)}}}"
    if kind == "namedtuple":
        impl_check, impl_from_wire = _namedtuple_converters(cls, fields, desc)
    elif kind == "typeddict":
        impl_check = _map_converter(fields, desc, send=True)
        impl_from_wire = _map_converter(fields, desc, send=False)
    else:
        # Only a dataclass instance is a map to ormsgpack, and then only without
        # "_"-prefixed fields: anything else travels as the plain map of its fields.
        as_map = kind != "dataclass" or any(f.name.startswith("_") for f in fields)
        impl_check, impl_from_wire = _record_codegen(cls, fields, desc, as_map)
    node.fast_check = impl_check
    node.fast_from_wire = impl_from_wire
    return node


#: The resolved field types of each record compiled so far (`json_schemas` has no
#: namespace to resolve string annotations with).
_RESOLVED: weakref.WeakKeyDictionary[type, dict[str, Any]] = weakref.WeakKeyDictionary()


def _record_hints(cls: type, ctx: _Ctx, kind: str) -> dict[str, Any]:
    hints = _RESOLVED.get(cls)
    if hints is not None:
        return hints
    try:
        _RESOLVED[cls] = hints = typing.get_type_hints(
            cls, localns=dict(ctx.localns) if ctx.localns else None, include_extras=True
        )
        return hints
    except Exception as exc:
        raise ServiceDefinitionError(
            f"{ctx.where}: cannot resolve the field types of {kind} {cls.__name__}: {exc}"
        ) from exc


def _dataclass_decls(cls: type, hints: dict[str, Any], ctx: _Ctx) -> list[_Decl]:
    out: list[_Decl] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            raise ServiceDefinitionError(
                f"{ctx.where}: dataclass {cls.__name__} field '{f.name}' has init=False; "
                "such a field cannot be rebuilt on the receiving side"
            )
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, hints[f.name], required, bool(f.kw_only)))
    return out


def _struct_decls(cls: type, hints: dict[str, Any], ctx: _Ctx) -> list[_Decl]:
    msgspec = sys.modules["msgspec"]
    return [(f.name, f.type, f.required, True) for f in msgspec.structs.fields(cls)]


def _pydantic_decls(cls: type, hints: dict[str, Any], ctx: _Ctx) -> list[_Decl]:
    fields = cls.model_fields  # type: ignore[attr-defined]
    for name, f in fields.items():
        if f.alias not in (None, name):
            raise ServiceDefinitionError(
                f"{ctx.where}: model {cls.__name__} field '{name}' has the alias "
                f"{f.alias!r}; a model travels by field name, so aliases are not supported"
            )
    return [(name, hints[name], f.is_required(), True) for name, f in fields.items()]


def _typeddict_decls(cls: type, hints: dict[str, Any], ctx: _Ctx) -> list[_Decl]:
    required_keys = cls.__required_keys__  # type: ignore[attr-defined]
    out: list[_Decl] = []
    for name, tp in hints.items():
        # ``Required[...]``/``NotRequired[...]`` decide; the class's own sets cannot see
        # them in string annotations (``from __future__ import annotations``).
        required = name in required_keys
        qualifiers = _qualifiers()
        while (origin := typing.get_origin(tp)) in qualifiers:
            says = qualifiers[origin]
            required = required if says is None else says
            tp = typing.get_args(tp)[0]
        out.append((name, tp, required, True))
    return out


def _qualifiers() -> dict[object, bool | None]:
    """``Required``/``NotRequired`` (typing's and typing_extensions') → required."""
    out: dict[object, bool | None] = {typing.Required: True, typing.NotRequired: False}
    extensions = sys.modules.get("typing_extensions")
    if extensions is not None:
        out[extensions.Required] = True
        out[extensions.NotRequired] = False
        out[extensions.ReadOnly] = None  # keeps what the class says
    return out


def _namedtuple_decls(cls: type, hints: dict[str, Any], ctx: _Ctx) -> list[_Decl]:
    names: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]
    missing = [n for n in names if n not in hints]
    if missing:
        raise ServiceDefinitionError(
            f"{ctx.where}: namedtuple {cls.__name__} has no types for its fields "
            f"{', '.join(missing)}; declare it as a typing.NamedTuple class with annotations"
        )
    return [(name, hints[name], True, False) for name in names]


#: How each kind of record lists its declared fields.
_DECLARED: dict[str, Callable[[type, dict[str, Any], _Ctx], list[_Decl]]] = {
    "dataclass": _dataclass_decls,
    "struct": _struct_decls,
    "model": _pydantic_decls,
    "typeddict": _typeddict_decls,
    "namedtuple": _namedtuple_decls,
}


def _compile_fields(
    cls: type, kind: str, decls: list[_Decl], ctx: _Ctx
) -> tuple[list[_Field], list[str]]:
    """Compile the fields of a record; also return their parts of its description."""
    fields: list[_Field] = []
    parts: list[str] = []
    for name, hint, required, kw_only in decls:
        sub = _compile(hint, ctx, f"{kind} {cls.__name__} field '{name}'")
        fields.append(
            _Field(name, sub.fast_check, sub.fast_from_wire, required, kw_only, sub.inline)
        )
        parts.append(f"{name}: {sub.description}" + ("" if required else " = ..."))
    return fields, parts


def _map_converter(fields: list[_Field], desc: str, *, send: bool) -> Converter:
    """``check`` (``send``) or ``from_wire`` of a map of named fields (a ``TypedDict``, and
    what a record is built from): a dict, the value itself when nothing changed."""
    names = {f.name for f in fields}

    def convert(v: Any) -> Any:
        if type(v) is not dict and not (send and isinstance(v, dict)):
            raise _Invalid(desc, v)
        out: dict[str, Any] = {}
        changed = type(v) is not dict
        for f in fields:
            if f.name in v:
                x = v[f.name]
                try:
                    y = f.check(x) if send else f.from_wire(x)
                except _Invalid as exc:
                    exc.segments.append(f.name)
                    raise
                changed = changed or y is not x
                out[f.name] = y
            elif f.required:
                missing = _Invalid(desc, v, f"missing field '{f.name}' of {desc}")
                missing.segments.append(f.name)
                raise missing
        if len(out) != len(v):
            unknown = sorted(repr(k) for k in v if k not in names)
            raise _Invalid(desc, v, f"unknown field(s) {', '.join(unknown)} for {desc}")
        return out if changed else v

    return convert


def _namedtuple_converters(
    cls: type, fields: list[_Field], desc: str
) -> tuple[Converter, Converter]:
    """A ``NamedTuple`` travels as the array of its fields; it is rebuilt on receipt."""
    names = tuple(f.name for f in fields)
    checks = _tuple_apply(tuple(f.check for f in fields), labels=names)
    froms = _array_of(
        desc, len(fields), _tuple_apply(tuple(f.from_wire for f in fields), labels=names)
    )

    def check(v: Any) -> Any:
        if not isinstance(v, cls):
            raise _Invalid(desc, v)
        return checks(v)  # a plain tuple: ormsgpack encodes no subclass

    def from_wire(v: Any) -> Any:
        values = froms(v)
        try:
            return cls(*values)
        except Exception as exc:
            raise _ctor_rejected(cls, desc, v, exc) from exc

    return check, from_wire


def _dataclass_from_wire(cls: type, fields: list[_Field], desc: str) -> Converter:
    """The generated ``from_wire``'s slow path: the map of its fields, then the constructor."""
    fields_of = _map_converter(fields, desc, send=False)

    def from_wire(v: Any) -> Any:
        kwargs = fields_of(v)
        try:
            return cls(**kwargs)
        except Exception as exc:
            raise _ctor_rejected(cls, desc, v, exc) from exc

    return from_wire


def _binds_positionally(cls: type, fields: list[_Field]) -> bool:
    """True when passing the fields that are not keyword-only positionally binds like
    ``cls(**fields)``: so for the ``__init__`` dataclasses generates, not a hand-written one."""
    new: object = cls.__new__
    if type(cls).__call__ is not type.__call__ or new is not object.__new__:
        return False
    init = cls.__dict__.get("__init__")
    if not inspect.isfunction(init):
        return False
    try:
        params = list(inspect.signature(init, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - a plain function has one
        return False
    if not params or params[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
        return False
    positional = [f.name for f in fields if not f.kw_only]
    keyword = {f.name for f in fields if f.kw_only}
    rest = params[1:]
    head = rest[: len(positional)]
    tail = rest[len(positional) :]
    return (
        [p.name for p in head] == positional
        and all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in head)
        and {p.name for p in tail} == keyword
        and len(tail) == len(keyword)
        and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in tail)
    )


def _record_codegen(
    cls: type, fields: list[_Field], desc: str, as_map: bool
) -> tuple[Converter, Converter]:
    """Straight-line ``check``/``from_wire`` for a record, as dataclasses does ``__init__``.

    ``check`` loads each field as an attribute (``attrgetter`` for a name that is not an
    identifier), ``from_wire`` fetches them all with one ``itemgetter``; a field with an
    inline test is tested in place, the others call their converter in a ``try`` of their
    own that adds the ``.name`` segment. A map with missing or unknown keys goes to the slow
    ``from_wire``. ``as_map``: the checked value is always the plain map of its fields. The
    source names fields only as identifiers; keys and converters are passed in the namespace.
    """
    names = [f.name for f in fields]
    ns: dict[str, Any] = dict(_INLINE_NAMESPACE)
    ns.update(
        _cls=cls,
        _desc=desc,
        _Invalid=_Invalid,
        _slow_from=_dataclass_from_wire(cls, fields, desc),
        _get=operator.attrgetter(*names) if names else None,
        _items=operator.itemgetter(*names) if names else None,
        _rejected=lambda v, exc: _ctor_rejected(cls, desc, v, exc),
    )
    for i, f in enumerate(fields):
        ns.update({f"c{i}": f.check, f"f{i}": f.from_wire, f"k{i}": f.name})
    exec("\n".join(_codegen_check(fields, as_map) + _codegen_from_wire(cls, fields)) + "\n", ns)
    return ns["check"], ns["from_wire"]


def _codegen_convert(fields: list[_Field], i: int, conv: str, track: bool) -> list[str]:
    """Lines setting ``x{i}`` to the converted value (``ch`` when it changed)."""
    body = [
        "try:",
        f"    y = {conv}{i}(x{i})",
        "except _Invalid as e:",
        f"    e.segments.append(k{i})",
        "    raise",
    ]
    if track:
        body += [f"if y is not x{i}:", f"    x{i} = y", "    ch = True"]
    else:
        body[1] = f"    x{i} = {conv}{i}(x{i})"
    inline = fields[i].inline
    if inline is None:
        return body
    return [f"if not ({inline.format(x=f'x{i}')}):", *("    " + line for line in body)]


def _codegen_check(fields: list[_Field], as_map: bool) -> list[str]:
    n = len(fields)
    xs = ", ".join(f"x{i}" for i in range(n))
    src = [
        "def check(v):",
        "    if type(v) is _cls:",
        f"        ch = {as_map}",
        "    elif isinstance(v, _cls):",  # a subclass travels as the map of declared fields
        "        ch = True",
        "    else:",
        "        raise _Invalid(_desc, v)",
    ]
    if all(_plain_name(f.name) for f in fields):
        # Attribute loads in place (specialised by the interpreter) cost half of attrgetter.
        src += [f"    x{i} = v.{f.name}" for i, f in enumerate(fields)]
    elif n:
        src.append(f"    {xs} = _get(v)")
    for i in range(n):
        src += ["    " + line for line in _codegen_convert(fields, i, "c", True)]
    items = ", ".join(f"k{i}: x{i}" for i in range(n))
    return [*src, "    if ch:", f"        return {{{items}}}", "    return v"]


def _plain_name(name: str) -> bool:
    """Whether ``name`` can be written as ``v.name`` in generated source (a field name is
    the class author's, but a functional ``make_dataclass`` or ``defstruct`` may name one
    anything)."""
    return name.isidentifier() and not iskeyword(name)


def _codegen_from_wire(cls: type, fields: list[_Field]) -> list[str]:
    n = len(fields)
    if _binds_positionally(cls, fields):
        args = [f"x{i}" for i, f in enumerate(fields) if not f.kw_only]
        kws = [f"k{i}: x{i}" for i, f in enumerate(fields) if f.kw_only]
        if kws:
            args.append(f"**{{{', '.join(kws)}}}")
        call = f"_cls({', '.join(args)})"
    else:
        call = f"_cls(**{{{', '.join(f'k{i}: x{i}' for i in range(n))}}})"
    src = [
        "def from_wire(v):",
        f"    if type(v) is not dict or len(v) != {n}:",
        "        return _slow_from(v)",
    ]
    if n:
        xs = ", ".join(f"x{i}" for i in range(n))
        src += [
            "    try:",
            f"        {xs} = _items(v)",
            "    except KeyError:",
            "        return _slow_from(v)",
        ]
    for i in range(n):
        src += ["    " + line for line in _codegen_convert(fields, i, "f", False)]
    return [
        *src,
        "    try:",
        f"        return {call}",
        "    except Exception as exc:",
        "        raise _rejected(v, exc) from exc",
    ]


def _type_name(tp: object) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "")


def _compile(tp: object, ctx: _Ctx, inside: str | None = None) -> CompiledType:
    scalar = _SCALARS.get(tp) if _hashable(tp) else None
    if scalar is not None:
        return scalar
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _compile(args[0], ctx, inside)
    supertype = getattr(tp, "__supertype__", None)
    if supertype is not None:  # typing.NewType
        return _compile(supertype, ctx, inside)
    by_origin = _BY_ORIGIN.get(origin)
    if by_origin is not None:
        return by_origin(tp, args, ctx, inside)
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return _enum_node(tp, ctx.where)
        kind = _record_kind(tp)
        if kind is not None:
            return _record_node(tp, ctx, kind)
    raise _unsupported(tp, ctx, inside, _suggestion(tp, origin, args))


def _record_kind(tp: type) -> str | None:
    """Which kind of record ``tp`` is (a key of `_DECLARED`), if it is one (msgspec and
    pydantic are never imported: a class derived from theirs exists only once they are)."""
    if dataclasses.is_dataclass(tp):
        return "dataclass"
    if issubclass(tp, tuple) and hasattr(tp, "_fields"):
        return "namedtuple"
    if issubclass(tp, dict) and hasattr(tp, "__required_keys__"):
        return "typeddict"
    msgspec = sys.modules.get("msgspec")
    if msgspec is not None and issubclass(tp, msgspec.Struct):
        return "struct"
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(tp, pydantic.BaseModel):
        return "model"
    return None


def _unsupported(
    tp: object, ctx: _Ctx, inside: str | None, why: str = ""
) -> ServiceDefinitionError:
    text = f"{ctx.where}: unsupported type {_type_name(tp)}"
    if inside:
        text += f" (in {inside})"
    if why:
        text += f": {why}"
    return ServiceDefinitionError(text)


def _compile_list(tp: object, args: tuple[Any, ...], ctx: _Ctx, inside: str | None) -> CompiledType:
    if len(args) != 1:
        raise _unsupported(tp, ctx, inside, "write list[T]")
    return _list_node(_compile(args[0], ctx, _type_name(tp)))


def _compile_tuple(
    tp: object, args: tuple[Any, ...], ctx: _Ctx, inside: str | None
) -> CompiledType:
    if len(args) == 2 and args[1] is Ellipsis:
        return _var_tuple_node(_compile(args[0], ctx, _type_name(tp)))
    return _fixed_tuple_node([_compile(a, ctx, _type_name(tp)) for a in args])


def _compile_dict(tp: object, args: tuple[Any, ...], ctx: _Ctx, inside: str | None) -> CompiledType:
    if len(args) != 2 or (args[0] is not str and args[0] is not int):
        why = "" if len(args) != 2 else "map keys are str or int on the wire: "
        raise _unsupported(tp, ctx, inside, why + "write dict[str, T] or dict[int, T]")
    return _dict_node(_compile(args[1], ctx, _type_name(tp)), args[0])


def _compile_union(
    tp: object, args: tuple[Any, ...], ctx: _Ctx, inside: str | None
) -> CompiledType:
    return _union_node([_compile(a, ctx, _type_name(tp)) for a in args])


#: How each generic origin compiles: ``(tp, args, ctx, inside) -> node``.
_BY_ORIGIN: dict[object, Callable[[object, tuple[Any, ...], _Ctx, str | None], CompiledType]] = {
    list: _compile_list,
    tuple: _compile_tuple,
    dict: _compile_dict,
    typing.Union: _compile_union,
    types.UnionType: _compile_union,
    typing.Literal: lambda tp, args, ctx, inside: _literal_node(args, ctx.where),
}


#: Abstract containers and what to write instead (the runtime builds concrete values).
_ABSTRACT_SEQUENCES = {"Sequence", "MutableSequence", "Iterable", "Collection", "Set", "MutableSet"}


def _suggestion(tp: object, origin: object, args: tuple[object, ...]) -> str:
    """A hint for an unsupported annotation: what to write instead, when there is one."""
    if tp is typing.Any:
        return "Any is not supported; annotate the concrete type"
    if isinstance(tp, (str, typing.ForwardRef)):
        return "unresolved forward reference"
    if tp in (list, tuple, dict):
        return "parametrize it (list[int], tuple[int, ...], dict[str, float])"
    item = _type_name(args[0]) if len(args) == 1 else "T"
    if origin in (set, frozenset) or tp in (set, frozenset):
        return f"sets do not travel; use list[{item}] (or tuple[{item}, ...]) and convert"
    name = getattr(origin or tp, "__name__", "")
    if name in _ABSTRACT_SEQUENCES:
        return f"annotate a concrete container: list[{item}] or tuple[{item}, ...]"
    if name in ("Mapping", "MutableMapping"):
        return "annotate a concrete container: dict[str, T] or dict[int, T]"
    if tp is object:
        return "annotate the concrete type"
    if isinstance(tp, type) and tp.__module__ not in ("builtins", "typing", "collections.abc"):
        return (
            f"a plain class does not travel; make {tp.__name__} a @dataclass (or a "
            "NamedTuple, TypedDict, msgspec Struct or pydantic model) whose fields have "
            "supported types, or pass its fields as parameters"
        )
    return "see docs/services.md for the supported types"


def bad_result_message(qualname: str, error: object) -> str:
    """The engine's message for a result that failed its check, naming the method once:
    ``"Calc.bad returned a bad result: expected int, got str ('x')"`` (a nested path stays:
    ``"... bad result at result.x[0]: ..."``)."""
    text = str(error).removeprefix(f"{qualname}: ")
    if text.startswith("result: "):
        return f"{qualname} returned a bad result: {text.removeprefix('result: ')}"
    if text.startswith(("result.", "result[")):
        return f"{qualname} returned a bad result at {text}"
    return f"{qualname} returned a bad result: {text}"


def _hashable(tp: object) -> bool:
    try:
        hash(tp)
    except TypeError:
        return False
    return True


def compile_type(
    tp: object, *, where: str, localns: Mapping[str, Any] | None = None
) -> CompiledType:
    """Compile a resolved annotation (``list[int]``); ``where`` names it in errors
    (``"Calculator.add parameter 'x'"``), ``localns`` resolves the string annotations of
    record fields. Raises `ServiceDefinitionError` for what is not supported."""
    if not _arrays_registered and ("torch" in sys.modules or "numpy" in sys.modules):
        _register_arrays()
    return _compile(tp, _Ctx(where, localns))


# ----------------------------------------------------------------------- JSON Schema

_JSON_SCALARS: dict[object, dict[str, Any]] = {
    None: {"type": "null"},
    _NoneType: {"type": "null"},
    bool: {"type": "boolean"},
    int: {"type": "integer", "minimum": _I64_MIN, "maximum": _U64_END - 1},
    float: {"type": "number"},
    str: {"type": "string"},
    # As `tensorrpc call --json` prints them (tensorrpc.cli.to_json).
    bytes: {
        "type": "object",
        "properties": {"bytes": {"type": "string", "contentEncoding": "base64"}},
        "required": ["bytes"],
    },
}
_JSON_TENSOR = {"type": "object", "required": ["tensor"], "x-tensorrpc": "tensor"}


def json_schemas(annotations: list[object]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """JSON Schemas (draft 2020-12) of the values of supported annotations.

    Returns one schema per annotation and the ``$defs`` they share: records are defined
    there by class name (another class of the same name gets a suffix) and referenced as
    ``{"$ref": "#/$defs/Name"}``, recursive ones included. A tensor or array is an object
    marked ``"x-tensorrpc": "tensor"``; bytes are ``{"bytes": base64}`` (as ``tensorrpc
    call --json`` prints them); an int-keyed map is an object whose property names are
    decimal integers.
    """
    defs: dict[str, Any] = {}
    names: dict[type, str] = {}
    return [_json(tp, defs, names) for tp in annotations], defs


def _json(tp: object, defs: dict[str, Any], names: dict[type, str]) -> dict[str, Any]:
    if _hashable(tp) and tp in _JSON_SCALARS:
        return dict(_JSON_SCALARS[tp])
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _json(args[0], defs, names)
    if hasattr(tp, "__supertype__"):
        return _json(tp.__supertype__, defs, names)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_json(a, defs, names) for a in args]}
    if origin is typing.Literal:
        values = [v.value if isinstance(v, enum.Enum) else v for v in args]
        return {"enum": [_json_value(v) for v in values]}
    if origin in (list, tuple, dict):
        return _json_container(origin, args, defs, names)
    if not isinstance(tp, type):
        return dict(_JSON_TENSOR)  # numpy.typing.NDArray[...]
    if issubclass(tp, enum.Enum):
        return {"title": tp.__name__, "enum": [_json_value(m.value) for m in tp]}
    kind = _record_kind(tp)
    if kind is None:
        return dict(_JSON_TENSOR)  # torch.Tensor, numpy.ndarray
    return {"$ref": f"#/$defs/{_json_record(tp, kind, defs, names)}"}


def _json_container(
    origin: object, args: tuple[Any, ...], defs: dict[str, Any], names: dict[type, str]
) -> dict[str, Any]:
    if origin is list or (len(args) == 2 and args[1] is Ellipsis):
        return {"type": "array", "items": _json(args[0], defs, names)}
    if origin is tuple:
        items = [_json(a, defs, names) for a in args if a != ()]
        return {"type": "array", "prefixItems": items, "minItems": len(items)} | {
            "maxItems": len(items)
        }
    out = {"type": "object", "additionalProperties": _json(args[1], defs, names)}
    if args[0] is int:
        out["propertyNames"] = {"pattern": "^-?[0-9]+$"}
    return out


def _json_record(cls: type, kind: str, defs: dict[str, Any], names: dict[type, str]) -> str:
    """Define ``cls`` in ``defs`` (once) and return its name there."""
    name = names.get(cls)
    if name is not None:
        return name
    name, n = cls.__name__, 1
    while name in defs:
        n += 1
        name = f"{cls.__name__}_{n}"
    names[cls] = name
    defs[name] = {}  # reserved: recursive references resolve to it
    ctx = _Ctx("describe", None)
    decls = _DECLARED[kind](cls, _record_hints(cls, ctx, kind), ctx)
    props = {field: _json(hint, defs, names) for field, hint, _, _ in decls}
    schema: dict[str, Any] = {"title": cls.__name__, "x-tensorrpc": kind}
    if kind == "namedtuple":
        items = list(props.values())
        schema |= {"type": "array", "prefixItems": items, "minItems": len(items)}
        schema["maxItems"] = len(items)
    else:
        schema |= {"type": "object", "properties": props, "additionalProperties": False}
        schema["required"] = [field for field, _, required, _ in decls if required]
    defs[name] = schema
    return name


def _json_value(value: object) -> object:
    return {"bytes": base64.b64encode(value).decode()} if isinstance(value, bytes) else value
