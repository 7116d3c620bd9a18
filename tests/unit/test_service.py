"""@service / @rpc: specs, argument binding, validation errors, definition errors, fingerprints."""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import textwrap
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any

import hypothesis.strategies as st
import ormsgpack
import pytest
import torch
from hypothesis import given, settings

from tensorrpc._exceptions import ServiceDefinitionError, ValidationError
from tensorrpc._service import MethodSpec, ServiceSpec, describe, rpc, service


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass
class Item:
    x: float
    label: str = ""


@service
class Calculator:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    @rpc
    async def total(self, items: list[Item], mode: Mode = Mode.FAST) -> float:
        return sum(i.x for i in items)

    @rpc
    def pos_only(self, a: int, /, b: str = "b") -> None:
        return None

    def helper(self) -> int:
        return 0


SPEC = describe(Calculator)


def method(name: str) -> MethodSpec:
    return SPEC.methods[name]


def fingerprint_of(source: str, name: str = "S") -> str:
    namespace: dict[str, Any] = {}
    exec(
        "from __future__ import annotations\n"
        "from collections.abc import AsyncIterator\n"
        "from tensorrpc._service import rpc, service\n" + textwrap.dedent(source),
        namespace,
    )
    return describe(namespace[name]).fingerprint


# ------------------------------------------------------------------------------ specs


def test_describe_lists_methods_in_definition_order() -> None:
    assert isinstance(SPEC, ServiceSpec)
    assert SPEC.name == "Calculator"
    assert list(SPEC.methods) == ["add", "scale", "count", "total", "pos_only"]
    assert len(SPEC.fingerprint) == 64
    int(SPEC.fingerprint, 16)


def test_method_specs_describe_kind_params_and_types() -> None:
    add, scale, count = method("add"), method("scale"), method("count")
    assert (add.service, add.name, add.qualname) == ("Calculator", "add", "Calculator.add")
    assert add.params == ("a", "b")
    assert (add.is_async, add.streaming) == (True, False)
    assert (scale.is_async, scale.streaming) == (False, False)
    assert (count.is_async, count.streaming) == (True, True)
    assert add.signature == "add(a: int, b: int = 1) -> int"
    assert count.signature == "count(n: int) -> AsyncIterator[int]"
    assert method("total").signature == (
        "total(items: list[dataclass Item{x: float, label: str = ...}], "
        "mode: enum Mode{FAST='fast', SLOW='slow'} = Mode.FAST='fast') -> float"
    )
    assert [t.description for t in scale.param_types] == ["Tensor", "float"]
    assert count.result_type.description == "int"
    assert dict(add.defaults) == {"b": 1}


def test_request_and_response_types_are_generated_dataclasses() -> None:
    add = method("add")
    fields = dataclasses.fields(add.request_type)
    assert [(f.name, f.type) for f in fields] == [("a", int), ("b", int)]
    assert fields[1].default == 1
    request = add.request_type(a=2)
    assert (request.a, request.b) == (2, 1)
    assert dataclasses.fields(add.response_type)[0].name == "value"
    assert dataclasses.fields(method("count").response_type)[0].type is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.a = 3


def test_service_name_can_be_given_and_instances_can_be_described() -> None:
    @service(name="calc")
    class Calc:
        @rpc
        def ping(self) -> None:
            return None

    assert describe(Calc).name == "calc"
    assert describe(Calc()) is describe(Calc)
    assert Calc._tensorrpc_spec is describe(Calc)  # type: ignore[attr-defined]


def test_describe_refuses_classes_that_are_not_services() -> None:
    class Plain:
        pass

    with pytest.raises(ServiceDefinitionError, match="Plain is not a @service class"):
        describe(Plain)
    with pytest.raises(ServiceDefinitionError, match="is not a @service class"):
        describe(3)


def test_inherited_rpc_methods_are_included_and_can_be_overridden() -> None:
    @service
    class Base:
        @rpc
        def a(self, x: int) -> int:
            return x

        @rpc
        def b(self) -> str:
            return ""

    @service
    class Child(Base):
        @rpc
        def b(self) -> bytes:  # type: ignore[override]
            return b""

        @rpc
        def c(self) -> None:
            return None

    spec = describe(Child)
    assert spec.name == "Child"
    assert list(spec.methods) == ["a", "b", "c"]
    assert spec.methods["b"].result_type.description == "bytes"
    assert list(describe(Base).methods) == ["a", "b"]


def test_undecorated_subclass_adding_rpc_methods_is_an_error() -> None:
    @service
    class Base:
        @rpc
        def a(self) -> None:
            return None

    class Child(Base):
        @rpc
        def extra(self) -> None:
            return None

    class Same(Base):
        pass

    with pytest.raises(ServiceDefinitionError, match="Child defines @rpc methods but is not"):
        describe(Child)
    assert describe(Same) is describe(Base)


def test_local_classes_resolve_under_postponed_annotations() -> None:
    @dataclasses.dataclass
    class Local:
        n: int

    @service
    class S:
        @rpc
        def get(self, value: Local) -> list[Local]:
            return [value]

    spec = describe(S).methods["get"]
    assert spec.decode_args([{"n": 1}]) == [Local(1)]


def test_classes_defined_in_the_service_body_resolve() -> None:
    @service
    class S:
        @dataclasses.dataclass
        class Inner:
            v: str

        @rpc
        def get(self, value: Inner) -> Inner:
            return value

    assert describe(S).methods["get"].decode_result({"v": "x"}) == S.Inner("x")


# -------------------------------------------------------------------- encode (client)


@pytest.mark.parametrize(
    ("args", "kwargs", "wire"),
    [
        ((1, 2), {}, [1, 2]),
        ((1,), {}, [1, 1]),
        ((), {"a": 5}, [5, 1]),
        ((), {"b": 3, "a": 5}, [5, 3]),
        ((4,), {"b": 7}, [4, 7]),
    ],
)
def test_encode_args_binds_like_python(
    args: tuple[Any, ...], kwargs: dict[str, Any], wire: list[Any]
) -> None:
    assert method("add").encode_args(args, kwargs) == wire


@pytest.mark.parametrize(
    ("args", "kwargs", "message", "path"),
    [
        (("x", 2), {}, "Calculator.add: req.a: expected int, got str ('x')", "req.a"),
        ((1, None), {}, "Calculator.add: req.b: expected int, got None", "req.b"),
        ((), {"a": 1, "b": 2.5}, "Calculator.add: req.b: expected int, got float (2.5)", "req.b"),
        ((), {}, "Calculator.add: missing required argument 'a'", "req.a"),
        ((), {"b": 2}, "Calculator.add: missing required argument 'a'", "req.a"),
        ((1, 2, 3), {}, "Calculator.add: takes 2 positional argument(s) but 3 were given", "req"),
        ((1,), {"c": 3}, "Calculator.add: got an unexpected keyword argument 'c'", "req"),
        ((1,), {"a": 3}, "Calculator.add: got multiple values for argument 'a'", "req.a"),
    ],
)
def test_encode_args_errors_name_method_path_and_expectation(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str, path: str
) -> None:
    with pytest.raises(ValidationError) as info:
        method("add").encode_args(args, kwargs)
    assert str(info.value) == message
    assert info.value.method == "Calculator.add"
    assert info.value.path == path


def test_encode_args_checks_nested_values_and_converts_ints_to_floats() -> None:
    total = method("total")
    wire = total.encode_args(([Item(1, "a"), Item(2.5)],), {})
    assert ormsgpack.unpackb(ormsgpack.packb(wire)) == [
        [{"x": 1.0, "label": "a"}, {"x": 2.5, "label": ""}],
        "fast",
    ]
    assert wire[1] is Mode.FAST
    with pytest.raises(ValidationError) as info:
        total.encode_args(([Item(1.0), Item("no")],), {"mode": Mode.SLOW})  # type: ignore[arg-type]
    assert str(info.value) == "Calculator.total: req.items[1].x: expected float, got str ('no')"
    assert info.value.expected == "float"


def test_positional_only_parameters_refuse_keywords() -> None:
    pos_only = method("pos_only")
    assert pos_only.encode_args((1,), {"b": "x"}) == [1, "x"]
    with pytest.raises(ValidationError, match="positional-only argument 'a' passed by keyword"):
        pos_only.encode_args((), {"a": 1})


def test_tensor_arguments_are_not_copied() -> None:
    t = torch.ones(3)
    wire = method("scale").encode_args((t, 2), {})
    assert wire[0] is t
    assert type(wire[1]) is float


# --------------------------------------------------------------------- decode (engine)


def test_decode_args_builds_typed_values() -> None:
    total = method("total")
    wire = ormsgpack.unpackb(
        ormsgpack.packb(total.encode_args(([Item(1.0, "a")],), {"mode": Mode.SLOW}))
    )
    assert total.decode_args(wire) == [[Item(1.0, "a")], Mode.SLOW]


def test_decode_args_fills_trailing_defaults() -> None:
    assert method("add").decode_args([3]) == [3, 1]
    assert method("total").decode_args([[]]) == [[], Mode.FAST]


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (["x", 1], "Calculator.add: req.a: expected int, got str ('x')"),
        ([1, True], "Calculator.add: req.b: expected int, got bool (True)"),
        ([], "Calculator.add: req.a: missing required argument 'a'"),
        ([1, 2, 3], "Calculator.add: req: takes 2 argument(s) but 3 were sent"),
        ({"c": 1}, "Calculator.add: req: unexpected argument 'c'; the parameters are a, b"),
        ({"b": 1}, "Calculator.add: req.a: missing required argument 'a'"),
        (None, "Calculator.add: req: expected an argument list or map, got NoneType"),
    ],
)
def test_decode_args_errors(wire: object, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        method("add").decode_args(wire)
    assert str(info.value) == message
    assert info.value.method == "Calculator.add"


def test_deeply_nested_payloads_are_validation_errors() -> None:
    @dataclasses.dataclass
    class Node:
        child: Node | None = None

    @service
    class S:
        @rpc
        def walk(self, node: Node) -> Node:
            return node

    walk = describe(S).methods["walk"]
    payload: dict[str, Any] = {}
    for _ in range(5000):
        payload = {"child": payload}
    with pytest.raises(ValidationError, match=r"S\.walk: req: value is nested too deeply"):
        walk.decode_args([payload])
    with pytest.raises(ValidationError, match=r"S\.walk: result: value is nested too deeply"):
        walk.decode_result(payload)


def test_decode_args_reports_nested_paths() -> None:
    with pytest.raises(ValidationError) as info:
        method("total").decode_args([[{"x": 1.0}, {"x": 2.0, "extra": 1}]])
    assert info.value.path == "req.items[1]"
    assert "unknown field(s) 'extra'" in str(info.value)


# ---------------------------------------------------------------------------- results


def test_results_and_stream_items_are_checked_and_decoded() -> None:
    add, total, count = method("add"), method("total"), method("count")
    assert add.check_result(3) == 3
    assert add.decode_result(3) == 3
    assert type(total.check_result(2)) is float
    assert count.decode_result(7) == 7
    with pytest.raises(ValidationError) as info:
        add.check_result("3")
    assert str(info.value) == "Calculator.add: result: expected int, got str ('3')"
    assert info.value.path == "result"
    with pytest.raises(ValidationError, match=r"Calculator\.count: result: expected int"):
        count.decode_result(None)


def test_none_result() -> None:
    pos_only = method("pos_only")
    assert pos_only.check_result(None) is None
    with pytest.raises(ValidationError, match="expected None, got int"):
        pos_only.check_result(0)


# ------------------------------------------------------------------ definition errors


def test_streaming_annotations_accept_async_iterable_and_generator() -> None:
    @service
    class S:
        @rpc
        async def a(self) -> AsyncIterable[int]:
            yield 1

        @rpc
        async def b(self) -> AsyncGenerator[str, None]:
            yield ""

    spec = describe(S)
    assert spec.methods["a"].streaming
    assert spec.methods["b"].result_type.description == "str"


def define(body: str) -> None:
    """Define a service from source, like a user module under postponed annotations."""
    fingerprint_of(body)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (
            """
            @service
            class S:
                @rpc
                def f(self, x) -> int: ...
            """,
            "S.f: parameter 'x' has no type annotation",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, x: int): ...
            """,
            "S.f: missing return annotation",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, *xs: int) -> int: ...
            """,
            "S.f: parameter '*xs' is not supported",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, **kw: int) -> int: ...
            """,
            "S.f: parameter '**kw' is not supported",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, *, k: int) -> int: ...
            """,
            "S.f: keyword-only parameter 'k' is not supported",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self) -> AsyncIterator[int]:
                    yield 1
            """,
            "S.f: sync generators cannot stream",
        ),
        (
            """
            @service
            class S:
                @rpc
                async def f(self) -> AsyncIterator[int]:
                    return None
            """,
            "S.f: annotated AsyncIterator[int] but does not 'yield'",
        ),
        (
            """
            @service
            class S:
                @rpc
                async def f(self) -> int:
                    yield 1
            """,
            "S.f: an async generator must be annotated '-> AsyncIterator[T]'",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, x: set[int]) -> int: ...
            """,
            "S.f parameter 'x': unsupported type set[int]",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, x: int) -> object: ...
            """,
            "S.f return type: unsupported type object",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, x: Missing) -> int: ...
            """,
            "S.f: cannot resolve the type of parameter 'x' ('Missing')",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, x: list[int] = []) -> int: ...
            """,
            "S.f parameter 'x': unsupported mutable default []",
        ),
        (
            """
            @service
            class S:
                @rpc
                def f(self, x: int = "one") -> int: ...
            """,
            "S.f parameter 'x': default 'one' does not match its type",
        ),
        (
            """
            @service
            class S:
                def f(self) -> int: ...
            """,
            "S has no @rpc methods",
        ),
        (
            """
            @service
            class S:
                @staticmethod
                @rpc
                def f(x: int) -> int: ...
            """,
            "S.f: @rpc methods cannot be static or class methods",
        ),
        (
            """
            @service
            class S:
                @rpc
                @staticmethod
                def f(x: int) -> int: ...
            """,
            "@rpc must decorate a plain function",
        ),
        (
            """
            @service
            class Base:
                @rpc
                def f(self) -> int: ...

            @service
            class S(Base):
                def f(self) -> int: ...
            """,
            "S.f overrides an @rpc method without @rpc",
        ),
        (
            """
            @service(name="")
            class S:
                @rpc
                def f(self) -> int: ...
            """,
            "service name must be a non-empty str",
        ),
    ],
)
def test_definition_errors_are_raised_at_class_definition(body: str, fragment: str) -> None:
    with pytest.raises(ServiceDefinitionError) as info:
        define(body)
    assert fragment in str(info.value)
    assert isinstance(info.value, TypeError)


def test_service_requires_a_class() -> None:
    with pytest.raises(ServiceDefinitionError, match="@service must decorate a class"):
        service(lambda: None)  # type: ignore[call-overload]


# ------------------------------------------------------------------------ fingerprint

BASE = """
@service
class S:
    @rpc
    async def add(self, a: int, b: int = 1) -> int: ...
    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        yield n
"""


def test_fingerprint_is_deterministic() -> None:
    assert fingerprint_of(BASE) == fingerprint_of(BASE)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("a: int, b", "x: int, b"),  # parameter name
        ("a: int, b", "a: float, b"),  # parameter type
        ("b: int = 1", "b: int = 2"),  # default value
        ("b: int = 1", "b: int"),  # default removed
        ("a: int, b", "a: int, /, b"),  # parameter kind
        ("b: int = 1) -> int", "b: int = 1) -> float"),  # return type
        ("async def add", "async def plus"),  # method name
        ("class S:", "class S:\n    @rpc\n    def new(self) -> None: ..."),  # added method
        ("@service\n", '@service(name="T")\n'),  # service name
        (
            "count(self, n: int) -> AsyncIterator[int]:\n        yield n",
            "count(self, n: int) -> list[int]: ...",
        ),  # streaming flag
    ],
)
def test_fingerprint_changes_with_any_signature_change(old: str, new: str) -> None:
    changed = BASE.replace(old, new, 1)
    assert changed != BASE
    assert fingerprint_of(changed) != fingerprint_of(BASE)


def test_fingerprint_ignores_class_name_implementation_kind_and_method_order() -> None:
    renamed = BASE.replace("@service\nclass S:", '@service(name="S")\nclass Other:')
    assert fingerprint_of(renamed, "Other") == fingerprint_of(BASE)
    sync = BASE.replace("async def add", "def add")
    assert fingerprint_of(sync) == fingerprint_of(BASE)
    reordered = """
    @service
    class S:
        @rpc
        async def count(self, n: int) -> AsyncIterator[int]:
            yield n
        @rpc
        async def add(self, a: int, b: int = 1) -> int: ...
    """
    assert fingerprint_of(reordered) == fingerprint_of(BASE)


# ------------------------------------------------------------------ binding property


@st.composite
def signatures_and_calls(draw: st.DrawFn) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    n = draw(st.integers(min_value=0, max_value=5))
    n_posonly = draw(st.integers(min_value=0, max_value=n))
    n_defaults = draw(st.integers(min_value=0, max_value=n))
    parts = []
    for i in range(n):
        default = f" = {-i}" if i >= n - n_defaults else ""
        parts.append(f"p{i}: int{default}")
        if i == n_posonly - 1:
            parts.append("/")
    source = f"def f(self, {', '.join(parts)}) -> None: ...".replace("(self, )", "(self)")
    n_args = draw(st.integers(min_value=0, max_value=n + 1))
    args = tuple(range(100, 100 + n_args))
    names = [f"p{i}" for i in range(n)] + ["zz"]
    kwargs = {k: 200 + i for i, k in enumerate(draw(st.lists(st.sampled_from(names), unique=True)))}
    return source, args, kwargs


@functools.cache
def _compiled(source: str) -> tuple[Any, MethodSpec]:
    """The function ``source`` defines and its method spec, compiled once per signature
    (a few dozen signatures recur across the examples; compiling is most of the cost)."""
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    fn = namespace["f"]
    return fn, describe(service(type("S", (), {"f": rpc(fn)}))).methods["f"]


@settings(max_examples=200, deadline=None)
@given(case=signatures_and_calls())
def test_encode_args_binds_exactly_like_inspect(
    case: tuple[str, tuple[Any, ...], dict[str, Any]],
) -> None:
    source, args, kwargs = case
    fn, spec = _compiled(source)
    try:
        bound = inspect.signature(fn).bind(None, *args, **kwargs)
    except TypeError:
        with pytest.raises(ValidationError):
            spec.encode_args(args, kwargs)
        return
    bound.apply_defaults()
    expected = list(bound.arguments.values())[1:]
    assert spec.encode_args(args, kwargs) == expected
    assert spec.decode_args(expected) == expected


def test_definition_errors_name_a_local_class_as_class_dot_method() -> None:
    # A class defined in a function: "C.gen", as for a module-level class ("S.f"), never
    # its qualified name ("test_...<locals>.C.gen").
    with pytest.raises(ServiceDefinitionError) as caught:

        @service
        class C:
            @rpc
            def gen(self) -> AsyncIterator[int]:  # type: ignore[misc]
                yield 1

    assert str(caught.value).startswith("C.gen: sync generators cannot stream")
    with pytest.raises(ServiceDefinitionError) as caught:

        @service
        class D:
            @rpc
            async def f(self) -> set[int]:
                return set()

    assert str(caught.value).startswith("D.f return type")
