"""A reference validator for tests: what `tensorrpc._schema` must decide, written plainly.

`tensorrpc._schema.compile_type` builds one validator per annotation, fast: one-pass
``map(type)``/``list.count`` element checks, generated straight-line code for dataclasses,
inline tests. This module walks the annotation at every call instead, element by element
and field by field, with none of those tricks, so that property tests can require the two
to agree on every value: the same result (exact types, and the same object when the value
is returned unchanged) or the same `ValidationError` (message, path, field path,
expected). Only the wording of errors is shared (`_Invalid` builds the messages); no
decision is.

The rules it states, beyond "the value has the annotated type":

* send side (``check``): an ``int`` is accepted for a ``float`` and converted; subclasses
  of ``int``, ``float``, ``str`` and ``bytes`` (and ``bytearray``) become the plain type; a
  dataclass travels as the instance itself unless a field changed, it is a subclass, or it
  has ``_private`` fields (then as the plain map of its fields);
* receive side (``from_wire``): arrays may arrive as lists or tuples; an ``int`` is
  accepted for a ``float``; a dataclass comes as a map with every required field and no
  unknown key; an enum by its value;
* a top-level ``int`` (and one in a dataclass field, ``Optional``, or a container that is
  checked element by element) must fit in 64 bits; a container whose elements all have
  exactly a plain type is returned as is without looking at their values (the codec's
  encoder refuses an out-of-range ``int`` there); a ``Union`` returns a value of one of its
  members' plain types as is;
* a container or dataclass is returned as the very same object when nothing in it changed,
  except a fixed-length tuple, which is always rebuilt, and a list received element by
  element, which is always a new list.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import msgspec
import numpy as np
import torch
import typing_extensions

try:
    import pydantic
except ImportError:  # pragma: no cover - the dev extra installs it
    pydantic = None  # type: ignore[assignment]

from tensorrpc._schema import CompiledType, _compile, _Ctx, _Invalid, describe_value, too_deep

__all__ = ["Reference", "reference"]

_I64_MIN = -(1 << 63)
_U64_END = 1 << 64
_NoneType = type(None)
#: The dataclasses around a place in the annotation, outermost first.
In = tuple[type, ...]


@functools.cache
def _desc(tp: object, inside: tuple[type, ...] = ()) -> str:
    """``tp``'s description as compiled inside the dataclasses ``inside`` (outermost first).

    A dataclass being compiled is named without its fields where it recurs in itself.
    """
    ctx = _Ctx("oracle", None)
    for cls in inside:
        ctx.in_progress[cls] = CompiledType(f"dataclass {cls.__name__}", _no, _no)
    return _compile(tp, ctx).description


def _no(v: object) -> object:
    raise AssertionError("descriptions only")


def _unwrap(tp: object) -> object:
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif hasattr(tp, "__supertype__"):
            tp = tp.__supertype__
        else:
            return tp


def _is_union(tp: object) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


_PLAIN: dict[object, frozenset[type]] = {
    None: frozenset({_NoneType}),
    _NoneType: frozenset({_NoneType}),
    bool: frozenset({bool}),
    int: frozenset({int}),
    float: frozenset({float}),
    str: frozenset({str}),
    bytes: frozenset({bytes}),
    torch.Tensor: frozenset({torch.Tensor}),
    np.ndarray: frozenset({np.ndarray}),
}


def _plain_types(tp: object) -> frozenset[type] | None:
    """The exact types a value of ``tp`` may have to pass unchanged without a look inside."""
    tp = _unwrap(tp)
    if _is_union(tp):
        out: frozenset[type] = frozenset()
        for a in typing.get_args(tp):
            sub = _plain_types(a)
            if sub is None:
                return None
            out |= sub
        return out
    try:
        return _PLAIN.get(tp)
    except TypeError:
        return None


def _fits_int(v: int) -> bool:
    return _I64_MIN <= v < _U64_END


def _int(v: Any) -> Any:
    if type(v) is int:
        if _fits_int(v):
            return v
        raise _Invalid("int", v, f"int {v} is outside the 64-bit range msgpack can carry")
    if isinstance(v, int) and not isinstance(v, bool):
        return _int(int(v))
    raise _Invalid("int", v)


def _scalar(tp: object, v: Any, send: bool) -> Any:
    if tp is None or tp is _NoneType:
        if v is None:
            return v
        raise _Invalid("None", v)
    if tp is bool:
        if v is True or v is False:
            return v
        raise _Invalid("bool", v)
    if tp is int:
        return _int(v)
    if tp is float:
        if type(v) is float:
            return v
        if type(v) is int or (
            send and (isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool)))
        ):
            return float(v)
        raise _Invalid("float", v)
    if tp is str:
        if type(v) is str:
            return v
        if send and isinstance(v, str):
            return str.__str__(v)
        raise _Invalid("str", v)
    if tp is bytes:
        if type(v) is bytes:
            return v
        if send and isinstance(v, (bytes, bytearray)):
            return bytes(v)
        raise _Invalid("bytes", v)
    if tp is torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v
        raise _Invalid("Tensor", v)
    assert tp is np.ndarray
    if isinstance(v, np.ndarray):
        return v
    raise _Invalid("ndarray", v)


def _all_plain(elem: object, values: Any) -> bool:
    plain = _plain_types(elem)
    return plain is not None and all(type(x) in plain for x in values)


def _each(elem: object, values: Any, send: bool, inside: In) -> list[Any]:
    out = []
    for i, x in enumerate(values):
        try:
            out.append(_conv(elem, x, send, inside))
        except _Invalid as exc:
            exc.segments.append(i)
            raise
    return out


def _list(tp: object, elem: object, v: Any, send: bool, inside: In) -> Any:
    if send:
        if type(v) is not list:
            raise _Invalid(_desc(tp, inside), v)
        if _all_plain(elem, v):
            return v
        out = _each(elem, v, send, inside)
        return v if all(a is b for a, b in zip(out, v, strict=True)) else out
    if type(v) is tuple:
        v = list(v)
    elif type(v) is not list:
        raise _Invalid(_desc(tp, inside), v)
    return v if _all_plain(elem, v) else _each(elem, v, send, inside)


def _var_tuple(tp: object, elem: object, v: Any, send: bool, inside: In) -> Any:
    if send:
        if not isinstance(v, tuple):
            raise _Invalid(_desc(tp, inside), v)
        v = tuple(v)
    elif type(v) is not list and type(v) is not tuple:
        raise _Invalid(_desc(tp, inside), v)
    if _all_plain(elem, v):
        return tuple(v)
    return tuple(_each(elem, v, send, inside))


def _fixed_tuple(tp: object, elems: tuple[Any, ...], v: Any, send: bool, inside: In) -> Any:
    desc = _desc(tp, inside)
    if (send and not isinstance(v, tuple)) or (
        not send and type(v) is not list and type(v) is not tuple
    ):
        raise _Invalid(desc, v)
    if len(v) != len(elems):
        raise _Invalid(desc, v, f"expected {desc} of length {len(elems)}, got length {len(v)}")
    out = []
    for i, (e, x) in enumerate(zip(elems, v, strict=True)):
        try:
            out.append(_conv(e, x, send, inside))
        except _Invalid as exc:
            exc.segments.append(i)
            raise
    return tuple(out)


def _dict(tp: object, key: type, val: object, v: Any, send: bool, inside: In) -> Any:
    desc = _desc(tp, inside)
    if (send and not isinstance(v, dict)) or (not send and type(v) is not dict):
        raise _Invalid(desc, v)
    for k in v:
        if type(k) is not key:
            raise _Invalid(desc, v, f"expected {desc}, got a key of type {describe_value(k)}")
    out_of_range = [k for k in v if key is int and not _fits_int(k)]
    if out_of_range:  # the lowest key if it is too low, else the highest
        k = min(v) if min(out_of_range) < _I64_MIN else max(v)
        raise _Invalid(desc, v, f"key int {k} is outside the 64-bit range msgpack can carry")
    if not v or _all_plain(val, v.values()):
        return v
    out = {}
    for k, x in v.items():
        try:
            out[k] = _conv(val, x, send, inside)
        except _Invalid as exc:
            exc.segments.append((k,))
            raise
    return v if all(out[k] is x for k, x in v.items()) else out


def _union(tp: object, v: Any, send: bool, inside: In) -> Any:
    alts = typing.get_args(tp)
    others = [a for a in alts if _unwrap(a) not in (None, _NoneType)]
    if len(others) == 1 and len(others) < len(alts):  # Optional[T]
        if v is None:
            return None
        try:
            return _conv(others[0], v, send, inside)
        except _Invalid as exc:
            if exc.segments:
                raise
            raise _Invalid(_desc(tp, inside), v) from None
    plain = frozenset().union(*(p for p in map(_plain_types, alts) if p is not None))
    if type(v) in plain:
        return v
    best: _Invalid | None = None
    for alt in sorted(alts, key=lambda a: 0 if _unwrap(a) is int else 1):
        try:
            return _conv(alt, v, send, inside)
        except _Invalid as exc:
            if exc.segments and (best is None or len(exc.segments) > len(best.segments)):
                best = exc
    if best is not None:
        raise best
    raise _Invalid(_desc(tp, inside), v)


def _literal(tp: object, v: Any, send: bool, inside: In) -> Any:
    for lit in typing.get_args(tp):
        if send:
            if v is lit or (type(v) is type(lit) and v == lit):
                return v
        else:
            wire = lit.value if isinstance(lit, enum.Enum) else lit
            if type(v) is type(wire) and v == wire:
                return lit
    raise _Invalid(_desc(tp, inside), v)


def _enum(cls: type[enum.Enum], v: Any, send: bool, inside: In) -> Any:
    if send:
        if isinstance(v, cls):
            return v
        raise _Invalid(_desc(cls, inside), v)
    for member in cls.__members__.values():  # values are scalars: == cannot raise
        if type(member.value) is type(v) and (member.value is v or member.value == v):
            return member
    if issubclass(cls, enum.Flag) and type(v) is int:
        try:
            return cls(v)
        except ValueError:
            pass
    raise _Invalid(_desc(cls, inside), v)


def _kind(cls: type) -> str | None:
    if dataclasses.is_dataclass(cls):
        return "dataclass"
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return "namedtuple"
    if typing.is_typeddict(cls) or (issubclass(cls, dict) and hasattr(cls, "__required_keys__")):
        return "typeddict"
    if issubclass(cls, msgspec.Struct):
        return "struct"
    if pydantic is not None and issubclass(cls, pydantic.BaseModel):
        return "model"
    return None


def _fields(cls: type, kind: str) -> list[tuple[str, object, bool]]:
    """(name, annotation, required) of each field, in order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    if kind == "dataclass":
        return [
            (f.name, hints[f.name], f.default is f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        ]
    if kind == "namedtuple":
        return [(name, hints[name], True) for name in cls._fields]  # type: ignore[attr-defined]
    if kind == "typeddict":
        out = []
        for name, tp in hints.items():
            required = name in cls.__required_keys__  # type: ignore[attr-defined]
            origin = typing.get_origin(tp)
            if origin in (typing.Required, typing_extensions.Required):
                required, tp = True, typing.get_args(tp)[0]
            elif origin in (typing.NotRequired, typing_extensions.NotRequired):
                required, tp = False, typing.get_args(tp)[0]
            out.append((name, tp, required))
        return out
    if kind == "struct":
        return [(f.name, f.type, f.required) for f in msgspec.structs.fields(cls)]
    return [(n, hints[n], f.is_required()) for n, f in cls.model_fields.items()]  # type: ignore[attr-defined]


def _field(name: str, tp: object, x: Any, send: bool, inside: In) -> Any:
    try:
        return _conv(tp, x, send, inside)
    except _Invalid as exc:
        exc.segments.append(name)
        raise


def _record(cls: type, kind: str, v: Any, send: bool, inside: In) -> Any:
    if cls in inside:  # a recursive reference: the node compiled where it first occurred
        inside = inside[: inside.index(cls)]
    desc = _desc(cls, inside)
    inside = (*inside, cls)
    fields = _fields(cls, kind)
    if kind == "namedtuple":
        return _namedtuple(cls, fields, desc, v, send, inside)
    if send and kind != "typeddict":
        if not isinstance(v, cls):
            raise _Invalid(desc, v)
        out = {name: _field(name, tp, getattr(v, name), send, inside) for name, tp, _ in fields}
        # Only a dataclass instance of exactly this class, without "_" fields and with no
        # field changed, travels as itself; anything else as the map of its fields.
        as_is = (
            kind == "dataclass"
            and type(v) is cls
            and not any(name.startswith("_") for name in out)
            and all(out[name] is getattr(v, name) for name in out)
        )
        return v if as_is else out
    if type(v) is not dict and not (send and isinstance(v, dict)):
        raise _Invalid(desc, v)
    kwargs = {}
    for name, tp, required in fields:
        if name in v:
            kwargs[name] = _field(name, tp, v[name], send, inside)
        elif required:
            missing = _Invalid(desc, v, f"missing field '{name}' of {desc}")
            missing.segments.append(name)
            raise missing
    unknown = sorted(repr(k) for k in v if k not in {name for name, _, _ in fields})
    if unknown:
        raise _Invalid(desc, v, f"unknown field(s) {', '.join(unknown)} for {desc}")
    if kind == "typeddict":
        same = type(v) is dict and all(kwargs[k] is v[k] for k in kwargs)
        return v if same else kwargs
    return _construct(cls, desc, v, lambda: cls(**kwargs))


def _namedtuple(
    cls: type, fields: list[tuple[str, object, bool]], desc: str, v: Any, send: bool, inside: In
) -> Any:
    if send:
        if not isinstance(v, cls):
            raise _Invalid(desc, v)
        return tuple(_field(n, tp, getattr(v, n), send, inside) for n, tp, _ in fields)
    if type(v) is not list and type(v) is not tuple:
        raise _Invalid(desc, v)
    if len(v) != len(fields):
        raise _Invalid(desc, v, f"expected {desc} of length {len(fields)}, got length {len(v)}")
    values = [_field(n, tp, x, send, inside) for (n, tp, _), x in zip(fields, v, strict=True)]
    return _construct(cls, desc, v, lambda: cls(*values))


def _construct(cls: type, desc: str, v: Any, make: Any) -> Any:
    try:
        return make()
    except Exception as exc:
        err = _Invalid(desc, v, f"{cls.__name__}(...) rejected the value: {exc!r}")
        err.cause = exc
        raise err from exc


def _conv(tp: object, v: Any, send: bool, inside: In) -> Any:
    """``v`` checked against ``tp`` (``send``: as sent; else as received), or raises `_Invalid`."""
    tp = _unwrap(tp)
    if _is_union(tp):
        return _union(tp, v, send, inside)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return _list(tp, args[0], v, send, inside)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _var_tuple(tp, args[0], v, send, inside)
        return _fixed_tuple(tp, args, v, send, inside)
    if origin is dict:
        return _dict(tp, args[0], args[1], v, send, inside)
    if origin is typing.Literal:
        return _literal(tp, v, send, inside)
    if origin is np.ndarray or tp is np.ndarray:
        return _scalar(np.ndarray, v, send)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp, v, send, inside)
    kind = _kind(tp) if isinstance(tp, type) else None
    if kind is not None:
        assert isinstance(tp, type)
        return _record(tp, kind, v, send, inside)
    return _scalar(tp, v, send)


class Reference:
    """The reference validator of one annotation, with the interface of a `CompiledType`."""

    def __init__(self, tp: object) -> None:
        self.tp = tp
        self.description = _desc(tp)

    def _run(self, value: object, path: str, send: bool) -> object:
        try:
            return _conv(self.tp, value, send, ())
        except _Invalid as exc:
            raise exc.to_error("", path) from exc.cause
        except RecursionError:
            raise too_deep("", path) from None

    def check(self, value: object, path: str) -> object:
        """What ``CompiledType.check`` must return or raise."""
        return self._run(value, path, True)

    def from_wire(self, value: object, path: str) -> object:
        """What ``CompiledType.from_wire`` must return or raise."""
        return self._run(value, path, False)


def reference(tp: object) -> Reference:
    """The reference validator of ``tp``."""
    return Reference(tp)
