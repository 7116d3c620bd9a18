"""Type hints → compiled validators and converters (sans-I/O).

:func:`compile_type` turns one annotation into a :class:`TypeSpec` node with two jobs:

* ``check`` (send side): verify a Python value against the annotation and return the
  value to put on the wire. That is the value itself almost always; an ``int`` given for
  a ``float`` becomes a ``float``, and subclasses of the scalar types (``IntEnum`` for
  ``int``, ``numpy.float64`` for ``float``) become the plain type, because ormsgpack
  refuses some of them. Tensors are never copied.
* ``from_wire`` (receive side): verify what the codec decoded (lists, dicts, ``str``,
  ``bytes``, ``int``, ``float``, ``bool``, ``None``, tensors and ndarrays) and build the
  typed value: a ``tuple`` from a list, a dataclass from a map, an ``Enum`` member from
  its value.

Both raise :class:`~tensorrpc.ValidationError` naming the path of the bad value
(``req.items[3].x``) and what was expected. Internally every node is a pair of closures
that raise the cheap :class:`_Invalid` without building any path string; the path is
assembled only when a value is actually rejected, so a valid call pays for no string
work at all. Containers whose elements are plain scalars are checked with one C-level
pass (``set(map(type, value))``) instead of a Python loop, and are returned without a
copy; the one thing that pass cannot see is an ``int`` beyond 64 bits inside a container,
which the codec's encoder refuses instead (a top-level ``int`` is range-checked here).

Supported annotations: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``list[T]``, ``tuple[T, ...]``, ``tuple[A, B]``, ``tuple[()]``, ``dict[str, T]``,
``Optional``/``Union`` (also ``X | Y``), ``Literal``, ``Enum`` subclasses (by value),
dataclasses (nested and recursive, by field name), ``torch.Tensor``, ``numpy.ndarray``
(also ``numpy.typing.NDArray[...]``, checked as any ndarray), and ``Annotated``/``NewType``
wrappers of these. ``Any``, bare ``list``/``dict``/``tuple`` and everything else are
refused with :class:`~tensorrpc.ServiceDefinitionError`.
"""

from __future__ import annotations

import dataclasses
import enum
import reprlib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from tensorrpc._exceptions import ServiceDefinitionError, ValidationError

__all__ = ["CompiledType", "TypeSpec", "compile_type", "describe_value", "too_deep"]

#: A compiled half of a node: takes a value, returns the converted value or raises
#: :class:`_Invalid`.
Converter = Callable[[Any], Any]

_NoneType = type(None)
_I64_MIN = -(1 << 63)
_U64_END = 1 << 64


class TypeSpec(Protocol):
    """One compiled annotation: a stable description plus a send-side and a receive-side check."""

    @property
    def description(self) -> str:
        """Normalised, stable text for the type (``list[int]``, ``Optional[str]``, ...)."""
        ...

    def check(self, value: object, path: str) -> object:
        """Validate a value about to be sent; return the value to put on the wire.

        Raises:
            ValidationError: ``value`` does not match; ``path`` prefixes the error's path.
        """
        ...

    def from_wire(self, value: object, path: str) -> object:
        """Validate a decoded wire value and build the typed Python value.

        Raises:
            ValidationError: ``value`` does not match; ``path`` prefixes the error's path.
        """
        ...


_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40
_repr.maxlist = 4
_repr.maxtuple = 4
_repr.maxdict = 4
_repr.maxlevel = 2


def describe_value(value: object) -> str:
    """Describe a rejected value briefly: its type and a truncated repr (``str ('x')``).

    Tensors and arrays are described by dtype and shape, never by their contents.
    """
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"Tensor(dtype={value.dtype}, shape={tuple(value.shape)})"
    if isinstance(value, np.ndarray):
        return f"ndarray(dtype={value.dtype}, shape={value.shape})"
    return f"{type(value).__name__} ({_repr.repr(value)})"


class _Invalid(Exception):
    """Internal, cheap rejection raised by compiled converters.

    Containers catch it only to push their path segment and re-raise, so the full path is
    assembled once, when the public API turns it into a :class:`ValidationError`.
    """

    def __init__(self, expected: str, value: object, reason: str | None = None) -> None:
        super().__init__(expected)
        self.expected = expected
        self.value = value
        self.reason = reason
        #: Path segments, innermost first (".x", "[3]").
        self.segments: list[str] = []
        #: An exception raised by user code (a dataclass ``__post_init__``), if any.
        self.cause: BaseException | None = None

    def path(self, root: str) -> str:
        return root + "".join(reversed(self.segments))

    def message(self, root: str) -> str:
        reason = self.reason or f"expected {self.expected}, got {describe_value(self.value)}"
        return f"{self.path(root)}: {reason}"

    def to_error(self, method: str, root: str) -> ValidationError:
        """Build the public error; ``method`` is ``Service.method`` or ``""``."""
        text = self.message(root)
        if method:
            text = f"{method}: {text}"
        return ValidationError(text, method=method, path=self.path(root), expected=self.expected)


def too_deep(method: str, root: str) -> ValidationError:
    """The error for a value nested beyond Python's recursion limit (recursive dataclasses)."""
    text = f"{root}: value is nested too deeply to validate"
    if method:
        text = f"{method}: {text}"
    return ValidationError(text, method=method, path=root, expected="a less deeply nested value")


class CompiledType:
    """The one concrete :class:`TypeSpec`: a description and two compiled converters.

    Attributes:
        description: Normalised, stable text for the type.
        fast_check: Send-side converter raising the internal ``_Invalid`` (hot path).
        fast_from_wire: Receive-side converter raising the internal ``_Invalid``.
        exact: When not ``None``, the exact Python types for which both converters return
            the value unchanged; containers use it to check scalar elements in one pass.
    """

    __slots__ = ("description", "exact", "fast_check", "fast_from_wire")

    def __init__(
        self,
        description: str,
        fast_check: Converter,
        fast_from_wire: Converter,
        exact: frozenset[type] | None = None,
    ) -> None:
        self.description = description
        self.fast_check = fast_check
        self.fast_from_wire = fast_from_wire
        self.exact = exact

    def check(self, value: object, path: str) -> object:
        """Validate a value about to be sent; return the value to put on the wire.

        Raises:
            ValidationError: ``value`` does not match.
        """
        try:
            return self.fast_check(value)
        except _Invalid as exc:
            raise exc.to_error("", path) from exc.cause
        except RecursionError:
            raise too_deep("", path) from None

    def from_wire(self, value: object, path: str) -> object:
        """Validate a decoded wire value and build the typed Python value.

        Raises:
            ValidationError: ``value`` does not match.
        """
        try:
            return self.fast_from_wire(value)
        except _Invalid as exc:
            raise exc.to_error("", path) from exc.cause
        except RecursionError:
            raise too_deep("", path) from None

    def __repr__(self) -> str:
        return f"<TypeSpec {self.description}>"


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
        return float(v)
    raise _Invalid("float", v)


def _float_from_wire(v: Any) -> Any:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise _Invalid("float", v)


def _str_check(v: Any) -> Any:
    if type(v) is str:
        return v
    if isinstance(v, str):
        return str.__str__(v)
    raise _Invalid("str", v)


def _str_from_wire(v: Any) -> Any:
    if type(v) is str:
        return v
    raise _Invalid("str", v)


def _bytes_check(v: Any) -> Any:
    if type(v) is bytes:
        return v
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    raise _Invalid("bytes", v)


def _bytes_from_wire(v: Any) -> Any:
    if type(v) is bytes:
        return v
    raise _Invalid("bytes", v)


def _tensor_conv(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v
    raise _Invalid("Tensor", v)


def _ndarray_conv(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v
    raise _Invalid("ndarray", v)


_NONE = CompiledType("None", _none_conv, _none_conv, frozenset({_NoneType}))
_BOOL = CompiledType("bool", _bool_conv, _bool_conv, frozenset({bool}))
# Containers of exact ints skip the 64-bit range check (a C-level pass over the element
# types is all they pay); an out-of-range int there is refused by the codec's encoder.
_INT = CompiledType("int", _int_check, _int_check, frozenset({int}))
_FLOAT = CompiledType("float", _float_check, _float_from_wire, frozenset({float}))
_STR = CompiledType("str", _str_check, _str_from_wire, frozenset({str}))
_BYTES = CompiledType("bytes", _bytes_check, _bytes_from_wire, frozenset({bytes}))
_TENSOR = CompiledType("Tensor", _tensor_conv, _tensor_conv)
_NDARRAY = CompiledType("ndarray", _ndarray_conv, _ndarray_conv)

_SCALARS: dict[object, CompiledType] = {
    None: _NONE,
    _NoneType: _NONE,
    bool: _BOOL,
    int: _INT,
    float: _FLOAT,
    str: _STR,
    bytes: _BYTES,
    torch.Tensor: _TENSOR,
    np.ndarray: _NDARRAY,
}

# ------------------------------------------------------------------------ containers


def _seq_fast(elem: CompiledType, values: Iterable[Any]) -> bool:
    """True when every element is already exactly right (one C-level pass)."""
    exact = elem.exact
    return exact is not None and set(map(type, values)) <= exact


def _list_node(elem: CompiledType) -> CompiledType:
    desc = f"list[{elem.description}]"
    echeck = elem.fast_check
    efrom = elem.fast_from_wire

    def check(v: Any) -> Any:
        if type(v) is not list:
            raise _Invalid(desc, v)
        if _seq_fast(elem, v):
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
            exc.segments.append(f"[{i}]")
            raise
        return v if out is None else out

    def from_wire(v: Any) -> Any:
        if type(v) is not list:
            if type(v) is tuple:
                v = list(v)
            else:
                raise _Invalid(desc, v)
        if _seq_fast(elem, v):
            return v
        return _map_indexed(efrom, v)

    return CompiledType(desc, check, from_wire)


def _map_indexed(conv: Converter, values: list[Any] | tuple[Any, ...]) -> list[Any]:
    try:
        return [conv(x) for x in values]
    except _Invalid:
        pass
    # Rejected: run again element by element to learn the index (failure path only).
    for i, x in enumerate(values):
        try:
            conv(x)
        except _Invalid as exc:
            exc.segments.append(f"[{i}]")
            raise
    raise AssertionError("unreachable: converter is not deterministic")  # pragma: no cover


def _var_tuple_node(elem: CompiledType) -> CompiledType:
    desc = f"tuple[{elem.description}, ...]"
    echeck = elem.fast_check
    efrom = elem.fast_from_wire

    def check(v: Any) -> Any:
        if type(v) is not tuple:
            if not isinstance(v, tuple):
                raise _Invalid(desc, v)
            v = tuple(v)  # a NamedTuple subclass travels as a plain tuple
        if _seq_fast(elem, v):
            return v
        return tuple(_map_indexed(echeck, v))

    def from_wire(v: Any) -> Any:
        if type(v) is not list and type(v) is not tuple:
            raise _Invalid(desc, v)
        if _seq_fast(elem, v):
            return tuple(v)
        return tuple(_map_indexed(efrom, v))

    return CompiledType(desc, check, from_wire)


def _fixed_tuple_node(elems: list[CompiledType]) -> CompiledType:
    desc = "tuple[" + (", ".join(e.description for e in elems) if elems else "()") + "]"
    checks = tuple(e.fast_check for e in elems)
    froms = tuple(e.fast_from_wire for e in elems)
    n = len(elems)

    def _apply(convs: tuple[Converter, ...], v: list[Any] | tuple[Any, ...]) -> tuple[Any, ...]:
        if len(v) != n:
            raise _Invalid(desc, v, f"expected {desc} of length {n}, got length {len(v)}")
        try:
            return tuple([c(x) for c, x in zip(convs, v, strict=True)])
        except _Invalid:
            pass
        for i, (c, x) in enumerate(zip(convs, v, strict=True)):
            try:
                c(x)
            except _Invalid as exc:
                exc.segments.append(f"[{i}]")
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def check(v: Any) -> Any:
        if not isinstance(v, tuple):
            raise _Invalid(desc, v)
        return _apply(checks, v)

    def from_wire(v: Any) -> Any:
        if type(v) is not list and type(v) is not tuple:
            raise _Invalid(desc, v)
        return _apply(froms, v)

    return CompiledType(desc, check, from_wire)


def _dict_node(val: CompiledType) -> CompiledType:
    desc = f"dict[str, {val.description}]"
    vcheck = val.fast_check
    vfrom = val.fast_from_wire

    def _keys_ok(v: dict[Any, Any]) -> None:
        if not set(map(type, v)) <= {str}:
            for k in v:
                if type(k) is not str:
                    raise _Invalid(
                        desc, v, f"expected {desc}, got a key of type {describe_value(k)}"
                    )

    def _apply(conv: Converter, v: dict[Any, Any]) -> dict[Any, Any]:
        _keys_ok(v)
        if not v or _seq_fast(val, v.values()):
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
            exc.segments.append(f"[{key!r}]")
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
    none_alt = [a for a in alts if a is _NONE]
    others = [a for a in alts if a is not _NONE]
    if none_alt and len(others) == 1:
        desc = f"Optional[{others[0].description}]"
    else:
        desc = "Union[" + ", ".join(a.description for a in alts) + "]"
    # An int must stay an int: try `int` before `float`, which would also accept it.
    order = sorted(alts, key=lambda a: 0 if a is _INT else 1)
    exact: frozenset[type] | None = frozenset()
    for a in alts:
        exact = exact | a.exact if (exact is not None and a.exact is not None) else None
    fast_types = frozenset().union(*(a.exact for a in alts if a.exact is not None))

    def _try(convs: list[Converter], v: Any) -> Any:
        best: _Invalid | None = None
        for conv in convs:
            try:
                return conv(v)
            except _Invalid as exc:
                # Prefer the error from an alternative that got inside the value: it
                # points at the nested field that is wrong.
                if exc.segments and (best is None or len(exc.segments) > len(best.segments)):
                    best = exc
        if best is not None:
            raise best
        raise _Invalid(desc, v)

    checks = [a.fast_check for a in order]
    froms = [a.fast_from_wire for a in order]

    if len(others) == 1 and none_alt:
        ocheck = others[0].fast_check
        ofrom = others[0].fast_from_wire

        def opt_check(v: Any) -> Any:
            if v is None:
                return None
            try:
                return ocheck(v)
            except _Invalid as exc:
                if exc.segments:
                    raise
                raise _Invalid(desc, v) from None

        def opt_from_wire(v: Any) -> Any:
            if v is None:
                return None
            try:
                return ofrom(v)
            except _Invalid as exc:
                if exc.segments:
                    raise
                raise _Invalid(desc, v) from None

        return CompiledType(desc, opt_check, opt_from_wire, exact)

    def check(v: Any) -> Any:
        if type(v) in fast_types:
            return v
        return _try(checks, v)

    def from_wire(v: Any) -> Any:
        if type(v) in fast_types:
            return v
        return _try(froms, v)

    return CompiledType(desc, check, from_wire, exact)


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
    kind = "flag" if issubclass(cls, enum.Flag) else "enum"
    desc = f"{kind} {cls.__name__}{{{', '.join(parts)}}}"
    is_flag = issubclass(cls, enum.Flag)

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
    """State of one :func:`compile_type` call: where, localns, dataclasses in progress."""

    __slots__ = ("in_progress", "localns", "where")

    def __init__(self, where: str, localns: Mapping[str, Any] | None) -> None:
        self.where = where
        self.localns = localns
        self.in_progress: dict[type, CompiledType] = {}


def _dataclass_node(cls: type, ctx: _Ctx) -> CompiledType:
    where = ctx.where
    placeholder = ctx.in_progress.get(cls)
    if placeholder is not None:
        return placeholder  # recursive reference: the node is filled in below
    try:
        hints = typing.get_type_hints(
            cls, localns=dict(ctx.localns) if ctx.localns else None, include_extras=True
        )
    except Exception as exc:
        raise ServiceDefinitionError(
            f"{where}: cannot resolve the field types of dataclass {cls.__name__}: {exc}"
        ) from exc

    # Fields are filled after the node exists so that recursive references resolve.
    fields: list[tuple[str, Converter, Converter, bool]] = []
    field_names: set[str] = set()
    desc_ref = [f"dataclass {cls.__name__}"]
    has_private = False

    def check(v: Any) -> Any:
        if type(v) is not cls:
            if not isinstance(v, cls):
                raise _Invalid(desc_ref[0], v)
            subclass = True
        else:
            subclass = False
        changed = subclass or has_private
        vals: list[Any] = []
        name = ""
        try:
            for name, fcheck, _, _ in fields:
                x = getattr(v, name)
                y = fcheck(x)
                changed = changed or y is not x
                vals.append(y)
        except _Invalid as exc:
            exc.segments.append(f".{name}")
            raise
        if not changed:
            return v
        # ormsgpack drops "_"-prefixed fields and would send a subclass's extra fields;
        # the plain map of declared fields is the same wire form.
        return {f[0]: y for f, y in zip(fields, vals, strict=True)}

    def from_wire(v: Any) -> Any:
        if type(v) is not dict:
            raise _Invalid(desc_ref[0], v)
        kwargs: dict[str, Any] = {}
        seen = 0
        for name, _, ffrom, required in fields:
            if name in v:
                try:
                    kwargs[name] = ffrom(v[name])
                except _Invalid as exc:
                    exc.segments.append(f".{name}")
                    raise
                seen += 1
            elif required:
                missing = _Invalid(desc_ref[0], v, f"missing field '{name}' of {desc_ref[0]}")
                missing.segments.append(f".{name}")
                raise missing
        if seen != len(v):
            unknown = sorted(repr(k) for k in v if k not in field_names)
            raise _Invalid(
                desc_ref[0], v, f"unknown field(s) {', '.join(unknown)} for {desc_ref[0]}"
            )
        try:
            return cls(**kwargs)
        except Exception as exc:
            err = _Invalid(desc_ref[0], v, f"{cls.__name__}(...) rejected the value: {exc!r}")
            err.cause = exc
            raise err from exc

    node = CompiledType(desc_ref[0], check, from_wire)
    ctx.in_progress[cls] = node
    try:
        parts = []
        for f in dataclasses.fields(cls):
            if not f.init:
                raise ServiceDefinitionError(
                    f"{where}: dataclass {cls.__name__} field '{f.name}' has init=False; "
                    "such a field cannot be rebuilt on the receiving side"
                )
            sub = _compile(hints[f.name], ctx, f"dataclass {cls.__name__} field '{f.name}'")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            fields.append((f.name, sub.fast_check, sub.fast_from_wire, required))
            field_names.add(f.name)
            has_private = has_private or f.name.startswith("_")
            parts.append(f"{f.name}: {sub.description}" + ("" if required else " = ..."))
    finally:
        del ctx.in_progress[cls]
    node.description = desc_ref[0] = f"dataclass {cls.__name__}{{{', '.join(parts)}}}"
    return node


_UNION_ORIGINS = (typing.Union, types.UnionType)


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

    def fail(why: str = "") -> ServiceDefinitionError:
        text = f"{ctx.where}: unsupported type {_type_name(tp)}"
        if inside:
            text += f" (in {inside})"
        if why:
            text += f": {why}"
        return ServiceDefinitionError(text)

    if origin is typing.Annotated:
        return _compile(args[0], ctx, inside)
    supertype = getattr(tp, "__supertype__", None)
    if supertype is not None:  # typing.NewType
        return _compile(supertype, ctx, inside)
    if tp is typing.Any:
        raise fail("Any is not supported; annotate the concrete type")
    if isinstance(tp, (str, typing.ForwardRef)):
        raise fail("unresolved forward reference")
    if origin is list:
        if len(args) != 1:
            raise fail("write list[T]")
        return _list_node(_compile(args[0], ctx, _type_name(tp)))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _var_tuple_node(_compile(args[0], ctx, _type_name(tp)))
        if args == ((),):  # typing.Tuple[()] on older Pythons
            args = ()
        return _fixed_tuple_node([_compile(a, ctx, _type_name(tp)) for a in args])
    if origin is dict:
        if len(args) != 2:
            raise fail("write dict[str, T]")
        if args[0] is not str:
            raise fail("dict keys must be str")
        return _dict_node(_compile(args[1], ctx, _type_name(tp)))
    if origin in _UNION_ORIGINS:
        return _union_node([_compile(a, ctx, _type_name(tp)) for a in args])
    if origin is typing.Literal:
        return _literal_node(args, ctx.where)
    if origin is np.ndarray:  # numpy.typing.NDArray[...] and np.ndarray[shape, dtype]
        return _NDARRAY
    if tp in (list, tuple, dict):
        raise fail("parametrize it (list[int], tuple[int, ...], dict[str, float])")
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return _enum_node(tp, ctx.where)
        if dataclasses.is_dataclass(tp):
            return _dataclass_node(tp, ctx)
    raise fail()


def _hashable(tp: object) -> bool:
    try:
        hash(tp)
    except TypeError:
        return False
    return True


def compile_type(
    tp: object, *, where: str, localns: Mapping[str, Any] | None = None
) -> CompiledType:
    """Compile a resolved type annotation into a :class:`TypeSpec`.

    Args:
        tp: The annotation, already resolved (no strings), e.g. ``list[int]``.
        where: What is being compiled, for error messages
            (``"Calculator.add parameter 'x'"``).
        localns: Extra names for resolving the string annotations of dataclass fields
            (the namespace a service class was defined in).

    Returns:
        The compiled node.

    Raises:
        ServiceDefinitionError: ``tp`` (or a type nested in it) is not supported; the
            message names ``where`` and the type.
    """
    return _compile(tp, _Ctx(where, localns))
