"""Messages a new user meets first say what to do, and name public paths."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

import tensorrpc
from tensorrpc import ServiceDefinitionError, describe, rpc, service
from tensorrpc._schema import bad_result_message


class PlainPoint:
    x: int


def _definition_error(annotation: object) -> str:
    def method(self: object, a: int) -> None:
        return None

    method.__annotations__ = {"a": annotation, "return": None}
    with pytest.raises(ServiceDefinitionError) as info:

        @service
        class S:
            f = rpc(method)

    return str(info.value)


@pytest.mark.parametrize(
    ("annotation", "hint"),
    [
        (set[int], "use list[int] (or tuple[int, ...]) and convert"),
        (frozenset[str], "use list[str] (or tuple[str, ...]) and convert"),
        (set, "use list[T]"),
        (PlainPoint, "make PlainPoint a @dataclass (or a NamedTuple, TypedDict, msgspec Struct"),
        (Sequence[float], "list[float] or tuple[float, ...]"),
        (object, "annotate the concrete type"),
        (complex, "see docs/services.md for the supported types"),
    ],
)
def test_unsupported_types_suggest_a_fix(annotation: object, hint: str) -> None:
    message = _definition_error(annotation)
    assert "S.f parameter 'a': unsupported type" in message
    assert hint in message


def test_public_exceptions_name_their_public_module() -> None:
    exported = [getattr(tensorrpc, n) for n in tensorrpc.__all__]
    exceptions = [v for v in exported if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(exceptions) >= 20
    assert sorted(e.__name__ for e in exceptions if e.__module__ != "tensorrpc") == []
    assert tensorrpc.ErrorCode.__module__ == "tensorrpc"
    line = traceback.format_exception_only(tensorrpc.ValidationError("bad"))[-1]
    assert line == "tensorrpc.ValidationError: bad\n"


@dataclass(frozen=True)
class Pair:
    xs: list[int]


@service
class Bad:
    @rpc
    def number(self) -> int:
        return 0

    @rpc
    def pair(self) -> Pair:
        return Pair([])


def _check_error(method: str, value: object) -> Exception:
    spec = describe(Bad).methods[method]
    with pytest.raises(tensorrpc.ValidationError) as info:
        spec.check_result(value)
    return info.value


def test_bad_result_message_names_the_method_once() -> None:
    message = bad_result_message("Bad.number", _check_error("number", "x"))
    assert message == "Bad.number returned a bad result: expected int, got str ('x')"
    nested = bad_result_message("Bad.pair", _check_error("pair", Pair(["a"])))  # type: ignore[list-item]
    assert nested.startswith("Bad.pair returned a bad result at result.xs[0]: expected int")
    assert nested.count("Bad.pair") == 1
    assert bad_result_message("Bad.number", ValueError("too big")) == (
        "Bad.number returned a bad result: too big"
    )
