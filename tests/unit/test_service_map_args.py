"""``MethodSpec.decode_args`` also takes a map of argument name -> value (CALL payload)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tensorrpc import ValidationError, describe, rpc, service
from tensorrpc._service import schemaless_method


@dataclass(frozen=True)
class Point:
    x: float
    y: float


@service
class Shapes:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    async def move(self, p: Point, dx: float = 0.0, /) -> Point:
        return Point(p.x + dx, p.y)

    @rpc
    async def nothing(self) -> None:
        return None


ADD = describe(Shapes).methods["add"]
MOVE = describe(Shapes).methods["move"]
NOTHING = describe(Shapes).methods["nothing"]


def test_map_is_bound_by_name_in_parameter_order() -> None:
    assert ADD.decode_args({"b": 5, "a": 2}) == [2, 5]


def test_missing_names_take_their_defaults() -> None:
    assert ADD.decode_args({"a": 2}) == [2, 1]


def test_values_are_converted_like_positional_ones() -> None:
    assert MOVE.decode_args({"p": {"x": 1, "y": 2.5}}) == [Point(1.0, 2.5), 0.0]


def test_positional_only_parameters_can_be_named_in_the_map() -> None:
    assert MOVE.decode_args({"dx": 2, "p": {"x": 0.0, "y": 0.0}}) == [Point(0.0, 0.0), 2.0]


def test_empty_map_for_a_method_without_parameters() -> None:
    assert NOTHING.decode_args({}) == []


def test_missing_required_argument_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match=r"req\.a: missing required argument 'a'") as info:
        ADD.decode_args({"b": 1})
    assert info.value.path == "req.a"
    assert info.value.expected == "int"


def test_unknown_name_is_a_validation_error_listing_the_parameters() -> None:
    with pytest.raises(ValidationError, match=r"unexpected argument 'c'; the parameters are a, b"):
        ADD.decode_args({"a": 1, "c": 2})


def test_wrong_type_names_the_parameter_path() -> None:
    with pytest.raises(ValidationError, match=r"req\.b: expected int, got str") as info:
        ADD.decode_args({"a": 1, "b": "x"})
    assert info.value.path == "req.b"


def test_non_string_keys_are_refused() -> None:
    with pytest.raises(ValidationError, match="argument names must be strings"):
        ADD.decode_args({1: 2})


def test_positional_list_still_works() -> None:
    assert ADD.decode_args([3]) == [3, 1]
    with pytest.raises(ValidationError, match="expected an argument list or map, got int"):
        ADD.decode_args(7)


def test_schemaless_method_passes_values_through() -> None:
    spec = schemaless_method("Shapes", "add", streaming=False)
    assert spec.qualname == "Shapes.add"
    assert not spec.streaming
    value = {"nested": [1, 2]}
    assert spec.decode_result(value) is value
    assert spec.check_result(value) is value
    assert spec.encode_args((1, 2), {}) == [1, 2]
    with pytest.raises(ValidationError, match="cannot bind keyword arguments"):
        spec.encode_args((), {"a": 1})
    assert schemaless_method("S", "count", streaming=True).signature.endswith("AsyncIterator[any]")
