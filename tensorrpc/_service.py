"""``@service`` / ``@rpc``: typed service definitions, compiled into specs (sans-I/O).

``@rpc`` checks at once what needs no type resolution; ``@service`` resolves every
annotation (the method's module globals plus the namespace the class was defined in),
compiles the validators, generates a Request and a Response dataclass per method and
computes the fingerprint (docs/protocol.md). Every error is a
[`ServiceDefinitionError`][tensorrpc.ServiceDefinitionError] raised while the class
statement runs; the rules are in docs/services.md and docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import json
import sys
import typing
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Mapping,
    Sequence,
)
from types import MappingProxyType
from typing import Any, TypeVar, overload

from tensorrpc._batching import Batching, Continuous
from tensorrpc._exceptions import ServiceDefinitionError, ValidationError
from tensorrpc._schema import (
    CompiledType,
    Converter,
    _Invalid,
    _tuple_apply,
    compile_type,
    guarded,
    too_deep,
)

__all__ = ["BatchSpec", "MethodSpec", "ServiceSpec", "describe", "rpc", "service"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

_RPC_MARK = "_tensorrpc_rpc"
_BATCH_ATTR = "_tensorrpc_batch"
_SPEC_ATTR = "_tensorrpc_spec"
#: Bumped whenever the text hashed into fingerprints changes meaning.
_FINGERPRINT_VERSION = "tensorrpc-schema-1"

_P = inspect.Parameter
_STREAM_ORIGINS = (AsyncIterator, AsyncIterable, AsyncGenerator)
_BATCH_ORIGINS = (list, Sequence)


@dataclasses.dataclass(frozen=True, slots=True)
class BatchSpec:
    """How a batched method's handler runs (``@rpc(batch=...)``); see docs/batching.md."""

    #: The [`Batching`][tensorrpc.Batching] or [`Continuous`][tensorrpc.Continuous] settings.
    config: Batching | Continuous
    #: The handler's own signature, one list per parameter, e.g.
    #: ``embed(text: list[str]) -> list[Tensor]``.
    signature: str
    #: True for an ``async def`` handler; a sync one runs each batch (or step) in a thread.
    is_async: bool

    @property
    def continuous(self) -> bool:
        """True for continuous batching of a stream (one handler call per step)."""
        return isinstance(self.config, Continuous)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class MethodSpec:
    """Everything the runtime needs to know about one ``@rpc`` method.

    The four helpers ``encode_args``, ``decode_args``, ``check_result`` and
    ``decode_result`` run on every call. They are compiled closures stored as attributes
    (called like methods, without the cost of a bound-method hop) and all raise
    [`ValidationError`][tensorrpc.ValidationError] naming the method, the path and the expected
    type.
    """

    #: The service's name.
    service: str
    #: The method's name (also the attribute name on the class).
    name: str
    #: Generated frozen dataclass with one field per parameter (defaults kept).
    request_type: type
    #: Generated frozen dataclass with one field ``value`` (the stream item when streaming).
    response_type: type
    #: Parameter names in order, ``self`` excluded.
    params: tuple[str, ...]
    #: True for an async generator declared ``-> AsyncIterator[T]``.
    streaming: bool
    #: True for ``async def`` (coroutine or async generator); False for a sync ``def``.
    #: A batched method's per-item entry point is always async (see ``batch.is_async``).
    is_async: bool
    #: Compiled type of each parameter, in order.
    param_types: tuple[CompiledType, ...]
    #: Compiled return type (the item type when streaming).
    result_type: CompiledType
    #: Parameter name -> default value, for parameters that have one.
    defaults: Mapping[str, object]
    #: Human-readable signature, e.g. ``add(a: int, b: int = 1) -> int``.
    signature: str
    #: Client side: ``encode_args(args, kwargs) -> list``. Binds a call like Python
    #: would (missing, unexpected or doubled arguments are errors), fills defaults,
    #: checks every value and returns the positional wire list, one entry per parameter.
    encode_args: Callable[[tuple[Any, ...], Mapping[str, Any]], list[Any]] = dataclasses.field(
        repr=False
    )
    #: Engine side: ``decode_args(wire) -> list``. ``wire`` is either a list of
    #: ``len(params)`` values (or shorter when the missing trailing parameters have
    #: defaults) or a map of parameter name -> value (missing parameters take their
    #: defaults; unknown names are refused); each value is validated and built into its
    #: typed value. Returns the positional list either way.
    decode_args: Callable[[object], list[Any]] = dataclasses.field(repr=False)
    #: Engine side: ``check_result(value) -> wire value`` for a result or stream item.
    check_result: Callable[[object], object] = dataclasses.field(repr=False)
    #: Client side: ``decode_result(wire) -> typed value`` for a result or stream item.
    decode_result: Callable[[object], object] = dataclasses.field(repr=False)
    #: ``@rpc(batch=...)``: how the handler runs; None for a method called once per call.
    #: The other fields describe one item (what a caller sends and gets).
    batch: BatchSpec | None = None
    #: The request is a stream: the handler's one parameter is annotated
    #: ``AsyncIterator[X]`` (client streaming; bidirectional when ``streaming`` too) and
    #: the CALL carries no arguments (``params`` is empty).
    request_streaming: bool = False
    #: Request streams: the stream parameter's name and compiled item type ``X``.
    item_param: str = ""
    item_type: CompiledType | None = None
    #: Request streams, client side: ``check_item(value, index) -> wire value``.
    check_item: Callable[[object, int], object] | None = dataclasses.field(default=None, repr=False)
    #: Request streams, engine side: ``decode_item(wire, index) -> typed value``; a
    #: mismatch raises ValidationError with the path ``param[index]...``.
    decode_item: Callable[[object, int], object] | None = dataclasses.field(
        default=None, repr=False
    )

    @property
    def qualname(self) -> str:
        """``Service.method``, as used in error messages."""
        return f"{self.service}.{self.name}"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ServiceSpec:
    """The compiled description of a ``@service`` class."""

    #: The service name (``@service(name=...)``, default the class name).
    name: str
    #: Method name -> spec, in definition order (base classes first).
    methods: Mapping[str, MethodSpec]
    #: Hex sha256 over the name and the normalised method signatures.
    fingerprint: str


# ----------------------------------------------------------------------------- @rpc


@overload
def rpc(fn: F, /) -> F: ...
@overload
def rpc(*, batch: Batching | Continuous | None = None) -> Callable[[F], F]: ...
def rpc(
    fn: F | None = None, /, *, batch: Batching | Continuous | None = None
) -> F | Callable[[F], F]:
    """Mark a method of a ``@service`` class as callable remotely.

    ``@rpc`` and ``@rpc(batch=...)`` both work. The function is returned unchanged (so
    type checkers keep its signature); ``@service`` compiles it. Checks that need no type
    resolution happen here.

    With ``batch=Batching(...)`` the handler receives a batch of calls: one ``list[T]``
    per parameter, returning ``list[R]`` with one result per item; callers see the
    per-item method ``(T, ...) -> R``. With ``batch=Continuous(...)`` the handler is one
    step of a stream batch (same lists, one output per active item) and callers see a
    streaming method ``(T, ...) -> AsyncIterator[R]``. See docs/batching.md.

    Raises:
        ServiceDefinitionError: ``fn`` is not a plain function, is a sync generator, takes
            ``*args``/``**kwargs``/keyword-only parameters, or lacks an annotation; or
            the ``batch`` settings are invalid.
    """
    if fn is None:
        return lambda f: _mark(f, batch)
    return _mark(fn, batch)


def _mark(fn: F, batch: Batching | Continuous | None) -> F:
    if not inspect.isfunction(fn):
        raise ServiceDefinitionError(
            f"@rpc must decorate a plain function (put it directly above 'def'), got {fn!r}"
        )
    # "Class.method", as the service's own errors name it: not "f.<locals>.Class.method".
    where = ".".join(fn.__qualname__.split(".")[-2:])
    if inspect.isgeneratorfunction(fn):
        raise ServiceDefinitionError(
            f"{where}: sync generators cannot stream; write 'async def' with 'yield' and "
            "annotate '-> AsyncIterator[T]'"
        )
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD):
        raise ServiceDefinitionError(f"{where}: an @rpc method needs 'self' as its first parameter")
    for p in params[1:]:
        if p.kind is _P.VAR_POSITIONAL or p.kind is _P.VAR_KEYWORD:
            star = "*" if p.kind is _P.VAR_POSITIONAL else "**"
            raise ServiceDefinitionError(
                f"{where}: parameter '{star}{p.name}' is not supported; declare each "
                "parameter with its type"
            )
        if p.kind is _P.KEYWORD_ONLY:
            raise ServiceDefinitionError(
                f"{where}: keyword-only parameter '{p.name}' is not supported; make it a "
                "regular parameter (it can still be passed by keyword)"
            )
        if p.annotation is _P.empty:
            raise ServiceDefinitionError(f"{where}: parameter '{p.name}' has no type annotation")
    if sig.return_annotation is inspect.Signature.empty:
        raise ServiceDefinitionError(
            f"{where}: missing return annotation (write '-> None' if it returns nothing)"
        )
    if batch is not None:
        if not isinstance(batch, (Batching, Continuous)):
            raise ServiceDefinitionError(
                f"{where}: batch= takes Batching(...) or Continuous(...), got {batch!r}"
            )
        batch.check(where)
        setattr(fn, _BATCH_ATTR, batch)
    setattr(fn, _RPC_MARK, True)
    return fn


# ------------------------------------------------------------------------- @service


@overload
def service(cls: type[T], /) -> type[T]: ...
@overload
def service(*, name: str | None = None) -> Callable[[type[T]], type[T]]: ...
def service(
    cls: type[T] | None = None, /, *, name: str | None = None
) -> type[T] | Callable[[type[T]], type[T]]:
    """Turn a class with ``@rpc`` methods into a service.

    Both ``@service`` and ``@service(name="calc")`` work; the default name is the class
    name. The spec is compiled now (so every mistake surfaces at class definition) and stored
    on the class; read it with [`describe`][tensorrpc.describe].

    Raises:
        ServiceDefinitionError: The class has no ``@rpc`` methods, or one of them cannot
            be described (unsupported or unresolvable type, bad default, ...).
    """
    # The namespace the class statement ran in resolves annotations naming local classes.
    caller = sys._getframe(1)
    localns = dict(caller.f_locals) if caller.f_code.co_name != "<module>" else {}
    del caller
    if name is not None and (not isinstance(name, str) or not name):
        raise ServiceDefinitionError(f"service name must be a non-empty str, got {name!r}")

    def decorate(klass: type[T]) -> type[T]:
        if not isinstance(klass, type):
            raise ServiceDefinitionError(f"@service must decorate a class, got {klass!r}")
        spec = _build_service(klass, name or klass.__name__, localns)
        setattr(klass, _SPEC_ATTR, spec)
        return klass

    if cls is not None:
        return decorate(cls)
    return decorate


def describe(service: type | object) -> ServiceSpec:
    """Return the [`ServiceSpec`][tensorrpc.ServiceSpec] of a ``@service`` class or of an instance
    of one.

    Raises:
        ServiceDefinitionError: The class is not a service, or is an undecorated subclass
            of one that adds ``@rpc`` methods.
    """
    cls = service if isinstance(service, type) else type(service)
    spec = getattr(cls, _SPEC_ATTR, None)
    if not isinstance(spec, ServiceSpec):
        raise ServiceDefinitionError(f"{cls.__qualname__} is not a @service class")
    for klass in cls.__mro__:
        if _SPEC_ATTR in vars(klass):
            break
        if any(_is_rpc(v) for v in vars(klass).values()):
            raise ServiceDefinitionError(
                f"{klass.__qualname__} defines @rpc methods but is not decorated with @service"
            )
    return spec


def _is_rpc(obj: object) -> bool:
    return getattr(obj, _RPC_MARK, False) is True


def _build_service(cls: type, name: str, localns: dict[str, Any]) -> ServiceSpec:
    functions: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            if isinstance(value, (staticmethod, classmethod)) and _is_rpc(value.__func__):
                raise ServiceDefinitionError(
                    f"{klass.__qualname__}.{attr}: @rpc methods cannot be static or class methods"
                )
            if _is_rpc(value):
                functions[attr] = value
            elif attr in functions:
                raise ServiceDefinitionError(
                    f"{klass.__qualname__}.{attr} overrides an @rpc method without @rpc"
                )
    if not functions:
        raise ServiceDefinitionError(f"{cls.__qualname__} has no @rpc methods")
    ns = {**localns, **vars(cls), cls.__name__: cls}
    methods: dict[str, MethodSpec] = {}
    parts: list[dict[str, Any]] = []
    for attr, fn in functions.items():
        methods[attr], part = _build_method(name, attr, fn, ns)
        parts.append(part)
    return ServiceSpec(
        name=name, methods=MappingProxyType(methods), fingerprint=_fingerprint(name, parts)
    )


# ------------------------------------------------------------------------ one method


def _resolve_hints(fn: Callable[..., Any], where: str, ns: dict[str, Any]) -> dict[str, Any]:
    globalns = getattr(fn, "__globals__", {})
    try:
        return typing.get_type_hints(fn, globalns=globalns, localns=ns, include_extras=True)
    except Exception as exc:
        # Find the annotation that failed, to name it.
        for key, ann in fn.__annotations__.items():
            if isinstance(ann, str):
                try:
                    eval(ann, globalns, ns)  # the same evaluation get_type_hints does
                except Exception as inner:
                    what = "the return annotation" if key == "return" else f"parameter '{key}'"
                    raise ServiceDefinitionError(
                        f"{where}: cannot resolve the type of {what} ({ann!r}): {inner}"
                    ) from inner
        raise ServiceDefinitionError(f"{where}: cannot resolve type hints: {exc}") from exc


def _build_method(
    service_name: str, attr: str, fn: Callable[..., Any], ns: dict[str, Any]
) -> tuple[MethodSpec, dict[str, Any]]:
    """Compile one method; also return its part of the fingerprint text."""
    where = f"{service_name}.{attr}"
    hints = _resolve_hints(fn, where, ns)
    params = list(inspect.signature(fn).parameters.values())[1:]
    batch: BatchSpec | None = None
    config = getattr(fn, _BATCH_ATTR, None)
    if config is not None:
        batch, hints = _batch_hints(where, attr, fn, params, hints, config)
        result_tp, streams = hints["return"], batch.continuous
    else:
        result_tp, streams = _result_annotation(fn, where, hints["return"])
    result = compile_type(result_tp, where=f"{where} return type", localns=ns)
    item = _request_stream(where, params, hints, ns) if batch is None else None
    if item is not None and not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        raise ServiceDefinitionError(f"{where}: a method whose request is a stream is 'async def'")
    p = _compile_params(where, [] if item else params, hints, ns)
    sig_parts = (
        p.sig_parts if item is None else [f"{item[0]}: AsyncIterator[{item[1].description}]"]
    )
    signature = f"{attr}({', '.join(sig_parts)}) -> " + (
        f"AsyncIterator[{result.description}]" if streams else result.description
    )
    n_posonly = sum(1 for param in params if param.kind is _P.POSITIONAL_ONLY)
    request_type, response_type = _message_types(service_name, attr, fn, params, hints, result_tp)
    method = MethodSpec(
        service=service_name,
        name=attr,
        request_type=request_type,
        response_type=response_type,
        params=tuple(p.names),
        streaming=streams,
        is_async=batch is not None
        or inspect.iscoroutinefunction(fn)
        or inspect.isasyncgenfunction(fn),
        param_types=tuple(p.types),
        result_type=result,
        defaults=MappingProxyType(p.defaults),
        signature=signature,
        encode_args=_make_encode(where, p.names, p.types, p.defaults, n_posonly),
        decode_args=_make_decode(where, p.names, p.types, p.defaults),
        check_result=guarded(result.fast_check, where, "result"),
        decode_result=guarded(result.fast_from_wire, where, "result"),
        batch=batch,
        **_item_fields(where, item),
    )
    part = {
        "name": attr,
        "params": [
            [n, k, t.description, p.default_reprs.get(n)]
            for n, k, t in zip(p.names, p.kinds, p.types, strict=True)
        ]
        if item is None
        else [[item[0], params[0].kind.name, f"stream[{item[1].description}]", None]],
        "returns": result.description,
        "streaming": streams,
    }
    return method, part


def _request_stream(
    where: str, params: list[inspect.Parameter], hints: dict[str, Any], ns: dict[str, Any]
) -> tuple[str, CompiledType] | None:
    """A request-streaming method's stream parameter and item type; None for others.

    A method whose request is a stream takes exactly one parameter, annotated
    ``AsyncIterator[X]`` or ``AsyncIterable[X]``, without a default.
    """
    param = next(
        (p for p in params if typing.get_origin(_bare(hints[p.name])) in _STREAM_ORIGINS), None
    )
    if param is None:
        return None
    if len(params) != 1 or param.default is not _P.empty:
        raise ServiceDefinitionError(
            f"{where}: a method whose request is a stream takes exactly one parameter, "
            f"annotated AsyncIterator[X], without a default (got {len(params)} parameters)"
        )
    args = typing.get_args(_bare(hints[param.name]))
    if not args or typing.get_origin(_bare(hints[param.name])) is AsyncGenerator:
        raise ServiceDefinitionError(
            f"{where}: annotate the stream parameter '{param.name}' as AsyncIterator[X]"
        )
    pwhere = f"{where} parameter '{param.name}'"
    return param.name, compile_type(args[0], where=pwhere, localns=ns)


def _bare(tp: object) -> object:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _item_fields(where: str, item: tuple[str, CompiledType] | None) -> dict[str, Any]:
    """The request-stream fields of a `MethodSpec` (none for other methods)."""
    if item is None:
        return {}
    name, node = item
    check, from_wire = node.fast_check, node.fast_from_wire

    def convert(fn: Callable[[object], object]) -> Callable[[object, int], object]:
        def run(value: object, index: int) -> object:
            try:
                return fn(value)
            except _Invalid as exc:
                raise exc.to_error(where, f"{name}[{index}]") from exc.cause
            except RecursionError:
                raise too_deep(where, f"{name}[{index}]") from None

        return run

    return {
        "request_streaming": True,
        "item_param": name,
        "item_type": node,
        "check_item": convert(check),
        "decode_item": convert(from_wire),
    }


def _batch_item(where: str, what: str, tp: object, config: Batching | Continuous) -> object:
    """``T`` of a batched handler's ``list[T]`` / ``Sequence[T]`` annotation."""
    bare = _bare(tp)
    args = typing.get_args(bare)
    if typing.get_origin(bare) not in _BATCH_ORIGINS or len(args) != 1:
        kind = type(config).__name__
        raise ServiceDefinitionError(
            f"{where}: {what} of a {kind} handler must be annotated list[T] (one entry per "
            f"item; callers pass T), got {_show(tp)}"
        )
    return args[0]


def _batch_hints(
    where: str,
    attr: str,
    fn: Callable[..., Any],
    params: list[inspect.Parameter],
    hints: dict[str, Any],
    config: Batching | Continuous,
) -> tuple[BatchSpec, dict[str, Any]]:
    """A batched handler's spec, and the per-item hints that callers see."""
    if inspect.isasyncgenfunction(fn):
        raise ServiceDefinitionError(
            f"{where}: a batched handler returns one list per batch (or step); it cannot "
            "'yield' (use Continuous(...) for a stream: each step returns one output per item)"
        )
    if not params:
        raise ServiceDefinitionError(f"{where}: a batched method needs at least one parameter")
    item_hints: dict[str, Any] = {}
    for p in params:
        if p.default is not _P.empty:
            raise ServiceDefinitionError(
                f"{where}: parameter '{p.name}' of a batched method cannot have a default "
                "(every caller passes every argument)"
            )
        item_hints[p.name] = _batch_item(where, f"parameter '{p.name}'", hints[p.name], config)
    item_hints["return"] = _batch_item(where, "the return type", hints["return"], config)
    parts = [f"{p.name}: {_show(hints[p.name])}" for p in params]
    signature = f"{attr}({', '.join(parts)}) -> {_show(hints['return'])}"
    spec = BatchSpec(config=config, signature=signature, is_async=inspect.iscoroutinefunction(fn))
    return spec, item_hints


def _result_annotation(fn: Callable[..., Any], where: str, ret: object) -> tuple[object, bool]:
    """The type of a method's result (of each item, for a stream) and whether it streams."""
    ret = _bare(ret)
    ret_origin = typing.get_origin(ret)
    is_asyncgen = inspect.isasyncgenfunction(fn)
    streams = ret_origin in _STREAM_ORIGINS
    if is_asyncgen and not streams:
        raise ServiceDefinitionError(
            f"{where}: an async generator must be annotated '-> AsyncIterator[T]', not {_show(ret)}"
        )
    if streams and not is_asyncgen:
        raise ServiceDefinitionError(
            f"{where}: annotated {_show(ret)} but does not 'yield'; a streaming method "
            "must be an async generator ('async def' with 'yield')"
        )
    if not streams:
        return ret, False
    ret_args = typing.get_args(ret)
    if not ret_args:
        raise ServiceDefinitionError(f"{where}: write {_show(ret_origin)}[T], with T")
    if (
        ret_origin is AsyncGenerator
        and len(ret_args) == 2
        and ret_args[1] not in (None, type(None))
    ):
        raise ServiceDefinitionError(
            f"{where}: a streaming method cannot receive values; use AsyncGenerator[T, None]"
        )
    return ret_args[0], True


@dataclasses.dataclass
class _Params:
    """The compiled parameters of one method, in order."""

    names: list[str] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)
    types: list[CompiledType] = dataclasses.field(default_factory=list)
    defaults: dict[str, object] = dataclasses.field(default_factory=dict)
    default_reprs: dict[str, str] = dataclasses.field(default_factory=dict)
    #: ``name: type`` (`` = default``) of each parameter, for the signature text.
    sig_parts: list[str] = dataclasses.field(default_factory=list)


def _compile_params(
    where: str, params: list[inspect.Parameter], hints: dict[str, Any], ns: dict[str, Any]
) -> _Params:
    out = _Params()
    for p in params:
        pwhere = f"{where} parameter '{p.name}'"
        node = compile_type(hints[p.name], where=pwhere, localns=ns)
        out.names.append(p.name)
        out.kinds.append(p.kind.name)
        out.types.append(node)
        text = f"{p.name}: {node.description}"
        if p.default is not _P.empty:
            out.default_reprs[p.name] = _default_repr(p.default, pwhere)
            try:
                out.defaults[p.name] = node.fast_check(p.default)
            except _Invalid as exc:
                raise ServiceDefinitionError(
                    f"{pwhere}: default {p.default!r} does not match its type: "
                    f"{exc.message('default')}"
                ) from None
            text += f" = {out.default_reprs[p.name]}"
        out.sig_parts.append(text)
    return out


def _message_types(
    service_name: str,
    attr: str,
    fn: Callable[..., Any],
    params: list[inspect.Parameter],
    hints: dict[str, Any],
    result_tp: object,
) -> tuple[type, type]:
    """The generated request and response dataclasses of a method."""
    qual = f"{service_name}_{attr}"
    request_type = dataclasses.make_dataclass(
        f"{qual}_Request",
        [
            (p.name, hints[p.name])
            if p.default is _P.empty
            else (p.name, hints[p.name], dataclasses.field(default=p.default))
            for p in params
        ],
        frozen=True,
        slots=True,
    )
    response_type = dataclasses.make_dataclass(
        f"{qual}_Response", [("value", result_tp)], frozen=True, slots=True
    )
    # The generated types live beside the service (make_dataclass has no module= in 3.11).
    for generated in (request_type, response_type):
        generated.__module__ = fn.__module__
        generated.__qualname__ = f"{service_name}.{attr}.{generated.__name__}"
    return request_type, response_type


def _fingerprint(name: str, parts: list[dict[str, Any]]) -> str:
    parts = sorted(parts, key=lambda d: str(d["name"]))
    text = json.dumps(
        {"format": _FINGERPRINT_VERSION, "service": name, "methods": parts},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _show(tp: object) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "").replace("collections.abc.", "")


def _default_repr(value: object, where: str) -> str:
    """A stable text for a default; refuses mutable or untravelled defaults."""
    if value is None or type(value) in (bool, int, str, bytes):
        return repr(value)
    if type(value) is float:  # repr(float) is the shortest round-tripping text: stable
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}={_default_repr(value.value, where)}"
    if type(value) is tuple:
        inner = ", ".join(_default_repr(v, where) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})"
    kind = "mutable " if isinstance(value, (list, dict, set, bytearray)) else ""
    raise ServiceDefinitionError(
        f"{where}: unsupported {kind}default {value!r}; defaults must be None, bool, int, "
        "float, str, bytes, Enum members or tuples of these (use None and fill it in the "
        "handler for anything else)"
    )


# ------------------------------------------------------------- compiled hot-path code


def _param_error(where: str, names: list[str], exc: _Invalid) -> ValidationError:
    """The error for a rejected argument, whose index is ``exc``'s outermost segment."""
    i = exc.segments.pop()
    assert isinstance(i, int)
    return exc.to_error(where, f"req.{names[i]}")


def _req_error(where: str, text: str, param: str = "", expected: str = "") -> ValidationError:
    """An error about the request as a whole (``req``) or one parameter (``req.param``)."""
    return ValidationError(
        f"{where}: {text}",
        method=where,
        path=f"req.{param}" if param else "req",
        expected=expected,
        field_path=["req", param] if param else ["req"],
    )


def _convert_args(
    where: str,
    names: list[str],
    types_: list[CompiledType],
    defaults: dict[str, object],
    convs: tuple[Converter, ...],
    values: list[Any],
) -> list[Any]:
    """The slow paths' conversion, in order: ``_DEFAULT`` takes the default or is missing."""
    out: list[Any] = []
    for i, v in enumerate(values):
        name = names[i]
        if v is not _DEFAULT:
            try:
                out.append(convs[i](v))
            except _Invalid as exc:
                raise exc.to_error(where, f"req.{name}") from exc.cause
        elif name in defaults:
            out.append(defaults[name])
        else:
            text = f"req.{name}: missing required argument '{name}'"
            raise _req_error(where, text, name, types_[i].description)
    return out


def _make_encode(
    where: str,
    names: list[str],
    types_: list[CompiledType],
    defaults: dict[str, object],
    n_posonly: int,
) -> Callable[[tuple[Any, ...], Mapping[str, Any]], list[Any]]:
    n = len(names)
    checks = tuple(t.fast_check for t in types_)
    fast: Callable[[Sequence[Any]], list[Any]] = _tuple_apply(checks, as_list=True)
    index = {name: i for i, name in enumerate(names)}
    expected = [t.description for t in types_]

    def bind(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        """Bind keywords and defaults as Python does."""
        if len(args) > n:
            raise _req_error(where, f"takes {n} positional argument(s) but {len(args)} were given")
        _check_keywords(where, index, expected, n_posonly, len(args), kwargs)
        values = list(args)
        for name in names[len(args) :]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in defaults:
                values.append(_DEFAULT)
            else:
                text = f"missing required argument '{name}'"
                raise _req_error(where, text, name, expected[index[name]])
        return _convert_args(where, names, types_, defaults, checks, values)

    def encode(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        try:
            if not kwargs and len(args) == n:
                try:
                    return fast(args)
                except _Invalid as exc:
                    raise _param_error(where, names, exc) from exc.cause
            return bind(args, kwargs)
        except RecursionError:
            raise too_deep(where, "req") from None

    return encode


def _check_keywords(
    where: str,
    index: dict[str, int],
    expected: list[str],
    n_posonly: int,
    n_args: int,
    kwargs: Mapping[str, Any],
) -> None:
    """Refuse keyword arguments that Python would refuse, after ``n_args`` positional ones."""
    for key in kwargs:
        i = index.get(key, -1)
        if i < 0:
            raise _req_error(where, f"got an unexpected keyword argument {key!r}")
        if i < n_posonly:
            text = f"positional-only argument '{key}' passed by keyword"
            raise _req_error(where, text, key, expected[i])
        if i < n_args:
            raise _req_error(where, f"got multiple values for argument '{key}'", key, expected[i])


def _make_decode(
    where: str,
    names: list[str],
    types_: list[CompiledType],
    defaults: dict[str, object],
) -> Callable[[object], list[Any]]:
    n = len(names)
    froms = tuple(t.fast_from_wire for t in types_)
    fast: Callable[[Sequence[Any]], list[Any]] = _tuple_apply(froms, as_list=True)
    known = frozenset(names)

    def slow(wire: object) -> list[Any]:
        """Arguments by name, trailing defaults, and the errors."""
        if type(wire) is dict:
            _check_arg_names(where, names, known, wire)
            wire = [wire.get(name, _DEFAULT) for name in names]
        elif type(wire) is not list and type(wire) is not tuple:
            text = f"req: expected an argument list or map, got {type(wire).__name__}"
            raise _req_error(where, text, expected="list or map")
        assert isinstance(wire, (list, tuple))
        if len(wire) > n:
            text = f"req: takes {n} argument(s) but {len(wire)} were sent"
            raise _req_error(where, text, expected=f"{n} arguments")
        values = [*wire, *[_DEFAULT] * (n - len(wire))]
        return _convert_args(where, names, types_, defaults, froms, values)

    def decode(wire: object) -> list[Any]:
        try:
            if type(wire) is list and len(wire) == n:
                try:
                    return fast(wire)
                except _Invalid as exc:
                    raise _param_error(where, names, exc) from exc.cause
            return slow(wire)
        except RecursionError:
            raise too_deep(where, "req") from None

    return decode


def _check_arg_names(
    where: str, names: list[str], known: frozenset[str], wire: dict[Any, Any]
) -> None:
    """Refuse an argument map with a key that is not one of the parameters."""
    for key in wire:
        if type(key) is not str:
            text = f"req: argument names must be strings, got a key of type {type(key).__name__}"
            raise _req_error(where, text, expected="str keys")
        if key not in known:
            text = f"unexpected argument {key!r}; the parameters are {', '.join(names) or '(none)'}"
            raise _req_error(where, f"req: {text}", key)


# ------------------------------------------------------------------ schemaless calls


def _as_is(value: object) -> object:
    return value


def _schemaless_args(
    where: str,
) -> tuple[
    Callable[[tuple[Any, ...], Mapping[str, Any]], list[Any]], Callable[[object], list[Any]]
]:
    """``encode_args`` and ``decode_args`` of a schemaless method: positional lists as is."""

    def encode(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        if kwargs:
            text = "a schemaless call cannot bind keyword arguments; send them as a map"
            raise _req_error(where, f"{text} (call_by_name)", expected="positional arguments")
        return list(args)

    def decode(wire: object) -> list[Any]:
        if type(wire) is not list:
            text = f"req: expected an argument list, got {type(wire).__name__}"
            raise _req_error(where, text, expected="list")
        return list(wire)

    return encode, decode


def schemaless_method(service: str, name: str, *, streaming: bool) -> MethodSpec:
    """A [`MethodSpec`][tensorrpc.MethodSpec] for calling ``name`` without the service class.

    For a schemaless client ([`Client.dynamic`][tensorrpc.Client.dynamic]): its arguments
    travel as a positional list or a map (the engine validates them), and results pass
    through as the codec decoded them.
    """
    encode, decode = _schemaless_args(f"{service}.{name}")
    qual = f"{service}_{name}".replace(".", "_")
    return MethodSpec(
        service=service,
        name=name,
        request_type=dataclasses.make_dataclass(f"{qual}_Request", [], frozen=True),
        response_type=dataclasses.make_dataclass(
            f"{qual}_Response", [("value", object)], frozen=True
        ),
        params=(),
        streaming=streaming,
        is_async=True,
        param_types=(),
        result_type=CompiledType("any", _as_is, _as_is),
        defaults=MappingProxyType({}),
        signature=f"{name}(...) -> " + ("AsyncIterator[any]" if streaming else "any"),
        encode_args=encode,
        decode_args=decode,
        check_result=_as_is,
        decode_result=_as_is,
    )


#: A parameter left to its default.
_DEFAULT: Any = object()
