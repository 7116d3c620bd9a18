"""Stub calls that fail at run time, so mypy (with tensorrpc.mypy_plugin) must reject them.

Not part of the project's mypy run (excluded in pyproject.toml): tests/typing/test_stub_plugin.py
checks this file alone and compares mypy's errors with the expected-error comments, line by line.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from tensorrpc import BlockingClient, Client, rpc, service


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

    def helper(self) -> int:
        return 1


class Plain:
    def f(self) -> int:
        return 1


async def sync_handler_result_used_without_await(client: Client[Calc]) -> None:
    calc = client.stub()
    z: torch.Tensor = calc.scale(torch.ones(2), 2.0)  # E: Incompatible types in assignment
    print(z)


async def wrong_arguments(client: Client[Calc]) -> None:
    calc = client.stub()
    await calc.add("x")  # E: Argument 1 to "add" of "Calc" has incompatible type "str"
    await calc.add(1, c=2)  # E: Unexpected keyword argument "c" for "add" of "Calc"
    await calc.scale(torch.ones(2))  # E: Missing positional argument "factor"


async def not_an_rpc_method(client: Client[Calc]) -> None:
    client.stub().helper()  # E: Service "Calc" has no @rpc method "helper"
    _ = client.stub().nothing  # E: Service "Calc" has no @rpc method "nothing"


async def stream_awaited_or_unary_iterated(client: Client[Calc]) -> None:
    calc = client.stub()
    await calc.count(3)  # E: Incompatible types in "await"
    async for x in calc.add(1):  # E: "Coroutine[Any, Any, int]" has no attribute "__aiter__"
        print(x)


async def call_mistakes(client: Client[Calc]) -> None:
    # client.call names the mistake, as the stub does (not "No overload variant of call").
    s: str = await client.call(Calc.add, 1)  # E: Incompatible types in assignment (expression
    await client.call(Calc.add, "x")  # E: Argument 1 to "add" of "Calc" has incompatible type
    await client.call(Calc.add, 1, c=2)  # E: Unexpected keyword argument "c" for "add" of "Calc"
    await client.call(Calc.scale, torch.ones(2))  # E: Missing positional argument "factor"
    await client.call(Calc.scale, x=1, factor=2.0)  # E: Argument 1 to "scale" of "Calc" has
    await client.call(Calc.count, 3)  # E: "count" of "Calc" is a streaming method: iterate
    print(s)


def blocking_call_mistakes(client: BlockingClient[Calc]) -> None:
    s: str = client.call(Calc.add, 1)  # E: Incompatible types in assignment (expression has
    client.call(Calc.add, "x")  # E: Argument 1 to "add" of "Calc" has incompatible type "str"
    print(s)


async def not_a_service(client: Client[Plain]) -> None:
    client.stub().f()  # E: "Plain" is not a @service class, so its stub has no methods
