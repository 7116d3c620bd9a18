"""mypy plugin: exact types for client stubs and ``client.call`` (docs/client.md).

Enable it with ``plugins = ["tensorrpc.mypy_plugin"]`` in the mypy configuration. It
records which methods of a ``@service`` class carry ``@rpc`` (in the class's mypy
metadata), types [`Stub[S]`][tensorrpc.Stub] and [`BlockingStub[S]`][tensorrpc.BlockingStub]
attributes from ``S``'s methods, gives batched methods their per-item signature, and
checks ``client.call(Service.method, ...)`` against the method's own parameters so that
mypy names the wrong argument instead of ``No overload variant``. ``import tensorrpc``
never imports this module."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from mypy.expandtype import expand_type_by_instance
from mypy.maptype import map_instance_to_supertype
from mypy.nodes import (
    ARG_POS,
    ARG_STAR,
    ARG_STAR2,
    ArgKind,
    CallExpr,
    Decorator,
    Expression,
    RefExpr,
    TypeInfo,
)
from mypy.plugin import (
    AttributeContext,
    ClassDefContext,
    MethodContext,
    MethodSigContext,
    Plugin,
)
from mypy.typeops import bind_self
from mypy.types import (
    AnyType,
    CallableType,
    FunctionLike,
    Instance,
    ProperType,
    Type,
    TypeOfAny,
    UnionType,
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
#: Classes whose ``call`` takes its signature from the method passed (True: blocking).
_CALLS = {"tensorrpc._views.CallView": False, "tensorrpc._blocking.BlockingCallView": True}


def _decorator_name(expr: Expression) -> str | None:
    if isinstance(expr, CallExpr):
        expr = expr.callee
    return expr.fullname if isinstance(expr, RefExpr) else None


def _batch_kind(decorator: Expression) -> str | None:
    """``"batch"`` / ``"continuous"`` for ``@rpc(batch=Batching(...) / Continuous(...))``."""
    if not isinstance(decorator, CallExpr):
        return None
    for name, arg in zip(decorator.arg_names, decorator.args, strict=False):
        if name == "batch" and isinstance(arg, CallExpr) and isinstance(arg.callee, RefExpr):
            callee = arg.callee.fullname or ""
            if callee.endswith(".Continuous"):
                return "continuous"
            if callee.endswith(".Batching"):
                return "batch"
    return None


def _rpc_kind(node: Decorator) -> str | None:
    found = [d for d in node.original_decorators if _decorator_name(d) in _RPC_DECORATORS]
    if not found:
        return None
    batch = _batch_kind(found[0])
    if batch is not None:
        return f"{batch}-async" if node.func.is_coroutine else f"{batch}-sync"
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
    if kind.startswith(("batch", "continuous")):
        declared = _per_item(ctx, declared, kind)
        kind = "stream" if kind.startswith("continuous") else kind.rpartition("-")[2]
    bound = bind_self(declared, service)
    if owner is not None and owner is not service.type:
        bound = expand_type_by_instance(bound, map_instance_to_supertype(service, owner))
    else:
        bound = expand_type_by_instance(bound, service)
    bound = _request_items(ctx, bound, first=0)
    returns = _stub_returns(ctx, kind, get_proper_type(bound.ret_type), blocking=blocking)
    return bound.copy_modified(ret_type=returns)


_STREAM_PARAMS = frozenset({"typing.AsyncIterator", "typing.AsyncIterable"})


def _request_items(
    ctx: AttributeContext | MethodContext, method: CallableType, *, first: int
) -> CallableType:
    """A request-streaming method's one parameter (``AsyncIterator[X]``, at ``first``: 0
    once ``self`` is bound) as callers may pass it: ``AsyncIterable[X] | Iterable[X]``."""
    if len(method.arg_types) != first + 1:
        return method
    param = get_proper_type(method.arg_types[first])
    if not isinstance(param, Instance) or param.type.fullname not in _STREAM_PARAMS:
        return method
    if not param.args:
        return method
    item = param.args[0]
    widened = UnionType(
        [
            ctx.api.named_generic_type("typing.AsyncIterable", [item]),
            ctx.api.named_generic_type("typing.Iterable", [item]),
        ]
    )
    return method.copy_modified(arg_types=[*method.arg_types[:first], widened])


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


_LISTS = frozenset({"builtins.list", "typing.Sequence", "collections.abc.Sequence"})


def _list_item(tp: Type) -> Type:
    """``T`` of ``list[T]`` / ``Sequence[T]`` (Any for anything else: @service refuses it)."""
    proper = get_proper_type(tp)
    if isinstance(proper, Instance) and proper.type.fullname in _LISTS and proper.args:
        return proper.args[0]
    return AnyType(TypeOfAny.from_error)


def _per_item(ctx: AttributeContext, declared: CallableType, kind: str) -> CallableType:
    """A batched handler's signature as one caller sees it (``self`` kept): each
    ``list[T]`` parameter becomes ``T``; the result ``list[R]`` becomes ``R`` (in a
    coroutine for an async handler), or ``AsyncIterator[R]`` for continuous batching."""
    args = [declared.arg_types[0], *(_list_item(t) for t in declared.arg_types[1:])]
    ret = get_proper_type(declared.ret_type)
    if isinstance(ret, Instance) and ret.type.fullname == "typing.Coroutine" and len(ret.args) == 3:
        ret = get_proper_type(ret.args[2])
    item = _list_item(ret)
    any_type = AnyType(TypeOfAny.special_form)
    if kind.startswith("continuous"):
        item = ctx.api.named_generic_type("typing.AsyncIterator", [item])
    elif kind.endswith("-async"):
        item = ctx.api.named_generic_type("typing.Coroutine", [any_type, any_type, item])
    return declared.copy_modified(arg_types=args, ret_type=item)


def _class_attribute(ctx: AttributeContext, *, kind: str) -> Type:
    """``Service.method`` of a batched method: the per-item signature (see `_per_item`)."""
    declared = get_proper_type(ctx.default_attr_type)
    if not isinstance(declared, CallableType) or not declared.arg_types:
        return ctx.default_attr_type
    return _per_item(ctx, declared, kind)


def _supertype_arg(ctx: MethodSigContext | MethodContext, tp: Type, fullname: str) -> Type | None:
    """``X`` when ``tp`` is an ``fullname[X]`` (``typing.Awaitable``, ...), else None."""
    proper = get_proper_type(tp)
    if not isinstance(proper, Instance):
        return None
    info = ctx.api.named_generic_type(fullname, [AnyType(TypeOfAny.special_form)]).type
    if not proper.type.has_base(info.fullname):
        return None
    mapped = map_instance_to_supertype(proper, info)
    return mapped.args[0] if mapped.args else None


def _called_method(ctx: MethodSigContext | MethodContext) -> CallableType | None:
    """The type of ``Service.method`` passed to ``call``, if it is a plain method."""
    if not ctx.args or not ctx.args[0]:
        return None
    method = get_proper_type(ctx.api.get_expression_type(ctx.args[0][0]))
    if not isinstance(method, CallableType) or not method.arg_types or method.is_type_obj():
        return None
    return method


def _is_stream(ctx: MethodSigContext | MethodContext, method: CallableType) -> bool:
    return _supertype_arg(ctx, method.ret_type, "typing.AsyncIterator") is not None


def _call_signature(ctx: MethodSigContext, *, blocking: bool) -> FunctionLike:
    """``view.call(Service.method, ...)``: any arguments (`_check_call` checks them against
    ``method``), returning ``method``'s result.

    The declared overloads would infer their result type ``R`` from the context (the
    type of the variable assigned to), then fail to match the method and report
    ``No overload variant``: with the result fixed here, a wrong assignment is reported
    as such, and the arguments are checked against the method alone.
    """
    signature = ctx.default_signature
    method = _called_method(ctx)
    if method is None:
        return signature  # not a plain method: the declared overloads decide
    any_type = AnyType(TypeOfAny.special_form)
    result: Type = any_type
    if not _is_stream(ctx, method):
        result = _supertype_arg(ctx, method.ret_type, "typing.Awaitable") or method.ret_type
    ret_type = (
        result
        if blocking
        else ctx.api.named_generic_type("typing.Coroutine", [any_type, any_type, result])
    )
    return signature.copy_modified(
        arg_types=[method, any_type, any_type],
        arg_kinds=[ARG_POS, ARG_STAR, ARG_STAR2],
        arg_names=[None, "args", "kwargs"],
        ret_type=ret_type,
        variables=[],
    )


def _check_call(ctx: MethodContext) -> Type:
    """Check ``view.call(Service.method, *args, **kwargs)``'s arguments against ``method``."""
    method = _called_method(ctx)
    if method is None:
        return ctx.default_return_type
    name = method.name or "method"
    if _is_stream(ctx, method):
        shown = '" of "'.join(name.split(" of ", 1))
        ctx.api.fail(
            f'"{shown}" is a streaming method: iterate client.stream(...), not client.call(...)',
            ctx.context,
        )
        return ctx.default_return_type
    args: list[Expression] = []
    kinds: list[ArgKind] = []
    names: list[str | None] = []
    for group in range(1, len(ctx.args)):
        args.extend(ctx.args[group])
        kinds.extend(ctx.arg_kinds[group])
        names.extend(ctx.arg_names[group])
    # The method as the engine runs it: without ``self`` (errors name "add" of "Calc").
    unbound = method.copy_modified(
        arg_types=method.arg_types[1:],
        arg_kinds=method.arg_kinds[1:],
        arg_names=method.arg_names[1:],
    )
    unbound = _request_items(ctx, unbound, first=0)
    checker = ctx.api.expr_checker  # type: ignore[attr-defined]
    checker.check_call(
        callee=unbound, args=args, arg_kinds=kinds, arg_names=names, context=ctx.context
    )
    return ctx.default_return_type


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

    def _view_call(self, fullname: str) -> bool | None:
        """For ``X.call`` of a call view: whether the view is blocking; else None."""
        owner, _, name = fullname.rpartition(".")
        if name != "call":
            return None
        sym = self.lookup_fully_qualified(owner)
        if sym is None or not isinstance(sym.node, TypeInfo):
            return None
        for view, blocking in _CALLS.items():
            if sym.node.has_base(view):
                return blocking
        return None

    def get_method_signature_hook(
        self, fullname: str
    ) -> Callable[[MethodSigContext], FunctionLike] | None:
        blocking = self._view_call(fullname)
        return None if blocking is None else partial(_call_signature, blocking=blocking)

    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        return None if self._view_call(fullname) is None else _check_call

    def get_class_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        sym = self.lookup_fully_qualified(owner) if owner else None
        if sym is None or not isinstance(sym.node, TypeInfo):
            return None
        kind = (_rpc_methods(sym.node) or {}).get(name)
        if kind is None or not kind.startswith(("batch", "continuous")):
            return None
        return partial(_class_attribute, kind=kind)


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point: the plugin class for any mypy version (the hooks used are stable)."""
    del version
    return TensorRPCPlugin
