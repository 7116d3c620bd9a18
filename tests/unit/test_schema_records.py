"""Record types beyond dataclasses, and maps keyed by ints: validated at both ends.

``NamedTuple`` (an array on the wire), ``TypedDict``, msgspec ``Struct`` and pydantic
models (maps of their field names), ``dict[int, T]``: each one round-trips through the
codec, names the field path of a bad value, is described canonically (the fingerprint
hashes the description), and decides what the reference validator decides. Every
annotation the schema refuses says why (one case per reason).
"""

# Optional[...] is spelled out on purpose: users write it.
# ruff: noqa: UP045

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import typing
from typing import Any, Literal, NamedTuple, NotRequired, Optional, Required, TypedDict

import hypothesis.strategies as st
import msgspec
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from typing_extensions import TypedDict as ExtTypedDict

from tensorrpc import ServiceDefinitionError, ValidationError
from tensorrpc._codec import decode, encode
from tensorrpc._schema import compile_type
from tensorrpc._service import describe, rpc, service
from tests.unit.test_schema_fast_paths import INTRUDERS, assert_same_outcome


class Point(NamedTuple):
    x: int
    y: float = 0.0


class Options(ExtTypedDict, total=False):  # pydantic wants typing_extensions' on 3.11
    temperature: float
    stop: list[str]
    seed: Required[Optional[int]]


class Tree(TypedDict):
    value: int
    children: NotRequired[list[Tree]]


class Sampling(msgspec.Struct):
    n: int
    top: Optional[Point] = None
    by_id: dict[int, float] = {}


class Job(pydantic.BaseModel):
    name: str
    options: Options
    weights: dict[int, list[float]] = {}


@dataclasses.dataclass
class Holder:
    point: Point
    tree: Tree
    job: Job
    sampling: Sampling


def wire(value: object) -> object:
    """What the peer's codec decodes."""
    encoded = encode(value)
    return decode(encoded.payload, encoded.buffers)


def round_trip(tp: object, value: object) -> object:
    node = compile_type(tp, where="w")
    return node.from_wire(wire(node.check(value, "p")), "p")


def test_each_record_round_trips_through_the_codec() -> None:
    assert round_trip(Point, Point(1, 2.5)) == Point(1, 2.5)
    assert type(round_trip(Point, Point(1))) is Point
    options: Options = {"seed": None, "stop": ["</s>"]}
    assert round_trip(Options, options) == options
    tree: Tree = {"value": 0, "children": [{"value": 1}, {"value": 2, "children": []}]}
    assert round_trip(Tree, tree) == tree
    sampling = Sampling(3, Point(1, 2.0), {7: 0.5, -(1 << 63): 1.0})
    assert round_trip(Sampling, sampling) == sampling
    job = Job(name="j", options={"seed": 4}, weights={1: [0.5]})
    assert round_trip(Job, job) == job
    holder = Holder(Point(0), tree, job, sampling)
    assert round_trip(Holder, holder) == holder
    assert round_trip(dict[int, str], {1: "a", 1 << 63: "b"}) == {1: "a", 1 << 63: "b"}


def test_an_int_for_a_float_converts_inside_records() -> None:
    assert round_trip(Point, Point(1, 2)) == Point(1, 2.0)
    sent = compile_type(Sampling, where="w").check(Sampling(1, None, {1: 2}), "p")
    assert sent == {"n": 1, "top": None, "by_id": {1: 2.0}}
    assert type(sent["by_id"][1]) is float


@pytest.mark.parametrize(
    ("tp", "value", "path", "field_path", "says"),
    [
        (Point, [1, "y"], "p.y", ["p", "y"], "expected float"),
        (Point, [1], "p", ["p"], "of length 2, got length 1"),
        (Options, {"temperature": 1.0}, "p.seed", ["p", "seed"], "missing field 'seed'"),
        (Options, {"seed": 1, "top_k": 3}, "p", ["p"], "unknown field(s) 'top_k'"),
        (Tree, {"value": 0, "children": [{"value": "x"}]}, "p.children[0].value",
         ["p", "children", 0, "value"], "expected int"),
        (Sampling, {"n": 1, "by_id": {2: "x"}}, "p.by_id[2]", ["p", "by_id", 2], "expected float"),
        (dict[int, int], {"1": 1}, "p", ["p"], "got a key of type str"),
        (dict[int, int], {1 << 64: 1}, "p", ["p"], "key int 18446744073709551616 is outside"),
        (dict[int, int], {True: 1}, "p", ["p"], "got a key of type bool"),
        (Job, {"name": "j", "options": {"seed": "s"}}, "p.options.seed",
         ["p", "options", "seed"], "expected Optional[int]"),
    ],
)  # fmt: skip
def test_errors_name_the_field_path(
    tp: object, value: Any, path: str, field_path: list[str | int], says: str
) -> None:
    node = compile_type(tp, where="w")
    sides = [node.from_wire]
    if typing.get_origin(tp) is dict or tp in (Options, Tree):
        sides.append(node.check)  # a plain map on the send side too
    for side in sides:
        with pytest.raises(ValidationError) as info:
            side(value, "p")
        assert info.value.path == path
        assert info.value.field_path == field_path
        assert says in str(info.value)


def test_send_side_errors_name_the_field_path() -> None:
    cases: list[tuple[object, object, list[str | int]]] = [
        (Point, Point(1, "y"), ["p", "y"]),  # type: ignore[arg-type]
        (Sampling, Sampling(1, Point("x")), ["p", "top", "x"]),  # type: ignore[arg-type]
        (Job, Job.model_construct(name="j", options={"seed": 1.5}), ["p", "options", "seed"]),
    ]
    for tp, value, field_path in cases:
        with pytest.raises(ValidationError) as info:
            compile_type(tp, where="w").check(value, "p")
        assert info.value.field_path == field_path


def test_the_send_side_wants_the_record_type_itself() -> None:
    with pytest.raises(ValidationError, match="expected namedtuple Point"):
        compile_type(Point, where="w").check((1, 2.0), "p")
    with pytest.raises(ValidationError, match="expected struct Sampling"):
        compile_type(Sampling, where="w").check({"n": 1}, "p")
    with pytest.raises(ValidationError, match=r"p\.n: expected int"):
        compile_type(Sampling, where="w").check(Sampling("x"), "p")  # type: ignore[arg-type]


def test_a_field_named_by_a_keyword_is_checked_too() -> None:
    # The generated check loads identifiers as attributes; ``class`` cannot be one.
    Keyworded = msgspec.defstruct("Keyworded", [("class", str), ("n", int)])
    node = compile_type(Keyworded, where="w")
    value = Keyworded(**{"class": "c", "n": 1})
    assert node.from_wire(wire(node.check(value, "p")), "p") == value
    with pytest.raises(ValidationError, match=r"p\.class: expected str"):
        node.check(Keyworded(**{"class": 1, "n": 1}), "p")


def test_a_model_that_refuses_the_value_is_a_validation_error() -> None:
    class Positive(pydantic.BaseModel):
        n: int

        @pydantic.field_validator("n")
        @classmethod
        def positive(cls, n: int) -> int:
            if n <= 0:
                raise ValueError("n must be positive")
            return n

    with pytest.raises(ValidationError, match=r"Positive\(\.\.\.\) rejected the value"):
        compile_type(Positive, where="w").from_wire({"n": 0}, "p")


def test_descriptions_are_canonical() -> None:
    assert compile_type(Point, where="w").description == "namedtuple Point{x: int, y: float}"
    assert compile_type(Options, where="w").description == (
        "typeddict Options{temperature: float = ..., stop: list[str] = ..., seed: Optional[int]}"
    )
    assert compile_type(Tree, where="w").description == (
        "typeddict Tree{value: int, children: list[typeddict Tree] = ...}"
    )
    assert compile_type(Sampling, where="w").description == (
        "struct Sampling{n: int, top: Optional[namedtuple Point{x: int, y: float}] = ..., "
        "by_id: dict[int, float] = ...}"
    )
    assert compile_type(Job, where="w").description.startswith(
        "model Job{name: str, options: typeddict Options{"
    )


@service
class Records:
    @rpc
    async def place(self, p: Point, options: Options, by_id: dict[int, str]) -> Sampling:
        return Sampling(p.x)


def test_the_fingerprint_covers_records() -> None:
    spec = describe(Records)
    assert spec.methods["place"].signature == (
        "place(p: namedtuple Point{x: int, y: float}, options: typeddict Options{temperature: "
        "float = ..., stop: list[str] = ..., seed: Optional[int]}, by_id: dict[int, str]) -> "
        "struct Sampling{n: int, top: Optional[namedtuple Point{x: int, y: float}] = ..., "
        "by_id: dict[int, float] = ...}"
    )
    method = spec.methods["place"]
    sent = method.encode_args((Point(1, 2.0), {"seed": None}, {3: "c"}), {})
    assert method.decode_args(wire(list(sent))) == [Point(1, 2.0), {"seed": None}, {3: "c"}]


# ----------------------------------------------------------------- against the reference

#: Keys of a dict[int, T]: ints, and hashable intruders.
KEYS = st.integers(-3, 3) | st.sampled_from(
    [True, False, "1", b"1", None, 1.5, 1 << 63, 1 << 64, -(1 << 63) - 1]
)
RECORD_VALUES = st.one_of(
    st.builds(Point, st.integers(-3, 3), st.floats(allow_nan=False) | st.integers(0, 2)),
    st.fixed_dictionaries(
        {"seed": st.none() | st.integers(0, 3)},
        optional={"temperature": st.floats(allow_nan=False), "stop": st.lists(st.text(max_size=2))},
    ),
    st.builds(
        Sampling,
        st.integers(0, 3) | INTRUDERS,
        st.none() | st.builds(Point, st.integers(0, 3)),
        st.dictionaries(KEYS, st.floats() | INTRUDERS, max_size=3),
    ),
    st.dictionaries(KEYS, st.text(max_size=2) | INTRUDERS, max_size=3),
    st.lists(st.integers(0, 3) | INTRUDERS, max_size=3),
    INTRUDERS,
)


@pytest.mark.parametrize("tp", [Point, Options, Tree, Sampling, dict[int, str], Optional[Point]])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=RECORD_VALUES)
def test_records_decide_like_the_reference(tp: object, value: object) -> None:
    assert_same_outcome(tp, value, sides="check")
    wired = value  # not encodable as is: the raw value goes to from_wire
    with contextlib.suppress(Exception):
        wired = wire(value)
    assert_same_outcome(tp, wired, sides="wire")


# ------------------------------------------------------------------- refusals, with why


class Plain:
    pass


class Bare(enum.Enum):
    pass


class Tupled(enum.Enum):
    A = (1, 2)


@dataclasses.dataclass
class NoInit:
    a: int
    b: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass
class Dangling:
    a: Missing  # type: ignore[name-defined]  # noqa: F821


class Aliased(pydantic.BaseModel):
    name: str = pydantic.Field(alias="Name")


UntypedPair = collections.namedtuple("UntypedPair", "a b")


@pytest.mark.parametrize(
    ("tp", "why"),
    [
        (Any, "Any is not supported; annotate the concrete type"),
        ("Later", "unresolved forward reference"),
        (list, "parametrize it"),
        (dict[float, str], "map keys are str or int on the wire"),
        (dict[str, int, int], "write dict[str, T] or dict[int, T]"),  # type: ignore[misc]
        (set[int], "sets do not travel; use list[int]"),
        (typing.Sequence[int], "annotate a concrete container: list[int] or tuple[int, ...]"),
        (typing.Mapping[str, int], "annotate a concrete container: dict[str, T] or dict[int, T]"),
        (object, "annotate the concrete type"),
        (Plain, "a plain class does not travel; make Plain a @dataclass (or a NamedTuple"),
        (complex, "see docs/services.md for the supported types"),
        (Literal[1.5], "unsupported Literal value 1.5"),
        (Literal[Tupled.A], "Literal member <Tupled.A: (1, 2)> has a value of unsupported type"),
        (Bare, "Enum Bare has no members"),
        (Tupled, "Enum Tupled.A has a value of type tuple"),
        (NoInit, "field 'b' has init=False; such a field cannot be rebuilt"),
        (Dangling, "cannot resolve the field types of dataclass Dangling"),
        (UntypedPair, "namedtuple UntypedPair has no types for its fields a, b"),
        (Aliased, "model Aliased field 'name' has the alias 'Name'"),
        (list[int, str], "write list[T]"),  # type: ignore[misc]
    ],
)
def test_each_refusal_says_why(tp: object, why: str) -> None:
    with pytest.raises(ServiceDefinitionError) as info:
        compile_type(tp, where="S.m parameter 'x'")
    assert str(info.value).startswith("S.m parameter 'x': ")
    assert why in str(info.value)
