"""The static type of a client stub: [`Stub`][tensorrpc.Stub], generic in the service class.

A stub is not typed as the service class itself, because its methods do not behave like
the class's methods: every unary call returns an awaitable, even for a sync ``def``
handler, and a streaming method returns a [`CallStream`][tensorrpc.CallStream]. Plain
typing cannot map "the methods of ``S``" to "the same signatures returning awaitables",
so the exact method types come from the mypy plugin ``tensorrpc.mypy_plugin``
(``plugins = ["tensorrpc.mypy_plugin"]`` in the mypy configuration). The plugin types
``stub.name`` from the service's ``@rpc`` method ``name``:

* ``async def name(...) -> R`` and ``def name(...) -> R`` give ``(...) -> Coroutine[Any, Any, R]``;
* ``async def name(...) -> AsyncIterator[T]`` (with ``yield``) gives ``(...) -> CallStream[T]``;
* any other attribute is an error.

Without the plugin (other type checkers), stub attributes are ``Callable[..., Any]``:
nothing wrong is asserted, nothing is checked. [`CallView.call`][tensorrpc.CallView.call]
and [`CallView.stream`][tensorrpc.CallView.stream] are exact under any checker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Stub"]

S = TypeVar("S")


class Stub(Generic[S]):
    """A proxy whose attributes call the ``@rpc`` methods of the service ``S``.

    Returned by [`CallView.stub`][tensorrpc.CallView.stub]: ``await stub.add(1, 2)``
    calls ``add`` on an engine, ``stub.count(5)`` is a [`CallStream`][tensorrpc.CallStream]
    for ``async for``. With the mypy plugin ``tensorrpc.mypy_plugin`` each attribute is
    typed from the service method (see the module documentation); an attribute that is
    not an ``@rpc`` method raises `AttributeError`.
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        raise AttributeError(f"{type(self).__name__} has no rpc method {name!r}")
