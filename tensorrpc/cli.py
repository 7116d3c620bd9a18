"""The ``tensorrpc`` command (docs/cli.md): ``serve``, ``describe``, ``call``, ``health``,
``top``, ``bench`` and ``demo``.

User mistakes (a bad address, an unknown method or class, a malformed ``--arg``, an engine
that does not answer in time) are reported as one line on stderr, never a traceback. The
exit status is 2 for usage errors, 1 for other failures and 0 on success.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import enum
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import anyio

import tensorrpc
from tensorrpc import _cli_ops
from tensorrpc._schema import json_schemas
from tensorrpc._text import peer_text

__all__ = ["main"]

logger = logging.getLogger("tensorrpc.cli")
T = TypeVar("T")

#: Elements of a tensor printed by ``call`` (the rest is summarized by its shape).
DEFAULT_MAX_VALUES = 8
_LOG_LEVELS = ("debug", "info", "warning", "error")
_SCHEMES = ("tcp://", "ipc://", "inproc://")
_PORT = re.compile(r"^:?(\d{1,5})$")
_HOST_PORT = re.compile(r"^([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5}|\*)$")
_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


class CommandError(Exception):
    """A failure the user can act on: reported in one line, exit status 1."""


# --------------------------------------------------------------------------- parsing


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="tensorrpc",
        description="asyncio-native RPC for tensor-heavy Python services.",
        epilog="Run 'tensorrpc SUBCOMMAND --help' for the options of each subcommand.",
    )
    parser.add_argument("--version", action="version", version=tensorrpc.__version__)
    sub = parser.add_subparsers(
        dest="command", metavar="SUBCOMMAND", parser_class=_Parser, required=True
    )
    for add in (_add_serve, _add_describe, _add_call, _add_health, _add_top, _add_runners):
        add(sub)
    return parser


def _opt(parser: argparse.ArgumentParser, flags: str, help: str, **kw: Any) -> None:
    """``parser.add_argument``, the flags in one string."""
    parser.add_argument(*flags.split(), help=help, **kw)


def _seconds(parser: argparse.ArgumentParser, flag: str, default: float, help: str) -> None:
    """A positive number of seconds."""
    _opt(parser, flag, help, type=_positive_float, default=default, metavar="S")


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run an engine serving a @service class",
        description=(
            "Import module:Class (the current directory is on sys.path), instantiate it "
            "with no arguments and serve it until SIGINT or SIGTERM, which drain the "
            "engine gracefully (exit status 0). module:factory also works: a callable "
            "that takes no arguments and returns an instance of a @service class. Give "
            "--connect (the client binds; the engine dials in, one or more clients) or "
            "--bind (the engine listens; clients dial it)."
        ),
    )
    _opt(serve, "target", "the service class or factory", metavar="module:Class")
    where = serve.add_mutually_exclusive_group(required=True)
    dial = "a client's bound address to dial (repeat for several clients)"
    _opt(where, "--connect", dial, metavar="ADDR", action="append")
    listen = (
        "address to listen on: tcp://HOST:PORT, ipc://PATH, or a bare PORT (meaning "
        "tcp://127.0.0.1:PORT); binding every interface without CURVE logs a warning"
    )
    _opt(where, "--bind", listen, metavar="ADDR")
    _opt(serve, "--engine-id", "engine id (default: hostname-pid)", metavar="ID")
    _opt(serve, "--workers", "calls run at once", type=_positive_int, default=64, metavar="N")
    sync = "threads running sync handlers"
    _opt(serve, "--sync-workers", sync, type=_positive_int, default=8, metavar="N")
    _seconds(serve, "--grace-period", 5.0, "seconds running calls may take to finish at shutdown")
    _cli_ops.add_serve_flags(serve)
    _cli_ops.add_curve_flags(serve, listens=True)
    _add_log_level(serve)


def _add_describe(sub: Any) -> None:
    describe = sub.add_parser(
        "describe",
        help="print a service's methods, types and fingerprint",
        description=(
            "Print a @service class: its name, schema fingerprint and, per method, the "
            "signature, request and response types, whether it streams and whether its "
            "handler is sync or async. Nothing is instantiated for module:Class; a "
            "module:factory is called to get an instance. Given an address "
            "(tcp://HOST:PORT or ipc://PATH) instead, print what the running engine "
            "there announces (as 'call ADDR --list')."
        ),
    )
    what = "the service class or factory, or a running engine's tcp:// or ipc:// address"
    _opt(describe, "target", what, metavar="module:Class|ADDR")
    _opt(describe, "--json", "print JSON", action="store_true")
    _seconds(describe, "--timeout", 10.0, "ADDR: seconds for the engine to answer (default 10)")
    _cli_ops.add_curve_flags(describe, listens=False)


def _add_call(sub: Any) -> None:
    call = sub.add_parser(
        "call",
        help="call a method of a running engine",
        description=(
            "Call a method of a running engine without its class: the engine's HELLO "
            "says which methods it has and which stream. Arguments travel by name and "
            "the engine checks them. A value is parsed as JSON when it parses (numbers, "
            "true/false/null, lists, objects, quoted strings), else taken as a string; "
            "@FILE.npy loads a numpy array (sent as a torch tensor unless the parameter "
            "is an ndarray). The result is printed as JSON (strings as they are, unless "
            "--json), tensors summarized; a stream prints one item per line."
        ),
    )
    address = "the engine's address (tcp://HOST:PORT, ipc://PATH, or a bare PORT)"
    _opt(call, "address", address, metavar="ADDR")
    _opt(call, "method", "the method to call", nargs="?")
    items = "arguments, as after httpie: add a=2 b=5 (same values as --arg)"
    _opt(call, "items", items, nargs="*", metavar="NAME=VALUE")
    each = "an argument (repeat for each)"
    _opt(call, "--arg", each, dest="args", action="append", metavar="NAME=VALUE")
    call.set_defaults(args=[], health=False)
    data = (
        "the arguments as one JSON object, as after grpcurl: -d '{\"a\": 2}'; "
        "@FILE reads it from a file, @- from stdin"
    )
    _opt(call, "-d --data", data, metavar="JSON")
    _opt(call, "--engine", "call this engine (default: any)", metavar="ID")
    wait = "seconds for an engine to answer and the call to finish (default 10)"
    _seconds(call, "--timeout", 10.0, wait)
    bind = "bind ADDR and wait for an engine to dial in, instead of dialling ADDR"
    _opt(call, "--bind", bind, action="store_true")
    _cli_ops.add_curve_flags(call, listens=True)
    _opt(call, "--list", "list the engine's methods instead of calling", action="store_true")
    _opt(call, "--json", "print every value as JSON", action="store_true")
    shown = f"tensor elements to print (default {DEFAULT_MAX_VALUES})"
    _opt(call, "--max-values", shown, type=_positive_int, default=DEFAULT_MAX_VALUES, metavar="N")


def _add_runners(sub: Any) -> None:
    for name, module, what in (
        ("bench", "bench", "the benchmark"),
        ("demo", "examples.multi_engine_demo", "the multi-engine demo"),
    ):
        runner = sub.add_parser(
            name,
            help=f"run {what} (needs a repository checkout)",
            description=(
                f"Run {what} ('python -m {module}' in the repository checkout that "
                "tensorrpc was installed from, or the current directory). Arguments are "
                f"passed on: 'tensorrpc {name} -- --help' shows its own options."
            ),
        )
        _opt(runner, "extra", "arguments", nargs=argparse.REMAINDER, metavar="ARGS")
        runner.set_defaults(module=module)


def _add_top(sub: Any) -> None:
    top = sub.add_parser(
        "top",
        help="live view of engines' statistics",
        description=(
            "A live terminal view of the engines at ADDR...: liveness, calls/s, errors/s, "
            "in-flight and queued calls, latency p50/p99 over the last interval, bytes/s "
            "on the wire and by tensor transport. It reads the engines' built-in "
            "statistics method (no extra port). q or Ctrl-C quits. Needs rich (the 'top' "
            "extra)."
        ),
    )
    _opt(top, "addresses", "engine addresses", nargs="+", metavar="ADDR")
    _seconds(top, "--interval", 1.0, "seconds (default 1)")
    wait = "seconds to wait for an engine and for each answer (default 10)"
    _seconds(top, "--timeout", 10.0, wait)
    _opt(top, "--count", "stop after N refreshes", type=_positive_int, metavar="N")
    _cli_ops.add_curve_flags(top, listens=False)
    _add_log_level(top)


def _add_health(sub: Any) -> None:
    health = sub.add_parser(
        "health",
        help="check that an engine serves (exit 0) or not (exit 1)",
        description=(
            "A probe for orchestrators (a container exec probe): dial ADDR (or, with "
            "--bind, wait for an engine to dial in), ask the engine's built-in health "
            "method and exit 0 when it answers SERVING, printing its id, service and pid; "
            "exit 1 with the reason when it answers NOT_SERVING (draining, or its "
            "application said so) or SERVICE_UNKNOWN, or when no engine answers within "
            "--timeout (refused engines are named)."
        ),
    )
    _opt(health, "address", "the engine's address", metavar="ADDR")
    _opt(health, "--engine", "require this engine id", metavar="ID")
    service = "ask about this service (default: the engine as a whole)"
    _opt(health, "--service", service, default="", metavar="NAME")
    _seconds(health, "--timeout", 5.0, "seconds for an engine to answer (default 5)")
    bind = "bind ADDR and wait for an engine to dial in"
    _opt(health, "--bind", bind, action="store_true")
    _opt(health, "--json", "print the engine as JSON", action="store_true")
    _cli_ops.add_curve_flags(health, listens=True)
    # What `_call` reads of a `call` command line, for a handshake only.
    health.set_defaults(health=True, list=False, method=None)


def _cmd_top(args: argparse.Namespace) -> int:
    try:
        # top imports rich lazily, when it draws: check for it here, before connecting.
        import rich  # noqa: F401

        from tensorrpc import top
    except ImportError as exc:
        raise CommandError(
            f"tensorrpc top needs rich: pip install 'tensorrpc[top]' ({exc})"
        ) from None
    curve = _curve(args, listening=False)
    addresses = [normalize_address(a) for a in args.addresses]
    try:
        return _run(
            lambda: top.run(
                addresses, interval=args.interval, wait=args.timeout, count=args.count, curve=curve
            )
        )
    except tensorrpc.EnginesUnavailableError:
        raise CommandError(
            f"no engine answered at {' '.join(addresses)} within {args.timeout:g} s"
        ) from None


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    level = "logging level (default info; debug also prints tracebacks)"
    _opt(parser, "--log-level", level, choices=_LOG_LEVELS, default="info", type=str.lower)


def _positive(kind: Callable[[str], T], what: str) -> Callable[[str], T]:
    """An argparse type: a positive, finite ``kind``."""

    def parse(text: str) -> T:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or not math.isfinite(value):  # type: ignore[operator, arg-type]
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {text!r}")
        return value

    return parse


_positive_int = _positive(int, "integer")
_positive_float = _positive(float, "number")


def normalize_address(text: str) -> str:
    """A command-line address as a ZMQ endpoint: a bare port is on loopback (UsageError)."""
    if text.startswith(_SCHEMES):
        if text.partition("://")[2]:
            return text
        raise UsageError(f"bad address {text!r}: nothing after '://'")
    if (m := _PORT.match(text)) is not None:
        port = int(m[1])
        if port > 65535:
            raise UsageError(f"bad address {text!r}: port out of range")
        return f"tcp://127.0.0.1:{port}"
    if (m := _HOST_PORT.match(text)) is not None:
        return f"tcp://{text}"
    raise UsageError(
        f"bad address {text!r}: expected tcp://HOST:PORT, ipc://PATH, HOST:PORT or a PORT"
    )


# ----------------------------------------------------------------------- loading code


def load_target(target: str) -> object:
    """Import ``module:attr`` (``attr`` may be dotted) with the current directory on sys.path."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected module:Class, got {target!r}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise CommandError(
                f"cannot import {module_name!r}: no module named {missing!r}"
            ) from exc
        raise CommandError(f"importing {module_name!r} failed: {_one_line(exc)}") from exc
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CommandError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def service_of(target: str, *, instantiate: bool) -> tuple[tensorrpc.ServiceSpec, object]:
    """A service class's (or factory's) spec and an instance (the class itself when not
    ``instantiate``; a factory is always called)."""
    obj = load_target(target)
    if isinstance(obj, type):
        try:
            spec = tensorrpc.describe(obj)
        except tensorrpc.ServiceDefinitionError as exc:
            raise CommandError(f"{target}: {exc}") from exc
        if not instantiate:
            return spec, obj
        try:
            return spec, obj()
        except Exception as exc:
            raise CommandError(
                f"{target}: creating an instance with no arguments failed: {_one_line(exc)}"
            ) from exc
    if not callable(obj):
        raise CommandError(f"{target} is a {type(obj).__name__}, not a @service class or a factory")
    try:
        instance = obj()
    except Exception as exc:
        raise CommandError(f"{target}(): {_one_line(exc)}") from exc
    try:
        spec = tensorrpc.describe(instance)
    except tensorrpc.ServiceDefinitionError:
        raise CommandError(
            f"{target}() returned a {type(instance).__name__}, not an instance of a @service class"
        ) from None
    return spec, instance


# ------------------------------------------------------------------------- describe


def describe_dict(spec: tensorrpc.ServiceSpec) -> dict[str, Any]:
    """The JSON form of ``tensorrpc describe --json``.

    Each parameter and result has its canonical ``type`` text (what the fingerprint
    hashes) and a JSON ``schema``; records (dataclasses and the like) are defined once in
    the top-level ``$defs`` and referenced from there.
    """
    annotations: list[object] = []
    for m in spec.methods.values():
        annotations += [f.type for f in dataclasses.fields(m.request_type)]
        annotations.append(dataclasses.fields(m.response_type)[0].type)
    schemas, defs = json_schemas(annotations)
    next_schema = iter(schemas)
    methods = []
    for m in spec.methods.values():
        params = []
        for name, tp in zip(m.params, m.param_types, strict=True):
            param = {"name": name, "type": tp.description, "schema": next(next_schema)}
            if name in m.defaults:
                param["default"] = to_json(m.defaults[name])
            params.append(param)
        methods.append(
            {
                "name": m.name,
                "signature": m.signature,
                "params": params,
                "returns": m.result_type.description,
                "returns_schema": next(next_schema),
                "streaming": m.streaming,
                "async": m.is_async,
                "request_type": m.request_type.__name__,
                "response_type": m.response_type.__name__,
            }
        )
    return {
        "service": spec.name,
        "fingerprint": spec.fingerprint,
        "methods": methods,
        "$defs": defs,
    }


def describe_text(spec: tensorrpc.ServiceSpec) -> str:
    """The text form of ``tensorrpc describe``."""
    lines = [f"service {spec.name}", f"fingerprint {spec.fingerprint}"]
    lines.append(f"methods ({len(spec.methods)}):")
    for m in spec.methods.values():
        params = []
        for name, tp in zip(m.params, m.param_types, strict=True):
            text = f"{name}: {tp.description}"
            if name in m.defaults:
                text += f" = {json.dumps(to_json(m.defaults[name]))}"
            params.append(text)
        kind = "stream" if m.streaming else "unary"
        handler = "async" if m.is_async else "sync (runs in a thread)"
        lines += [
            "",
            f"  {m.signature}",
            f"      {kind}, {handler}",
            f"      request  {m.request_type.__name__}({', '.join(params)})",
            f"      response {m.response_type.__name__}(value: {m.result_type.description})"
            + (" per item" if m.streaming else ""),
        ]
    return "\n".join(lines)


def _cmd_describe(args: argparse.Namespace) -> int:
    if args.target.startswith(_SCHEMES):  # a running engine: what its HELLO says
        args.list, args.method, args.engine, args.bind, args.health = True, None, None, False, False
        return _call_command(args, normalize_address(args.target), {})
    spec, _ = service_of(args.target, instantiate=False)
    if args.json:
        print(json.dumps(describe_dict(spec), indent=2))
    else:
        print(describe_text(spec))
    return 0


# ---------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    connect = [normalize_address(a) for a in args.connect] if args.connect else None
    bind = normalize_address(args.bind) if args.bind else None
    curve = _curve(args, listening=bind is not None)
    spec, instance = service_of(args.target, instantiate=True)
    provider = None
    if args.tracing:
        try:
            provider = _cli_ops.configure_tracing(spec.name)
        except _cli_ops.OptionError as exc:
            raise CommandError(str(exc)) from None

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            server = await tg.start(_serve, instance, connect, bind, args, curve)
            where = (
                f"listening on {server.endpoint}"
                if bind
                else f"dialling {', '.join(connect or ())}"
            )
            logger.info(
                "engine %r serves %s (%d methods), %s; stop with Ctrl-C or SIGTERM",
                *(server.engine_id, spec.name, len(spec.methods), where),
            )
            if args.metrics_port is not None:
                from tensorrpc import metrics

                logger.info("metrics on http://127.0.0.1:%s/metrics", metrics.bound_port(server))
            if provider is not None:
                logger.info("tracing calls (OTEL_TRACES_EXPORTER, default otlp)")
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    logger.info("%s: draining", signal.Signals(signum).name)
                    break
            tg.cancel_scope.cancel()

    try:
        _run(run)
    # ImportError: --metrics-port without prometheus_client.
    except (tensorrpc.ConnectError, ImportError) as exc:
        raise CommandError(f"cannot serve: {_one_line(exc)}") from exc
    finally:
        if provider is not None:
            provider.shutdown()  # flush the spans still batched
    logger.info("stopped")
    return 0


async def _serve(
    instance: object,
    connect: list[str] | None,
    bind: str | None,
    args: argparse.Namespace,
    curve: tensorrpc.CurveConfig | None,
    *,
    task_status: anyio.abc.TaskStatus[tensorrpc.Server] = anyio.TASK_STATUS_IGNORED,
) -> None:
    observer = None
    if args.metrics_port is not None:
        from tensorrpc import metrics  # the optional extra: ImportError without it

        observer = metrics.exporter(args.metrics_port)
    await tensorrpc.serve(
        instance,
        connect=connect,
        bind=bind,
        engine_id=args.engine_id,
        max_concurrency=args.workers,
        sync_workers=args.sync_workers,
        grace_period=args.grace_period,
        curve=curve,
        observer=observer,
        task_status=task_status,
    )


# ----------------------------------------------------------------------------- call


def parse_value(text: str) -> object:
    """A ``--arg`` value: JSON when it parses, else the text itself (``@FILE.npy`` aside)."""
    if text.startswith("@"):
        return _load_npy(text[1:])
    try:
        value: object = json.loads(text)
    except ValueError:
        return text
    return value


def parse_args(items: Sequence[str], data: str | None = None) -> dict[str, object]:
    """``NAME=VALUE`` items and the ``-d`` text (see `parse_data`) as one argument map."""
    out: dict[str, object] = parse_data(data) if data is not None else {}
    from_data = set(out)
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"bad argument {item!r}: expected NAME=VALUE")
        if not _ARG_NAME.match(name):
            raise UsageError(f"bad argument {item!r}: {name!r} is not a parameter name")
        if name in out:
            where = " (also in -d)" if name in from_data else ""
            raise UsageError(f"argument {name} given twice{where}")
        out[name] = parse_value(text)
    return out


def parse_data(data: str) -> dict[str, object]:
    """The ``-d`` argument map: a JSON object given inline, as ``@FILE``, or ``@-`` (stdin)."""
    # How errors name the argument: "-d", "-d from stdin" or "-d from 'args.json'".
    source = "-d"
    if data.startswith("@"):
        path = data[1:]
        where = "stdin" if path == "-" else repr(path)
        source = f"-d from {where}"
        try:
            data = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read -d {where}: {_one_line(exc)}") from exc
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise UsageError(f"{source} is not JSON: {_one_line(exc)}") from None
    if not isinstance(value, dict):
        kind = type(value).__name__ if value is not None else "null"
        raise UsageError(f"{source} must be a JSON object of arguments, not {kind}")
    for name in value:
        if not _ARG_NAME.match(name):
            raise UsageError(f"{source}: {name!r} is not a parameter name")
    return value


def _load_npy(path: str) -> object:
    import numpy as np

    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load {path!r} as a .npy array: {_one_line(exc)}") from exc


def to_json(value: object, max_values: int = DEFAULT_MAX_VALUES) -> Any:
    """A JSON-able view of a decoded value; tensors and arrays are summarized.

    A tensor or array becomes ``{"tensor": {"dtype", "shape", "numel", "values"}}`` with
    the first ``max_values`` elements (flattened); bytes become ``{"bytes": base64}``;
    dataclasses and mappings become objects; Enums their value.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return to_json(value.value, max_values)
    # A value is a tensor (an array) only if torch (numpy) is imported: a result without
    # one does not import them (seconds of start-up).
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1)[:max_values]
        if flat.dtype.is_floating_point:  # bfloat16, float16 ... print as float64
            flat = flat.to(torch.float64)
        try:
            values = flat.cpu().tolist()
        except (RuntimeError, TypeError):  # exotic dtypes (float8, bits)
            values = None
    elif np is not None and isinstance(value, np.ndarray):
        values = value.reshape(-1)[:max_values].tolist()
    else:
        values = ()
    if values != ():
        dtype = str(value.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
        shape, numel = list(value.shape), math.prod(value.shape)  # type: ignore[attr-defined]
        return {"tensor": {"dtype": dtype, "shape": shape, "numel": numel, "values": values}}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": base64.b64encode(bytes(value)).decode()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_json(getattr(value, f.name), max_values) for f in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {str(k): to_json(v, max_values) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v, max_values) for v in value]
    return repr(value)


def _render(value: object, *, as_json: bool, max_values: int) -> str:
    if isinstance(value, str) and not as_json:
        return peer_text(value, None, lines=True)  # the engine's text: no escape sequences
    return json.dumps(to_json(value, max_values))


def split_signature(signature: str) -> dict[str, str]:
    """Parameter name -> type text, from ``name(a: int, b: list[int] = 1) -> T``."""
    start = signature.find("(")
    if start < 0:
        return {}
    depth = 0
    params: list[str] = []
    current: list[str] = []
    for ch in signature[start + 1 :]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            params.append("".join(current))
            current = []
            continue
        current.append(ch)
    params.append("".join(current))
    out: dict[str, str] = {}
    for text in params:
        name, sep, rest = text.partition(":")
        if sep:
            out[name.strip()] = rest.split(" = ", 1)[0].strip()
    return out


def _tensors_for(arguments: dict[str, object], types: Mapping[str, str]) -> dict[str, object]:
    """Arrays loaded from .npy files become torch tensors unless the parameter is an ndarray."""
    if "numpy" not in sys.modules:  # no argument came from a .npy file
        return arguments
    import numpy as np
    import torch

    out: dict[str, object] = {}
    for name, value in arguments.items():
        tp = types.get(name, "")
        if isinstance(value, np.ndarray) and not ("ndarray" in tp and "Tensor" not in tp):
            value = torch.from_numpy(value)
        out[name] = value
    return out


def _engine_text(info: tensorrpc.EngineInfo) -> str:
    return (
        f"engine {info.engine_id}: service {info.service}, fingerprint "
        f"{info.fingerprint[:16]}, pid {info.pid}, protocol {info.protocol_version}"
    )


async def _call(args: argparse.Namespace, address: str, arguments: dict[str, object]) -> int:
    where = {"bind": address} if args.bind else {"connect": address}
    deadline = anyio.current_time() + args.timeout
    async with tensorrpc.Client.dynamic(**where, curve=args.curve) as client:
        info = await _pick_engine(client, args, address, deadline)
        if args.health:
            left = max(0.001, deadline - anyio.current_time())
            status = await client.health(info.engine_id, service=args.service, timeout=left)
            serving = status is tensorrpc.HealthStatus.SERVING
            if args.json:
                print(json.dumps({**_engine_json(info), "status": status.value}, indent=2))
            elif serving:
                print(f"ok: {_engine_text(info)}")
            else:
                what = f"service {args.service}" if args.service else "the engine"
                raise CommandError(f"{what} is {status.value}: {_engine_text(info)}")
            return 0 if serving else 1
        if args.list:
            _print_methods(info, as_json=args.json)
            return 0
        method = args.method
        if method not in info.methods:
            raise CommandError(
                f"unknown method {method!r}; the engine offers: {', '.join(info.methods)}"
            )
        if method in info.request_streaming:
            raise CommandError(f"{method} takes a stream of requests; call it from Python")
        # the engine's HELLO says each method's types and which methods stream
        types = split_signature(info.signatures[info.methods.index(method)])
        streaming = method in info.streaming
        view = client.with_options(
            engine=info.engine_id, timeout=max(0.001, deadline - anyio.current_time())
        )
        arguments = _tensors_for(arguments, types)
        if streaming:
            async with view.stream_by_name(method, arguments) as stream:
                async for item in stream:
                    print(_render(item, as_json=args.json, max_values=args.max_values), flush=True)
        else:
            result = await view.call_by_name(method, arguments)
            print(_render(result, as_json=args.json, max_values=args.max_values))
    return 0


async def _pick_engine(
    client: tensorrpc.Client[Any], args: argparse.Namespace, address: str, deadline: float
) -> tensorrpc.EngineInfo:
    """The engine to call: ``--engine`` once it joins (until ``deadline``), else the first."""
    try:
        engines = await client.wait_for_engines(1, timeout=args.timeout)
    except tensorrpc.EnginesUnavailableError as exc:
        verb = "dialled in at" if args.bind else "answered at"
        text = f"no engine {verb} {address} within {args.timeout:g} s"
        if exc.rejected:
            text += "; refused: " + "; ".join(f"{k}: {v}" for k, v in exc.rejected.items())
        raise CommandError(text) from None
    if args.engine is None:
        return engines[sorted(engines)[0]]
    if args.engine not in engines:
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            while args.engine not in client.engines:
                engines = await client.wait_for_engines(len(client.engines) + 1)
        if args.engine not in client.engines:
            raise CommandError(
                f"engine {args.engine!r} is not connected; live engines: "
                + ", ".join(sorted(client.engines))
            )
    return client.engines[args.engine]


def _engine_json(info: tensorrpc.EngineInfo) -> dict[str, Any]:
    keys = ("engine_id", "service", "fingerprint", "pid", "protocol_version")
    return {k: getattr(info, k) for k in keys}


def _print_methods(info: tensorrpc.EngineInfo, *, as_json: bool) -> None:
    if as_json:
        methods = [
            {"name": name, "signature": sig, "streaming": name in info.streaming}
            for name, sig in zip(info.methods, info.signatures, strict=True)
        ]
        print(json.dumps({**_engine_json(info), "methods": methods}, indent=2))
        return
    print(_engine_text(info))
    for sig in info.signatures:
        print(f"  {sig}")


def _cmd_call(args: argparse.Namespace) -> int:
    address = normalize_address(args.address)
    if not args.list and not args.method:
        raise UsageError("give a METHOD to call, or --list")
    if args.list and (args.args or args.items or args.data is not None):
        raise UsageError("--list takes no arguments")
    arguments = parse_args([*args.items, *args.args], args.data)
    return _call_command(args, address, arguments)


def _cmd_health(args: argparse.Namespace) -> int:
    return _call_command(args, normalize_address(args.address), {})


def _curve(args: argparse.Namespace, *, listening: bool) -> tensorrpc.CurveConfig | None:
    """The CURVE flags as a configuration; key files that cannot be used: one line."""
    try:
        return _cli_ops.curve_config(args, listening=listening)
    except _cli_ops.OptionError as exc:
        raise UsageError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot use the CURVE keys: {_one_line(exc)}") from exc


def _call_command(args: argparse.Namespace, address: str, arguments: dict[str, object]) -> int:
    """Run `_call` (call, health, describe ADDR) and turn its errors into one line."""
    args.curve = _curve(args, listening=args.bind)
    try:
        return _run(_call, args, address, arguments)
    except tensorrpc.ConnectError as exc:
        raise CommandError(f"cannot use {address}: {_one_line(exc)}") from exc
    except tensorrpc.CallTimeoutError:
        what = "the health check" if args.health else args.method or "describe"
        raise CommandError(f"{what} did not finish within {args.timeout:g} s") from None
    except (tensorrpc.MethodNotFoundError, tensorrpc.InvalidArgumentError) as exc:
        raise CommandError(_one_line(exc)) from None
    except tensorrpc.RemoteError as exc:
        raise CommandError(f"the handler raised {_one_line(exc)}") from exc
    except tensorrpc.TensorRPCError as exc:
        raise CommandError(f"{type(exc).__name__}: {_one_line(exc)}") from exc
    except TypeError as exc:  # a streaming method called as unary or the reverse
        raise CommandError(_one_line(exc)) from exc


# ----------------------------------------------------------------------- bench, demo


def _repo_root(module: str) -> Path | None:
    """The checkout holding ``module`` (a package or ``pkg.mod``): cwd or tensorrpc's parent."""
    relative = Path(*module.split("."))
    for root in (Path.cwd(), Path(tensorrpc.__file__).resolve().parent.parent):
        if (root / relative / "__main__.py").is_file():
            return root
        if (root / relative.with_suffix(".py")).is_file():
            return root
    return None


def _cmd_run_module(args: argparse.Namespace) -> int:
    module: str = args.module
    root = _repo_root(module)
    if root is None:
        raise CommandError(
            f"{module!r} is not available: 'tensorrpc {args.command}' needs the repository "
            "checkout (run it from the checkout, or install tensorrpc from one)"
        )
    extra = list(args.extra)
    extra = extra[1:] if extra[:1] == ["--"] else extra
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", module, *extra], cwd=root)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The child got the same SIGINT (same process group) and stops on its own.
        with contextlib.suppress(KeyboardInterrupt):
            proc.wait()
        return 130


# ----------------------------------------------------------------------------- main


def _run(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """``anyio.run``, re-raising the one error inside nested exception groups as itself."""
    try:
        return anyio.run(fn, *args)
    except BaseExceptionGroup as group:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        if exc is group:
            raise
        raise exc from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    first = text.splitlines()[0]
    return first if len(first) <= 500 else first[:497] + "..."


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _cmd_serve,
    "describe": _cmd_describe,
    "call": _cmd_call,
    "health": _cmd_health,
    "top": _cmd_top,
    "bench": _cmd_run_module,
    "demo": _cmd_run_module,
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, parsed; a usage error exits (SystemExit) after one line on stderr."""
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "call" and args.method is None and extra[:1] != ["--"]:
        # argparse leaves an optional positional after options unparsed:
        # `tensorrpc call ADDR --timeout 5 add` names the method last.
        for i, item in enumerate(extra):
            if not item.startswith("-") and "=" not in item:  # not NAME=VALUE
                args.method = extra.pop(i)
                break
    if args.command == "call" and extra[:1] != ["--"]:
        # Likewise NAME=VALUE arguments that follow an option: `call ADDR add --json a=1`.
        args.items += [item for item in extra if not item.startswith("-")]
        extra = [item for item in extra if item.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tensorrpc`` command on ``argv`` (default ``sys.argv[1:]``); the exit status."""
    try:
        args = _parse(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        _cli_ops.apply_environment(args)
    except _cli_ops.OptionError as exc:
        print(f"tensorrpc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    level = getattr(args, "log_level", "warning")
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    prog = f"tensorrpc {args.command}"
    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"{prog}: error: {exc} (see {prog} --help)", file=sys.stderr)
        return 2
    except CommandError as exc:
        if level == "debug" and exc.__cause__ is not None:
            logger.debug("caused by", exc_info=exc.__cause__)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except tensorrpc.TensorRPCError as exc:
        if level == "debug":
            logger.debug("failed", exc_info=exc)
        print(f"{prog}: error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (``| head``): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1


if __name__ == "__main__":  # python -m tensorrpc.cli
    sys.exit(main())
