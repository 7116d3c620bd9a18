"""mypy plugin: exact types for client stubs (``client.stub().method``).

Enable it in the mypy configuration of the code that calls tensorrpc services::

    [tool.mypy]
    plugins = ["tensorrpc.mypy_plugin"]

What it does:

* ``@service`` classes: records, in the class's mypy metadata, which methods carry
  ``@rpc`` and whether each is sync, async or streaming (the metadata survives mypy's
  incremental cache).
* [`Stub[S]`][tensorrpc.Stub] attributes: ``stub.name`` gets the signature of ``S.name``
  without ``self``, returning ``Coroutine[Any, Any, R]`` for a unary method (sync or async,
  as the stub's call is awaited either way) and [`CallStream[T]`][tensorrpc.CallStream]
  for a streaming method. A name that is not an ``@rpc`` method is an error, as it is at
  run time.
* [`BlockingStub[S]`][tensorrpc.BlockingStub] attributes (a
  [`BlockingClient`][tensorrpc.BlockingClient]'s stub): the same signatures, returning
  the result ``R`` itself for a unary method and
  [`BlockingStream[T]`][tensorrpc.BlockingStream] for a streaming one.

This module imports mypy; ``import tensorrpc`` never imports it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from mypy.expandtype import expand_type_by_instance
from mypy.maptype import map_instance_to_supertype
from mypy.nodes import CallExpr, Decorator, Expression, RefExpr, TypeInfo
from mypy.plugin import AttributeContext, ClassDefContext, Plugin
from mypy.typeops import bind_self
from mypy.types import (
    AnyType,
    CallableType,
    Instance,
    ProperType,
    Type,
    TypeOfAny,
    get_proper_type,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["TensorRPCPlugin", "plugin"]

_STUB = "tensorrpc._stub.Stub"
_BLOCKING_STUB = "tensorrpc._blocking.BlockingStub"
_BLOCKING_STREAM = "tensorrpc.BlockingStream"
_SERVICE_DECORATORS = frozenset({"tensorrpc._service.service", "tensorrpc.service"})
_RPC_DECORATORS = frozenset({"tensorrpc._service.rpc", "tensorrpc.rpc"})
_META = "tensorrpc"
_CALL_STREAM = "tensorrpc.CallStream"


def _decorator_name(expr: Expression) -> str | None:
    if isinstance(expr, CallExpr):
        expr = expr.callee
    return expr.fullname if isinstance(expr, RefExpr) else None


def _rpc_kind(node: Decorator) -> str | None:
    if not any(_decorator_name(d) in _RPC_DECORATORS for d in node.original_decorators):
        return None
    if node.func.is_async_generator:
        return "stream"
    return "async" if node.func.is_coroutine else "sync"


def _record_rpc_methods(ctx: ClassDefContext) -> bool:
    """``@service`` hook: store ``{method: kind}`` for every ``@rpc`` method in the MRO."""
    methods: dict[str, str] = {}
    for info in reversed(ctx.cls.info.mro):
        inherited = info.metadata.get(_META, {}).get("rpc")
        if isinstance(inherited, dict):
            methods.update(inherited)
        for name, sym in info.names.items():
            if isinstance(sym.node, Decorator):
                kind = _rpc_kind(sym.node)
                if kind is not None:
                    methods[name] = kind
    ctx.cls.info.metadata[_META] = {"rpc": methods}
    return True


def _rpc_methods(info: TypeInfo) -> dict[str, str] | None:
    meta = info.metadata.get(_META, {}).get("rpc")
    return meta if isinstance(meta, dict) else None


def _stub_attribute(ctx: AttributeContext, *, name: str, blocking: bool = False) -> Type:
    """``Stub[S].name``: the ``@rpc`` method's signature, returning what the stub returns.

    ``BlockingStub[S].name`` (``blocking``): the same, returning the result itself.
    """
    stub = get_proper_type(ctx.type)
    expected = _BLOCKING_STUB if blocking else _STUB
    if not isinstance(stub, Instance) or stub.type.fullname != expected or not stub.args:
        return ctx.default_attr_type
    service = get_proper_type(stub.args[0])
    if not isinstance(service, Instance):
        return ctx.default_attr_type  # Any, a type variable, ...: nothing to check against
    methods = _rpc_methods(service.type)
    if methods is None:
        ctx.api.fail(
            f'"{service.type.name}" is not a @service class, so its stub has no methods',
            ctx.context,
        )
        return AnyType(TypeOfAny.from_error)
    kind = methods.get(name)
    sym = service.type.get(name)
    if kind is None or name.startswith("_") or sym is None or not isinstance(sym.node, Decorator):
        ctx.api.fail(f'Service "{service.type.name}" has no @rpc method "{name}"', ctx.context)
        return AnyType(TypeOfAny.from_error)
    declared = get_proper_type(sym.node.func.type)
    if not isinstance(declared, CallableType):
        return ctx.default_attr_type  # unannotated: @service refuses it at run time anyway
    owner = sym.node.func.info
    bound = bind_self(declared, service)
    if owner is not None and owner is not service.type:
        bound = expand_type_by_instance(bound, map_instance_to_supertype(service, owner))
    else:
        bound = expand_type_by_instance(bound, service)
    returns = _stub_returns(ctx, kind, get_proper_type(bound.ret_type), blocking=blocking)
    return bound.copy_modified(ret_type=returns)


def _stub_returns(ctx: AttributeContext, kind: str, result: ProperType, *, blocking: bool) -> Type:
    """What the stub method returns for a handler of ``kind`` declared to return ``result``."""
    any_type = AnyType(TypeOfAny.special_form)
    coroutine = (
        kind == "async"
        and isinstance(result, Instance)
        and result.type.fullname == "typing.Coroutine"
    )
    if kind == "stream":
        item: Type = any_type
        if isinstance(result, Instance):
            iterator = ctx.api.named_generic_type("typing.AsyncIterator", [any_type])
            mapped = map_instance_to_supertype(result, iterator.type)
            if mapped.args:
                item = mapped.args[0]
        stream = _BLOCKING_STREAM if blocking else _CALL_STREAM
        return ctx.api.named_generic_type(stream, [item])
    if blocking:
        if coroutine and isinstance(result, Instance) and len(result.args) == 3:
            return result.args[2]
        return result
    if coroutine:
        return result
    return ctx.api.named_generic_type("typing.Coroutine", [any_type, any_type, result])


class TensorRPCPlugin(Plugin):
    """Types ``Stub[S]`` and ``BlockingStub[S]`` attributes from the ``@rpc`` methods of ``S``."""

    def get_class_decorator_hook_2(self, fullname: str) -> Callable[[ClassDefContext], bool] | None:
        return _record_rpc_methods if fullname in _SERVICE_DECORATORS else None

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if owner == _STUB:
            return partial(_stub_attribute, name=name)
        if owner == _BLOCKING_STUB:
            return partial(_stub_attribute, name=name, blocking=True)
        return None


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point: the plugin class for any mypy version (the hooks used are stable).

    Args:
        version: The running mypy's version.

    Returns:
        The plugin class.
    """
    del version
    return TensorRPCPlugin
