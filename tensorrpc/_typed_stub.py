"""Typed stubs that any type checker reads: one line per method, no plugin (docs/client.md).

A `TypedStub` subclass names each method through the service class's own method
(``add = unary(Calc.add)``), so its parameters and result come from the service's
annotations; the class checks its entries when it is defined.
"""

from __future__ import annotations

import functools
import typing
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from tensorrpc._service import describe

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

    from tensorrpc._views import CallStream, CallView

__all__ = ["TypedStub", "streaming", "unary"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
S = TypeVar("S")


class _Method:
    __slots__ = ("method", "name")

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.name = getattr(method, "__name__", "?")


class UnaryMethod(_Method, Generic[P, R]):
    """A unary method of a `TypedStub` (made by [`unary`][tensorrpc.unary])."""

    __slots__ = ()

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> UnaryMethod[P, R]: ...
    @overload
    def __get__(
        self, obj: TypedStub[Any], owner: type[Any] | None = None
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...
    def __get__(self, obj: TypedStub[Any] | None, owner: type[Any] | None = None) -> Any:
        if obj is None:
            return self
        return functools.partial(obj.view.call, self.method)


class StreamingMethod(_Method, Generic[P, T]):
    """A streaming method of a `TypedStub` (made by [`streaming`][tensorrpc.streaming])."""

    __slots__ = ()

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> StreamingMethod[P, T]: ...
    @overload
    def __get__(
        self, obj: TypedStub[Any], owner: type[Any] | None = None
    ) -> Callable[P, CallStream[T]]: ...
    def __get__(self, obj: TypedStub[Any] | None, owner: type[Any] | None = None) -> Any:
        if obj is None:
            return self
        return functools.partial(obj.view.stream, self.method)


@overload
def unary(method: Callable[Concatenate[Any, P], Awaitable[R]], /) -> UnaryMethod[P, R]: ...
@overload
def unary(method: Callable[Concatenate[Any, P], R], /) -> UnaryMethod[P, R]: ...
def unary(method: Callable[..., Any], /) -> Any:
    """A unary ``@rpc`` method of the service (``async def`` or ``def``), as a stub entry.

    Args:
        method: The method, taken from the service class (``Calc.add``).

    Returns:
        A descriptor: ``stub.add(...)`` returns a coroutine of the method's result.
    """
    return UnaryMethod(method)


def streaming(method: Callable[Concatenate[Any, P], AsyncIterator[T]], /) -> StreamingMethod[P, T]:
    """A streaming ``@rpc`` method of the service (an async generator), as a stub entry.

    Args:
        method: The method, taken from the service class (``Calc.count``).

    Returns:
        A descriptor: ``stub.count(...)`` returns a `CallStream` of its items.
    """
    return StreamingMethod(method)


class TypedStub(Generic[S]):
    """Base class of a stub whose methods any type checker reads (see the module docs).

    Args:
        view: The client (or a view of it, ``client.with_options(...)``) that makes the
            calls, with the options they take.

    Raises:
        TypeError: When a subclass is defined: it names no service
            (``TypedStub[Service]``), or an entry is not an ``@rpc`` method of the
            service, or is `unary` for a streaming method or `streaming` for a unary one.
    """

    __slots__ = ("view",)

    def __init__(self, view: CallView[S]) -> None:
        self.view = view

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        services = [
            typing.get_args(base)[0]
            for base in getattr(cls, "__orig_bases__", ())
            if typing.get_origin(base) is TypedStub and typing.get_args(base)
        ]
        if not services:
            raise TypeError(
                f"{cls.__name__} must name its service: class {cls.__name__}(TypedStub[Service])"
            )
        spec = describe(services[0])
        for attr, entry in vars(cls).items():
            if not isinstance(entry, _Method):
                continue
            method = spec.methods.get(entry.name)
            if method is None or getattr(services[0], entry.name, None) is not entry.method:
                raise TypeError(
                    f"{cls.__name__}.{attr}: {entry.name!r} is not an @rpc method of {spec.name}"
                )
            if method.streaming != isinstance(entry, StreamingMethod):
                kind = "streaming" if method.streaming else "unary"
                raise TypeError(
                    f"{cls.__name__}.{attr}: {spec.name}.{entry.name} is {kind}; "
                    f"declare it with {kind}({spec.name}.{entry.name})"
                )
