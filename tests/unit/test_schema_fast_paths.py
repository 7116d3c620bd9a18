"""The schema's validators decide exactly what the reference validator decides.

``compile_type`` builds the fast form: one-pass ``map(type)``/``list.count`` element checks
for containers and generated straight-line code for dataclasses. ``schema_oracle`` walks
the annotation plainly, element by element and field by field. Every test here runs both
and requires the same outcome: the same output (types included, and the same object when
the input is returned as is) or the same :class:`ValidationError` (message, path, field
path, expected).
"""

# Optional[...] and Union[...] are spelled out on purpose: users write them.
# ruff: noqa: UP007, UP045

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import functools
import math
import time
import types
import typing
from typing import Any, Literal, Optional, Union

import hypothesis
import hypothesis.strategies as st
import numpy as np
import ormsgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tensorrpc._exceptions import ValidationError
from tensorrpc._schema import CompiledType, compile_type
from tensorrpc._service import describe, rpc, service
from tests.unit.schema_oracle import Reference, reference

# --------------------------------------------------------------------------- helpers


class MyInt(int):
    pass


class MyStr(str):
    pass


class MyFloat(float):
    pass


class MyBytes(bytes):
    pass


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class RAdd:
    """Not an int, but ``sum()`` would take it for one (``0 + RAdd() == 0``)."""

    def __radd__(self, other: object) -> object:
        return other

    def __index__(self) -> int:
        return 0


@functools.cache
def both(tp: object) -> tuple[CompiledType | Reference, CompiledType | Reference]:
    fast = compile_type(tp, where="w")
    ref = reference(tp)
    assert fast.description == ref.description
    return fast, ref


def outcome(fn: Any, value: object) -> tuple[Any, ...]:
    try:
        out = fn(value, "req.p")
    except ValidationError as exc:
        return ("error", str(exc), exc.path, exc.field_path, exc.expected, type(exc.__cause__))
    return ("ok", out, out is value)


def same(a: object, b: object) -> bool:
    """Equal with exact types all the way down (``1``, ``True`` and ``1.0`` differ)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (torch.Tensor, np.ndarray)):
        return a is b
    if isinstance(a, float):
        assert isinstance(b, float)
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def assert_same_outcome(tp: object, value: object, *, sides: str = "both") -> str:
    """Run both forms on ``value``; returns ``"ok"`` or ``"error"`` (the last side run)."""
    fast, ref = both(tp)
    pairs = []
    if sides in ("both", "check"):
        pairs.append((fast.check, ref.check))
    if sides in ("both", "wire"):
        pairs.append((fast.from_wire, ref.from_wire))
    for f, r in pairs:
        got, want = outcome(f, value), outcome(r, value)
        assert got[0] == want[0], (tp, value, got, want)
        if got[0] == "ok":
            assert same(got[1], want[1]), (tp, value, got, want)
            assert got[2] == want[2], (tp, value, "returned as is in one form only")
        else:
            assert got == want
    return str(got[0])


# ----------------------------------------------------------------------- strategies

INTS = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
#: Everything that can go wrong inside a container of scalars.
INTRUDERS = st.one_of(
    st.sampled_from(
        [True, False, 0, 1, -1, 0.0, 1.0, None, "", "1", b"1", 1 << 63, 1 << 64, -(1 << 63) - 1]
    ),
    st.integers(),  # beyond 64 bits too
    st.floats(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1).map(MyInt),
    st.sampled_from(list(Level)),
    st.sampled_from(list(Color)),
    st.text(max_size=3).map(MyStr),
    st.floats(allow_nan=False).map(MyFloat),
    st.binary(max_size=3).map(MyBytes),
    st.builds(bytearray, st.binary(max_size=3)),
    st.integers(-5, 5).map(np.int64),
    st.floats(allow_nan=False, allow_infinity=False).map(np.float64),
    st.lists(st.integers(0, 3), max_size=2),
    st.tuples(st.integers(0, 3)),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
    st.just(RAdd()),
    st.just(torch.zeros(2)),
    st.just(np.zeros(2)),
    st.just(torch.nn.Parameter(torch.zeros(1))),
)


@functools.cache  # one strategy per base: hypothesis reads a composite's source when made
def homogeneous(base: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Lists of ``base`` values, often with a few intruders at random positions."""

    @st.composite
    def build(draw: st.DrawFn) -> list[Any]:
        values = draw(st.lists(base, max_size=40))
        for _ in range(draw(st.integers(0, 3))):
            position = draw(st.integers(0, len(values)))
            values.insert(position, draw(INTRUDERS))
        return values

    return build()


SCALAR_CASES: list[tuple[object, st.SearchStrategy[Any]]] = [
    (int, INTS),
    (int, st.integers(0, 3)),  # 0 and 1: where an int and a bool are equal
    (float, st.floats()),
    (float, INTS),  # ints for floats: converted on both sides
    (str, st.text(max_size=4)),
    (bytes, st.binary(max_size=4)),
    (bool, st.booleans()),
    (Optional[int], st.none() | INTS),
    (Union[int, str], INTS | st.text(max_size=3)),
    (Optional[float], st.none() | st.floats()),
    (torch.Tensor, st.just(torch.ones(1))),
    (np.ndarray, st.just(np.ones(1))),
    (Level, st.sampled_from(list(Level))),
    (Literal[1, "a"], st.sampled_from([1, "a"])),
]


@pytest.mark.parametrize(("elem", "values"), SCALAR_CASES, ids=lambda c: repr(c)[:40])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_containers_of_scalars_decide_like_the_reference(
    elem: object, values: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    items = data.draw(homogeneous(values))
    keys = [f"k{i}" for i in range(len(items))]
    assert_same_outcome(list[elem], items)  # type: ignore[valid-type]
    assert_same_outcome(list[elem], tuple(items), sides="wire")  # type: ignore[valid-type]
    assert_same_outcome(tuple[elem, ...], tuple(items))  # type: ignore[valid-type]
    assert_same_outcome(tuple[elem, ...], items, sides="wire")  # type: ignore[valid-type]
    assert_same_outcome(dict[str, elem], dict(zip(keys, items, strict=True)))  # type: ignore[valid-type]
    assert_same_outcome(Optional[list[elem]], items)  # type: ignore[valid-type]
    assert_same_outcome(list[list[elem]], [items, items[:1]])  # type: ignore[valid-type]


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.text(max_size=2) | INTRUDERS, max_size=6))
def test_dict_keys_decide_like_the_reference(keys: list[Any]) -> None:
    value: dict[Any, int] = {}
    for k in keys:
        with contextlib.suppress(TypeError, ValueError):  # unhashable; numpy vs bytes
            value[k] = 1
    assert_same_outcome(dict[str, int], value)


@settings(max_examples=120, deadline=None)
@given(value=INTRUDERS | INTS | st.lists(INTRUDERS, max_size=3))
def test_anything_but_a_list_decides_like_the_reference(value: object) -> None:
    assert_same_outcome(list[int], value)
    assert_same_outcome(Optional[list[int]], value)
    assert_same_outcome(dict[str, float], value)


def test_valid_token_ids_are_returned_without_a_copy() -> None:
    ids = list(range(2048))
    fast, _ = both(list[int])
    assert fast.check(ids, "p") is ids
    assert fast.from_wire(ids, "p") is ids
    floats = [0.5] * 100
    assert both(list[float])[0].check(floats, "p") is floats
    # Exact ints beyond 64 bits pass a container's one-pass check as before; the codec's
    # encoder refuses them (a top-level int is range-checked here).
    big = [1, 1 << 64]
    assert fast.check(big, "p") is big
    with pytest.raises(ValidationError, match="outside the 64-bit range"):
        compile_type(int, where="w").check(1 << 64, "p")


@pytest.mark.parametrize(
    ("tp", "value", "message"),
    [
        (list[int], [1, 2, True], "req.prompt[2]: expected int, got bool (True)"),
        (list[int], [*range(17), False], "req.prompt[17]: expected int, got bool (False)"),
        (list[int], [1, 2.0], "req.prompt[1]: expected int, got float (2.0)"),
        (list[int], [1, None], "req.prompt[1]: expected int, got None"),
        (list[int], [1, "2"], "req.prompt[1]: expected int, got str ('2')"),
        (list[int], [[1]], "req.prompt[0]: expected int, got list ([1])"),
        (list[int], [0, MyInt(1), 1 << 64], "req.prompt[2]: int 18446744073709551616 is outside"),
        (list[float], [1.0, True], "req.prompt[1]: expected float, got bool (True)"),
        (list[str], ["a", b"b"], "req.prompt[1]: expected str, got bytes (b'b')"),
        (list[bool], [True, 1], "req.prompt[1]: expected bool, got int (1)"),
        (tuple[int, ...], (1, True), "req.prompt[1]: expected int, got bool (True)"),
        (dict[str, int], {"a": 1, "b": True}, "req.prompt['b']: expected int, got bool (True)"),
        (Optional[list[int]], [1, True], "req.prompt[1]: expected int, got bool (True)"),
        (list[list[int]], [[1], [2, True]], "req.prompt[1][1]: expected int, got bool (True)"),
        (tuple[int, str], (1, 2), "req.prompt[1]: expected str, got int (2)"),
    ],
)
def test_error_messages_and_paths_are_unchanged(tp: object, value: object, message: str) -> None:
    # The codec decodes every array as a list.
    wire = list(value) if isinstance(value, tuple) else value
    for node in both(tp):
        for fn, arg in ((node.check, value), (node.from_wire, wire)):
            with pytest.raises(ValidationError) as info:
                fn(arg, "req.prompt")
            assert str(info.value).startswith(message), str(info.value)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 300), data=st.data())
def test_the_failing_index_is_found_in_one_pass(n: int, data: st.DataObject) -> None:
    bad = data.draw(st.integers(0, n - 1))
    intruder = data.draw(st.sampled_from([True, "x", None, 1.5, [1]]))
    values: list[Any] = list(range(n))
    values[bad] = intruder
    for tp, sent in ((list[int], values), (tuple[int, ...], tuple(values))):
        for node in both(tp):
            for fn, arg in ((node.check, sent), (node.from_wire, values)):
                with pytest.raises(ValidationError) as info:
                    fn(arg, "p")
                assert info.value.path == f"p[{bad}]"


# ----------------------------------------------------------------------- dataclasses


@dataclasses.dataclass(slots=True)
class Sampling:
    n: int = 1
    temperature: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: Optional[int] = None
    ignore_eos: bool = False
    kind: Level = Level.LOW
    color: Color = Color.RED
    tag: Literal["a", "b"] = "a"
    blob: bytes = b""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    pair: tuple[int, str] = (0, "")


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: str
    prompt: Optional[list[int]]
    tensor: Optional[torch.Tensor]
    sampling: Sampling
    arrival: float
    extra: Optional[Sampling] = None
    priority: int = dataclasses.field(default=0, kw_only=True)


@dataclasses.dataclass
class Single:
    x: int


@dataclasses.dataclass
class Clashing:
    """Field names that are also names in the generated code must not matter."""

    v: int
    x0: str
    y: float
    ch: bool
    e: int
    exc: int
    int: str
    type: str
    len: builtins.int  # "int" is the field now
    self: builtins.int = 0


@dataclasses.dataclass
class Checked:
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low > high")


@dataclasses.dataclass(init=False)
class HandInit:
    a: int
    b: str

    def __init__(self, b: str, a: int) -> None:  # the other order, on purpose
        self.a = a
        self.b = b


@dataclasses.dataclass(kw_only=True)
class KwOnly:
    a: int
    b: str = "b"


@dataclasses.dataclass
class Priv:
    a: int
    _b: str = "h"


@dataclasses.dataclass
class Node:
    value: int
    children: list[Node] = dataclasses.field(default_factory=list)
    pair: Optional[tuple[Node, Node]] = None
    rest: tuple[Node, ...] = ()


@dataclasses.dataclass
class SubSingle(Single):
    extra: str = ""


DATACLASSES: list[type] = [
    Sampling,
    Request,
    Single,
    Clashing,
    Checked,
    HandInit,
    KwOnly,
    Priv,
    Node,
]

#: A value for a field: usually a fitting one, sometimes anything at all.
FIELD_VALUES = st.one_of(
    INTS,
    st.floats(),
    st.text(max_size=3),
    st.booleans(),
    st.none(),
    st.binary(max_size=2),
    st.sampled_from(list(Level) + list(Color) + ["a", "b", 1, 2, "red"]),
    homogeneous(st.integers(0, 5)),
    homogeneous(st.text(max_size=2)),
    st.dictionaries(st.text(max_size=2), st.floats() | INTRUDERS, max_size=2),
    st.tuples(INTS, st.text(max_size=2)).map(list),
    st.just(torch.zeros(2)),
    INTRUDERS,
)


@functools.cache
def _fitting(tp: object, wire: bool, depth: int) -> st.SearchStrategy[Any]:
    """Values of type ``tp``: as the codec decodes them (``wire``) or as a caller passes them."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (int, float, str, bytes, bool, type(None)):
        return {
            int: INTS,
            float: st.floats() | st.integers(-3, 3),
            str: st.text(max_size=3),
            bytes: st.binary(max_size=3),
            bool: st.booleans(),
            type(None): st.none(),
        }[tp]
    if tp is torch.Tensor:
        return st.just(torch.zeros(2))
    if origin in (Union, types.UnionType):
        return st.one_of(*(_fitting(a, wire, depth) for a in args))
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return _some(_fitting(args[0], wire, depth), 5)
    if origin is dict:
        elem = _fitting(args[1], wire, depth)
        return st.dictionaries(st.text(max_size=2), elem, max_size=0 if elem.is_empty else 3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            items = _some(_fitting(args[0], wire, depth), 2)
        else:
            items = st.tuples(*(_fitting(a, wire, depth) for a in args)).map(list)
        return items if wire else items.map(tuple)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = st.sampled_from(list(tp))
        return members.map(lambda m: m.value) if wire else members
    assert isinstance(tp, type), tp
    assert dataclasses.is_dataclass(tp), tp
    if depth <= 0:
        return st.nothing()  # deep enough: see _some
    return _wire_dict(tp, depth - 1) if wire else _instance(tp, depth - 1)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _some(elem: st.SearchStrategy[Any], most: int) -> st.SearchStrategy[list[Any]]:
    return st.lists(elem, max_size=0 if elem.is_empty else most)


#: Made once: a strategy made per draw costs a lookup in hypothesis's strategy cache.
ONE_IN_20 = st.integers(0, 19)
UNKNOWN_KEYS = st.text(max_size=3)


def _or_junk(draw: st.DrawFn, fitting: st.SearchStrategy[Any]) -> Any:
    """Mostly a fitting value, sometimes anything at all."""
    if fitting.is_empty or draw(ONE_IN_20) == 0:
        return draw(FIELD_VALUES)
    return draw(fitting)


@functools.cache
def _wire_dict(cls: type, depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    """Maps such as the codec decodes: all fields, or some missing, or unknown keys."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if draw(ONE_IN_20) == 0:
                continue  # missing
            out[f.name] = _or_junk(draw, _fitting(_hints(cls)[f.name], True, depth))
        if draw(ONE_IN_20) == 0:
            out[draw(UNKNOWN_KEYS)] = 1
        return out

    return build()


@functools.cache
def _instance(cls: type, depth: int = 2) -> st.SearchStrategy[Any]:
    """Instances with arbitrary field values (``__init__`` bypassed), now and then a subclass."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        target = SubSingle if cls is Single and draw(st.booleans()) else cls
        obj: Any = object.__new__(target)
        for f in dataclasses.fields(target):
            value = _or_junk(draw, _fitting(_hints(target)[f.name], False, depth))
            object.__setattr__(obj, f.name, value)
        return obj

    return build()


@pytest.mark.parametrize("cls", DATACLASSES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_dataclasses_decide_like_the_reference(cls: type, data: st.DataObject) -> None:
    wire, instance = data.draw(_wire_dict(cls)), data.draw(_instance(cls))
    hypothesis.event(f"wire: {assert_same_outcome(cls, wire, sides='wire')}")
    hypothesis.event(f"check: {assert_same_outcome(cls, instance, sides='check')}")


@pytest.mark.parametrize("cls", DATACLASSES, ids=lambda c: c.__name__)
def test_valid_dataclasses_round_trip_identically(cls: type) -> None:
    values: dict[type, Any] = {
        Sampling: Sampling(stop=["</s>"], stop_token_ids=[2, 3], weights={"a": 0.5}),
        Request: Request("r", list(range(50)), None, Sampling(), 1.5, priority=3),
        Single: Single(1),
        Clashing: Clashing(1, "a", 1.5, True, 2, 3, "i", "t", 4, 5),
        Checked: Checked(1, 2),
        HandInit: HandInit("b", 1),
        KwOnly: KwOnly(a=1),
        Priv: Priv(1, "x"),
        Node: Node(0, [Node(1), Node(2, [Node(3)])], (Node(4), Node(5)), (Node(6),)),
    }
    value = values[cls]
    fast, ref = both(cls)
    sent = fast.check(value, "p")
    assert same(sent, ref.check(value, "p"))
    wire = ormsgpack.unpackb(ormsgpack.packb(sent))  # what the peer's codec decodes
    got, want = fast.from_wire(wire, "p"), ref.from_wire(wire, "p")
    assert type(got) is cls
    assert same(got, want)
    assert same(got, value)


@dataclasses.dataclass
class Scalars:
    i: int
    oi: Optional[int]
    f: float
    of: Optional[float]
    s: str
    b: bytes
    flag: bool
    none: None
    t: Optional[torch.Tensor]
    a: Optional[np.ndarray]
    ids: Optional[list[int]]


SCALAR_FIELD_VALUES = [
    0,
    1,
    -(1 << 63),
    -(1 << 63) - 1,
    (1 << 64) - 1,
    1 << 64,
    True,
    False,
    None,
    0.0,
    1.5,
    float("nan"),
    "",
    "s",
    b"",
    MyInt(3),
    MyStr("s"),
    MyFloat(1.5),
    MyBytes(b"b"),
    bytearray(b"b"),
    Level.HIGH,
    np.int64(3),
    np.float64(1.5),
    torch.zeros(1),
    torch.nn.Parameter(torch.zeros(1)),
    np.zeros(1),
    [1, 2],
    [1, True],
    (1, 2),
    {"a": 1},
]
SCALARS_FIT: dict[str, Any] = {
    "i": 1,
    "oi": None,
    "f": 1.0,
    "of": None,
    "s": "s",
    "b": b"b",
    "flag": False,
    "none": None,
    "t": None,
    "a": None,
    "ids": [1],
}


@pytest.mark.parametrize("field", list(SCALARS_FIT))
@pytest.mark.parametrize("value", SCALAR_FIELD_VALUES, ids=repr)
def test_every_inline_field_test_decides_like_the_reference(field: str, value: object) -> None:
    instance = Scalars(**SCALARS_FIT)
    setattr(instance, field, value)
    assert_same_outcome(Scalars, instance, sides="check")
    assert_same_outcome(Scalars, {**SCALARS_FIT, field: value}, sides="wire")


def test_dataclass_errors_name_the_field() -> None:
    fast, ref = both(Request)
    sampling: dict[str, Any] = {"stop_token_ids": [2, 2.5], "n": 1}
    wire: dict[str, Any] = {"request_id": "r", "prompt": [1], "tensor": None, "sampling": sampling}
    wire |= {"arrival": 0.0, "extra": None, "priority": 0}
    for node in (fast, ref):
        with pytest.raises(ValidationError) as info:
            node.from_wire(wire, "req")
        assert str(info.value) == "req.sampling.stop_token_ids[1]: expected int, got float (2.5)"
        with pytest.raises(ValidationError) as info:
            node.from_wire({**wire, "prompt": [5, 6, True]}, "req")
        assert str(info.value) == "req.prompt[2]: expected int, got bool (True)"
        with pytest.raises(ValidationError, match=r"req\.sampling: missing field|unknown"):
            node.from_wire({**wire, "sampling": {"nope": 1}}, "req")
    for node in both(Checked):
        with pytest.raises(ValidationError) as info:
            node.from_wire({"low": 2, "high": 1}, "p")
        assert "Checked(...) rejected the value: ValueError('low > high')" in str(info.value)
        assert isinstance(info.value.__cause__, ValueError)


def test_a_failure_deep_in_a_recursive_value_is_found_in_one_pass() -> None:
    # Finding the bad element by running the elements again would redo the nested work at
    # every level: 2**depth.
    depth = 60
    wire: dict[str, Any] = {"value": "bad"}
    pair: dict[str, Any] = {"value": "bad"}
    tree = Node(0)
    tree.value = "bad"  # type: ignore[assignment]
    for i in range(depth):
        wire = {"value": i, "children": [wire], "pair": None, "rest": []}
        pair = {"value": i, "children": [], "pair": [{"value": 0}, pair], "rest": [pair]}
        tree = Node(i, rest=(tree,))
    fast, ref = both(Node)
    start = time.perf_counter()
    for node in (fast, ref):
        with pytest.raises(ValidationError, match=r"p(\.children\[0\]){60}\.value: expected int"):
            node.from_wire(wire, "p")
        with pytest.raises(ValidationError, match=r"p(\.pair\[1\]){60}\.value: expected int"):
            node.from_wire(pair, "p")
        with pytest.raises(ValidationError, match=r"p(\.rest\[0\]){60}\.value: expected int"):
            node.check(tree, "p")
    assert time.perf_counter() - start < 5.0


def test_values_nested_beyond_the_recursion_limit_are_still_validation_errors() -> None:
    wire: dict[str, Any] = {"value": 0}
    for i in range(5000):
        wire = {"value": i, "children": [wire], "pair": None, "rest": []}
    with pytest.raises(ValidationError, match="nested too deeply"):
        compile_type(Node, where="w").from_wire(wire, "p")


def test_subclass_instances_and_private_fields_travel_as_plain_maps() -> None:
    fast, _ = both(Single)
    assert fast.check(SubSingle(1, "x"), "p") == {"x": 1}
    assert both(Priv)[0].check(Priv(1, "s"), "p") == {"a": 1, "_b": "s"}
    mixed = Sampling(n=Level.HIGH, temperature=1)  # an IntEnum for int, an int for float
    sent = both(Sampling)[0].check(mixed, "p")
    assert isinstance(sent, dict)
    assert type(sent["n"]) is int
    assert type(sent["temperature"]) is float


# --------------------------------------------------------------------------- service


@dataclasses.dataclass
class Params:
    temperature: float = 1.0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)


@service
class Engine:
    @rpc
    async def generate(self, prompt: list[int], params: Params) -> list[int]:
        return prompt


def test_method_errors_are_unchanged() -> None:
    method = describe(Engine).methods["generate"]
    prompt = list(range(40))
    assert method.encode_args((prompt, Params()), {})[0] is prompt
    prompt[17] = True
    with pytest.raises(ValidationError) as info:
        method.encode_args((prompt, Params()), {})
    assert str(info.value) == "generate: req.prompt[17]: expected int, got bool (True)".replace(
        "generate", info.value.method
    )
    assert info.value.path == "req.prompt[17]"
    with pytest.raises(ValidationError) as info:
        method.decode_args([prompt, {"temperature": 1.0, "stop_token_ids": []}])
    assert info.value.path == "req.prompt[17]"
    assert str(info.value).endswith("req.prompt[17]: expected int, got bool (True)")
    with pytest.raises(ValidationError) as info:
        method.decode_args([[1], {"temperature": 1.0, "stop_token_ids": [None]}])
    assert info.value.path == "req.params.stop_token_ids[0]"
    assert method.decode_args([[1], {"temperature": 1, "stop_token_ids": [2]}]) == [
        [1],
        Params(1.0, [2]),
    ]
