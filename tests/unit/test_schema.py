"""Type hints → validators: every supported type round-trips; everything else is refused."""

# Optional[...] and Union[...] are spelled out on purpose: users write them.
# ruff: noqa: UP007, UP045

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Annotated, Any, Literal, NewType, Optional, Union

import hypothesis.strategies as st
import numpy as np
import numpy.typing as npt
import ormsgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tensorrpc._exceptions import ServiceDefinitionError, ValidationError
from tensorrpc._schema import compile_type, describe_value


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    R = 1
    W = 2


@dataclasses.dataclass(frozen=True)
class Point:
    x: float
    y: float = 0.0


@dataclasses.dataclass
class Shape:
    name: str
    points: list[Point]
    color: Color = Color.RED
    tags: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Tree:
    value: int
    children: list[Tree] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Private:
    a: int
    _hidden: str = "h"


UserId = NewType("UserId", int)


def wire(value: object) -> object:
    """What the peer's codec hands to ``from_wire`` (msgpack round trip)."""
    return ormsgpack.unpackb(ormsgpack.packb(value))


def roundtrip(tp: object, value: object) -> object:
    node = compile_type(tp, where="T.m parameter 'p'")
    return node.from_wire(wire(node.check(value, "req.p")), "req.p")


ROUNDTRIPS: list[tuple[object, object]] = [
    (None, None),
    (type(None), None),
    (bool, True),
    (bool, False),
    (int, 0),
    (int, -(1 << 63)),
    (int, (1 << 64) - 1),
    (float, 1.5),
    (float, -0.0),
    (float, math.inf),
    (str, ""),
    (str, "héllo ✓"),
    (bytes, b"\x00\xff"),
    (list[int], [1, 2, 3]),
    (list[int], []),
    (list[list[str]], [["a"], [], ["b", "c"]]),
    (tuple[int, ...], (1, 2, 3)),
    (tuple[int, ...], ()),
    (tuple[int, str], (1, "a")),
    (tuple[()], ()),
    (dict[str, int], {"a": 1, "b": 2}),
    (dict[str, list[float]], {"a": [1.0], "b": []}),
    (Optional[int], None),
    (Optional[int], 3),
    (int | None, 4),
    (Union[int, str], "s"),
    (Union[int, str], 5),
    (int | float, 5),
    (float | int, 5),
    (float | int, 5.5),
    (Union[Point, str], Point(1.0, 2.0)),
    (Literal["a", "b"], "b"),
    (Literal[1, True], True),
    (Literal[1, True], 1),
    (Literal[Color.GREEN, None], Color.GREEN),
    (Color, Color.GREEN),
    (Level, Level.HIGH),
    (Perm, Perm.R | Perm.W),
    (Point, Point(1.0, 2.0)),
    (Shape, Shape("s", [Point(1.0), Point(2.0, 3.0)], Color.GREEN, {"k": 1})),
    (Tree, Tree(1, [Tree(2), Tree(3, [Tree(4)])])),
    (Private, Private(1, "secret")),
    (list[Point], [Point(0.5), Point(1.0, 2.0)]),
    (dict[str, Optional[Point]], {"a": Point(1.0), "b": None}),
    (Annotated[int, "meta"], 7),
    (UserId, UserId(9)),
]


@pytest.mark.parametrize(("tp", "value"), ROUNDTRIPS)
def test_supported_types_round_trip_through_msgpack(tp: object, value: object) -> None:
    out = roundtrip(tp, value)
    assert out == value
    assert type(out) is type(value)


@pytest.mark.parametrize("tp", [torch.Tensor, Optional[torch.Tensor], list[torch.Tensor]])
def test_tensors_pass_through_without_copy(tp: object) -> None:
    node = compile_type(tp, where="w")
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[:, 1:]
    value: object = [t] if typing.get_origin(tp) is list else t
    checked = node.check(value, "req.p")
    received = node.from_wire(checked, "req.p")
    inner = received[0] if isinstance(received, list) else received
    assert inner is t


@pytest.mark.parametrize("tp", [np.ndarray, npt.NDArray[np.float32], dict[str, np.ndarray]])
def test_ndarrays_pass_through(tp: object) -> None:
    node = compile_type(tp, where="w")
    a = np.zeros((2, 2), dtype=np.float32)
    value: object = {"k": a} if typing.get_origin(tp) is dict else a
    assert node.from_wire(node.check(value, "p"), "p") is value


def test_tensor_and_ndarray_are_not_interchangeable() -> None:
    with pytest.raises(ValidationError, match=r"expected Tensor, got ndarray\(dtype=float32"):
        compile_type(torch.Tensor, where="w").check(np.zeros(2, np.float32), "req.x")
    with pytest.raises(ValidationError, match=r"expected ndarray, got Tensor\(dtype=torch"):
        compile_type(np.ndarray, where="w").from_wire(torch.zeros(2), "req.x")


def test_int_is_accepted_for_float_and_becomes_float() -> None:
    node = compile_type(float, where="w")
    assert type(node.check(3, "p")) is float
    assert type(node.from_wire(3, "p")) is float
    lst = compile_type(list[float], where="w")
    assert lst.check([1, 2.5], "p") == [1.0, 2.5]
    received = lst.from_wire([1, 2.5], "p")
    assert isinstance(received, list)
    assert [type(v) for v in received] == [float, float]


def test_an_int_too_large_for_a_float_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match=r"too large for a float") as info:
        compile_type(list[float], where="w").check([1.0, 10**400], "p")
    assert info.value.field_path == ["p", 1]


def test_scalar_subclasses_become_plain_types_for_the_encoder() -> None:
    assert type(compile_type(int, where="w").check(Level.LOW, "p")) is int
    assert type(compile_type(float, where="w").check(np.float64(1.5), "p")) is float
    checked = compile_type(list[float], where="w").check([np.float64(2.5)], "p")
    assert wire(checked) == [2.5]


@pytest.mark.parametrize(
    ("tp", "value", "expected"),
    [
        (int, True, "int"),
        (int, 1.0, "int"),
        (bool, 1, "bool"),
        (float, True, "float"),
        (float, "1", "float"),
        (str, b"x", "str"),
        (bytes, "x", "bytes"),
        (None, 0, "None"),
        (list[int], (1, 2), "list[int]"),
        (tuple[int, ...], [1], "tuple[int, ...]"),
        (dict[str, int], [("a", 1)], "dict[str, int]"),
        (Color, "red", "enum Color{RED='red', GREEN='green'}"),
        (Literal["a"], "b", "Literal['a']"),
        (Point, {"x": 1.0}, "dataclass Point{x: float, y: float = ...}"),
        (Optional[int], "x", "Optional[int]"),
        (Union[int, str], 1.5, "Union[int, str]"),
    ],
)
def test_check_rejects_wrong_types(tp: object, value: object, expected: str) -> None:
    with pytest.raises(ValidationError) as info:
        compile_type(tp, where="w").check(value, "req.p")
    assert info.value.path == "req.p"
    assert info.value.expected == expected
    assert str(info.value) == f"req.p: expected {expected}, got {describe_value(value)}"


@pytest.mark.parametrize(
    ("tp", "value", "path"),
    [
        (list[int], [1, 2, "x"], "req.p[2]"),
        (list[list[int]], [[1], [2, None]], "req.p[1][1]"),
        (dict[str, int], {"a": 1, "b": "no"}, "req.p['b']"),
        (tuple[int, str], (1, 2), "req.p[1]"),
        (Shape, Shape("s", [Point(1.0), Point("bad")]), "req.p.points[1].x"),  # type: ignore[arg-type]
        (Tree, Tree(1, [Tree(2, [Tree("x")])]), "req.p.children[0].children[0].value"),  # type: ignore[arg-type]
        (Optional[list[int]], [1, "x"], "req.p[1]"),
        (Union[list[int], str], [1, "x"], "req.p[1]"),
    ],
)
def test_errors_name_the_path_of_the_bad_value(tp: object, value: object, path: str) -> None:
    node = compile_type(tp, where="w")
    with pytest.raises(ValidationError) as info:
        node.check(value, "req.p")
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: ")


def test_from_wire_errors_name_the_path_too() -> None:
    node = compile_type(list[Shape], where="w")
    good = {"name": "s", "points": [{"x": 1.0}]}
    with pytest.raises(ValidationError) as info:
        node.from_wire([good, {"name": "t", "points": [{"x": 1.0}, {"x": "no"}]}], "result")
    assert info.value.path == "result[1].points[1].x"
    assert "expected float, got str ('no')" in str(info.value)
    assert info.value.field_path == ["result", 1, "points", 1, "x"]


def test_field_paths_are_data_that_keys_and_indices_keep_their_types() -> None:
    node = compile_type(dict[str, list[Shape]], where="w")
    bad = {"a.b": [{"name": "s", "points": [{"x": 1.0, "y": None}]}]}
    sent = {"a.b": [Shape("s", [Point(1.0, None)])]}  # type: ignore[arg-type]
    for fn, value in ((node.check, sent), (node.from_wire, bad)):
        with pytest.raises(ValidationError) as info:
            fn(value, "req.shapes")
        assert info.value.path == "req.shapes['a.b'][0].points[0].y"
        assert info.value.field_path == ["req", "shapes", "a.b", 0, "points", 0, "y"]
    with pytest.raises(ValidationError) as info:
        compile_type(Shape, where="w").from_wire({"points": []}, "req.s")
    assert info.value.field_path == ["req", "s", "name"]


def test_dataclass_from_wire_fills_defaults_and_rejects_unknown_or_missing_keys() -> None:
    node = compile_type(Point, where="w")
    assert node.from_wire({"x": 1}, "p") == Point(1.0, 0.0)
    with pytest.raises(ValidationError, match=r"p: unknown field\(s\) 'z' for dataclass Point"):
        node.from_wire({"x": 1.0, "z": 2}, "p")
    with pytest.raises(ValidationError, match=r"p\.x: missing field 'x' of dataclass Point"):
        node.from_wire({"y": 1.0}, "p")
    with pytest.raises(ValidationError, match="unknown field"):
        node.from_wire({"x": 1.0, 1: 2}, "p")


def test_dataclass_constructor_errors_become_validation_errors() -> None:
    @dataclasses.dataclass
    class Positive:
        n: int

        def __post_init__(self) -> None:
            if self.n <= 0:
                raise ValueError("n must be positive")

    node = compile_type(Positive, where="w", localns={"Positive": Positive})
    with pytest.raises(ValidationError, match="n must be positive") as info:
        node.from_wire({"n": -1}, "req.p")
    assert isinstance(info.value.__cause__, ValueError)


def test_dataclass_subclass_instance_travels_as_its_declared_fields() -> None:
    @dataclasses.dataclass(frozen=True)
    class Point3(Point):
        z: float = 0.0

    node = compile_type(Point, where="w")
    checked = node.check(Point3(1.0, 2.0, 3.0), "p")
    assert checked == {"x": 1.0, "y": 2.0}
    assert node.from_wire(wire(checked), "p") == Point(1.0, 2.0)


def test_private_dataclass_fields_travel_although_ormsgpack_drops_them() -> None:
    assert ormsgpack.unpackb(ormsgpack.packb(Private(1, "s"))) == {"a": 1}
    assert roundtrip(Private, Private(1, "s")) == Private(1, "s")


def test_valid_values_are_returned_as_is() -> None:
    tokens = list(range(100))
    assert compile_type(list[int], where="w").check(tokens, "p") is tokens
    assert compile_type(list[int], where="w").from_wire(tokens, "p") is tokens
    shape = Shape("s", [Point(1.0)])
    assert compile_type(Shape, where="w").check(shape, "p") is shape
    d = {"a": [1.0]}
    assert compile_type(dict[str, list[float]], where="w").check(d, "p") is d


def test_dict_keys_must_be_str() -> None:
    node = compile_type(dict[str, int], where="w")
    with pytest.raises(ValidationError, match=r"got a key of type int \(1\)"):
        node.check({1: 1}, "p")
    with pytest.raises(ValidationError, match="got a key of type bytes"):
        node.from_wire({b"k": 1}, "p")


def test_fixed_tuple_length_is_checked() -> None:
    node = compile_type(tuple[int, str], where="w")
    with pytest.raises(
        ValidationError, match=r"expected tuple\[int, str\] of length 2, got length 3"
    ):
        node.from_wire([1, "a", 2], "p")
    assert node.from_wire([1, "a"], "p") == (1, "a")


def test_enum_and_literal_values_are_matched_by_type() -> None:
    assert roundtrip(Literal[1, True], True) is True
    with pytest.raises(ValidationError):
        compile_type(Literal[1], where="w").check(True, "p")
    with pytest.raises(ValidationError):
        compile_type(Level, where="w").from_wire(True, "p")
    with pytest.raises(ValidationError):
        compile_type(Level, where="w").from_wire(3, "p")
    with pytest.raises(ValidationError):
        compile_type(Color, where="w").from_wire(["red"], "p")  # unhashable wire value
    assert compile_type(Level, where="w").from_wire(2, "p") is Level.HIGH


def test_values_nested_beyond_the_recursion_limit_are_validation_errors() -> None:
    node = compile_type(Tree, where="w")
    wire_value: dict[str, Any] = {"value": 0}
    tree = Tree(0)
    for i in range(5000):
        wire_value = {"value": i, "children": [wire_value]}
        tree = Tree(i, [tree])
    with pytest.raises(ValidationError, match=r"req\.p: value is nested too deeply"):
        node.from_wire(wire_value, "req.p")
    with pytest.raises(ValidationError, match="nested too deeply"):
        node.check(tree, "req.p")


def test_int_outside_64_bits_is_refused() -> None:
    with pytest.raises(ValidationError, match="outside the 64-bit range"):
        compile_type(int, where="w").check(1 << 64, "p")


def test_descriptions_are_stable_and_free_of_module_paths() -> None:
    a = compile_type(dict[str, list[Shape | None]], where="w").description
    b = compile_type(dict[str, list[Optional[Shape]]], where="w").description
    assert a == b
    assert "tests" not in a
    assert "__main__" not in a
    assert a == (
        "dict[str, list[Optional[dataclass Shape{name: str, points: list[dataclass "
        "Point{x: float, y: float = ...}], color: enum Color{RED='red', GREEN='green'} = ..., "
        "tags: dict[str, int] = ...}]]]"
    )
    assert compile_type(Tree, where="w").description == (
        "dataclass Tree{value: int, children: list[dataclass Tree] = ...}"
    )


class Opaque:
    pass


@dataclasses.dataclass
class NoInit:
    a: int
    b: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass
class BadField:
    a: set[int]


class ObjEnum(enum.Enum):
    A = (1, 2)


@pytest.mark.parametrize(
    ("tp", "fragment"),
    [
        (Any, "unsupported type Any"),
        (object, "unsupported type object"),
        (Opaque, "unsupported type Opaque"),
        (set[int], "unsupported type set[int]"),
        (frozenset[int], "unsupported type frozenset[int]"),
        (list, "unsupported type list: parametrize it"),
        (dict[float, str], "map keys are str or int on the wire"),
        (list[Any], "unsupported type Any (in list[Any])"),
        (Optional[set[int]], "unsupported type set[int]"),
        (typing.Callable[[int], int], "unsupported type"),
        (Literal[1.5], "unsupported Literal value 1.5"),
        (ObjEnum, "Enum ObjEnum.A has a value of type tuple"),
        (NoInit, "field 'b' has init=False"),
        (BadField, "unsupported type set[int] (in dataclass BadField field 'a')"),
        (complex, "unsupported type complex"),
    ],
)
def test_unsupported_annotations_are_refused_naming_where_and_type(
    tp: object, fragment: str
) -> None:
    with pytest.raises(ServiceDefinitionError) as info:
        compile_type(tp, where="Calculator.add parameter 'x'")
    message = str(info.value)
    assert message.startswith("Calculator.add parameter 'x': ")
    assert fragment in message


def test_unresolvable_dataclass_field_is_refused() -> None:
    @dataclasses.dataclass
    class Dangling:
        a: NotDefinedAnywhere  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(ServiceDefinitionError, match="cannot resolve the field types"):
        compile_type(Dangling, where="S.m parameter 'a'")


# --------------------------------------------------------------------------- property


@dataclasses.dataclass(frozen=True)
class _Leaf:
    tp: object
    values: st.SearchStrategy[Any]


_LEAVES = [
    _Leaf(int, st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)),
    _Leaf(float, st.floats(allow_nan=False)),
    _Leaf(str, st.text(max_size=8)),
    _Leaf(bytes, st.binary(max_size=8)),
    _Leaf(bool, st.booleans()),
    _Leaf(type(None), st.none()),
    _Leaf(Color, st.sampled_from(Color)),
    _Leaf(Literal["a", 2, None], st.sampled_from(["a", 2, None])),
    _Leaf(Point, st.builds(Point, st.floats(allow_nan=False), st.floats(allow_nan=False))),
]

_fields_counter = iter(range(1 << 30))


def _wrap(child: st.SearchStrategy[_Leaf]) -> st.SearchStrategy[_Leaf]:
    def make_list(c: _Leaf) -> _Leaf:
        return _Leaf(list[c.tp], st.lists(c.values, max_size=4))  # type: ignore[name-defined]

    def make_var_tuple(c: _Leaf) -> _Leaf:
        return _Leaf(
            tuple[c.tp, ...],  # type: ignore[name-defined]
            st.lists(c.values, max_size=3).map(tuple),
        )

    def make_dict(c: _Leaf) -> _Leaf:
        return _Leaf(
            dict[str, c.tp],  # type: ignore[name-defined]
            st.dictionaries(st.text(max_size=4), c.values, max_size=3),
        )

    def make_optional(c: _Leaf) -> _Leaf:
        return _Leaf(Optional[c.tp], st.none() | c.values)

    def make_fixed_tuple(cs: list[_Leaf]) -> _Leaf:
        tp = types.GenericAlias(tuple, tuple(c.tp for c in cs))
        return _Leaf(tp, st.tuples(*(c.values for c in cs)))

    def make_dataclass(cs: list[_Leaf]) -> _Leaf:
        names = [f"f{i}" for i in range(len(cs))]
        cls = dataclasses.make_dataclass(
            f"Gen{next(_fields_counter)}", [(n, c.tp) for n, c in zip(names, cs, strict=True)]
        )
        return _Leaf(cls, st.builds(cls, *(c.values for c in cs)))

    return st.one_of(
        child.map(make_list),
        child.map(make_var_tuple),
        child.map(make_dict),
        child.map(make_optional),
        st.lists(child, min_size=1, max_size=3).map(make_fixed_tuple),
        st.lists(child, min_size=1, max_size=3).map(make_dataclass),
    )


_TYPES = st.recursive(st.sampled_from(_LEAVES), _wrap, max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), leaf=_TYPES)
def test_nested_structures_round_trip(data: st.DataObject, leaf: _Leaf) -> None:
    value = data.draw(leaf.values)
    node = compile_type(leaf.tp, where="w")
    assert node.description == compile_type(leaf.tp, where="w").description
    out = node.from_wire(wire(node.check(value, "req.p")), "req.p")
    assert out == value


_MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(leaf=_TYPES, junk=_MSGPACK_VALUES)
def test_from_wire_on_arbitrary_payloads_returns_or_raises_validation_error(
    leaf: _Leaf, junk: object
) -> None:
    node = compile_type(leaf.tp, where="w")
    error: ValidationError | None = None
    try:
        node.from_wire(junk, "req.p")
    except ValidationError as exc:
        error = exc
    if error is not None:
        assert error.path.startswith("req.p")
        assert error.expected
