"""Static checks (mypy) that ``@rpc``/``@service`` keep the user's signatures.

mypy verifies the ``assert_type`` calls and the ``type: ignore`` codes (strict mode flags
an unused ignore, so each one proves that mypy still rejects a wrong call). pytest runs
the same code, where ``assert_type`` is a no-op and the calls really execute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine
from typing import Any, assert_type

import pytest

from tensorrpc._service import MethodSpec, ServiceSpec, describe, rpc, service


@service
class Calc:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    def scale(self, x: float, factor: float) -> float:
        return x * factor

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


@service(name="named")
class Named:
    @rpc
    def ping(self) -> None:
        return None


async def test_rpc_keeps_method_signatures() -> None:
    calc = Calc()
    coro = assert_type(calc.add(1, 2), Coroutine[Any, Any, int])
    assert await coro == 3
    assert_type(calc.scale(2.0, 3.0), float)
    stream = calc.count(2)
    assert_type(stream, AsyncIterator[int])
    assert [i async for i in stream] == [0, 1]


def test_wrong_calls_are_rejected_by_mypy() -> None:
    calc = Calc()
    with pytest.raises(TypeError):
        calc.scale(1.0, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        calc.add(1, 2, 3)  # type: ignore[call-arg, unused-coroutine]
    assert calc.scale(2, 3) == 6


def test_service_returns_the_class_itself() -> None:
    assert_type(Calc, type[Calc])
    assert_type(Named, type[Named])
    assert_type(describe(Calc), ServiceSpec)
    assert_type(describe(Named()).methods["ping"], MethodSpec)
    assert describe(Named).name == "named"
