"""A TypedStub, checked by mypy (no plugin needed) and pyright on the same cases.

Not part of the project's mypy run (excluded in pyproject.toml):
tests/typing/test_typed_stub.py checks this file with each checker, without the mypy
plugin, and compares the errors with the ``# E`` comments: a line marked ``# E`` must get
exactly one error from each checker, and no other line may get one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import assert_type

import torch

from tensorrpc import CallStream, Client, TypedStub, rpc, service, streaming, unary


@service
class Calc:
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


class CalcStub(TypedStub[Calc]):
    add = unary(Calc.add)
    scale = unary(Calc.scale)
    count = streaming(Calc.count)


async def accepted(client: Client[Calc]) -> None:
    calc = CalcStub(client)
    assert_type(await calc.add(1, 2), int)
    assert_type(await calc.add(1, b=5), int)
    assert_type(await calc.scale(torch.ones(2), 2.0), torch.Tensor)
    assert_type(calc.count(3), CallStream[int])
    async for i in calc.count(3):
        assert_type(i, int)
    view = CalcStub(client.with_options(timeout=5.0))
    assert_type(await view.add(1), int)


async def rejected(client: Client[Calc]) -> None:
    calc = CalcStub(client)
    await calc.add("x")  # E
    await calc.add(1, c=2)  # E
    await calc.scale(torch.ones(2))  # E
    y: torch.Tensor = calc.scale(torch.ones(2), 2.0)  # E
    s: str = await calc.add(1, 2)  # E
    await calc.count(3)  # E
    calc.nothing()  # E
    print(y, s)
