"""Static checks (mypy) of BlockingClient's typing: the async client's types, without await.

mypy verifies the ``assert_type`` calls and the ``type: ignore`` codes (strict mode flags an
unused ignore, so each one proves that mypy still rejects a wrong call). Nothing here runs
a call: the functions are only type-checked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, assert_type

import torch

from tensorrpc import (
    BlockingCallView,
    BlockingClient,
    BlockingStream,
    BlockingStub,
    ClientStatistics,
    EngineInfo,
)
from tests.typing.test_client_typing import Calc


def typed_calls(client: BlockingClient[Calc]) -> None:
    """Never run: only type-checked."""
    assert_type(client.call(Calc.add, 1), int)
    assert_type(client.call(Calc.add, 1, b=2), int)
    assert_type(client.call(Calc.scale, torch.ones(2), 2.0), torch.Tensor)
    assert_type(client.stream(Calc.count, 5), BlockingStream[int])
    for item in client.stream(Calc.count, 5):
        assert_type(item, int)
    with client.stream(Calc.count, 5) as stream:
        assert_type(next(stream), int)
    iterator: Iterator[int] = client.stream(Calc.count, 5)
    del iterator
    calc = client.stub()
    assert_type(calc, BlockingStub[Calc])
    # With tensorrpc.mypy_plugin: results themselves, sync and async handlers alike.
    assert_type(calc.add(1, 2), int)
    assert_type(calc.add(1, b=5), int)
    assert_type(calc.scale(torch.ones(1), 2.0), torch.Tensor)
    assert_type(calc.count(3), BlockingStream[int])
    assert_type(client.with_options(engine="e1").stub().add(1), int)
    calc.add("x")  # type: ignore[arg-type]
    calc.helper()  # type: ignore[misc]
    view = client.with_options(engine="e1", timeout=1.0, wait=False)
    assert_type(view, BlockingCallView[Calc])
    assert_type(view.call(Calc.add, 1, 2), int)
    assert_type(client.broadcast("add", 1, 2), dict[str, Any])
    assert_type(client.call_by_name("add", {"a": 1}), Any)
    assert_type(client.wait_for_engines(2, timeout=5), Mapping[str, EngineInfo])
    assert_type(client.engines["e1"], EngineInfo)
    assert_type(client.statistics(), ClientStatistics)
    client.call(Calc.add, "x")  # type: ignore[arg-type]
    client.call(Calc.add, 1, c=3)  # type: ignore[call-arg]
    client.stream(Calc.add, 1)  # type: ignore[arg-type]
    client.with_options(transport="pigeon")  # type: ignore[arg-type]


def streaming_method_through_call_is_an_error(client: BlockingClient[Calc]) -> None:
    """Never run: `call` on a streaming method raises TypeError; mypy says to stream it."""
    client.call(Calc.count, 3)  # type: ignore[misc]


def constructors() -> None:
    """Never run: the class is generic in the service, as Client is."""
    assert_type(BlockingClient(Calc, bind="tcp://127.0.0.1:0"), BlockingClient[Calc])
    assert_type(BlockingClient.dynamic(connect="tcp://127.0.0.1:1"), BlockingClient[Any])
    BlockingClient(Calc, bind="tcp://127.0.0.1:0", backend="curio")  # type: ignore[arg-type]


def test_the_checks_above_are_type_checked_not_run() -> None:
    # The typing lives in the functions above (mypy runs over tests/); this test keeps the
    # module collected so that an import error in it fails the suite.
    assert callable(typed_calls)
