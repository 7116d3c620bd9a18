"""The static type of a client stub: [`Stub`][tensorrpc.Stub], generic in the service class.

Its methods do not behave like the class's (a unary call is awaited even for a sync
``def``; a streaming one returns a [`CallStream`][tensorrpc.CallStream]), so the exact
types come from the mypy plugin ``tensorrpc.mypy_plugin``; without it, attributes are
``Callable[..., Any]`` (docs/client.md)."""

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
