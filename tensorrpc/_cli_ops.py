"""What the ``tensorrpc`` command needs to run engines in production: flags and
``TENSORRPC_*`` environment variables for metrics, tracing and CURVE.

Each option has a flag and an environment variable (for containers); the flag wins. The
CURVE role follows the socket: the side that listens (``serve --bind``, ``call --bind``)
is the CURVE server and names the clients it allows; the side that dials is the CURVE
client and names the server's public key.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse
    from collections.abc import Mapping

    from tensorrpc._security import CurveConfig, CurveServerConfig

#: Flag destination -> the environment variable that sets it when the flag is absent.
ENVIRONMENT: Mapping[str, str] = {
    "metrics_port": "TENSORRPC_METRICS_PORT",
    "tracing": "TENSORRPC_TRACING",
    "curve_keypair": "TENSORRPC_CURVE_KEYPAIR",
    "curve_server_key": "TENSORRPC_CURVE_SERVER_KEY",
    "curve_allow": "TENSORRPC_CURVE_ALLOW",
    "curve_allow_any": "TENSORRPC_CURVE_ALLOW_ANY",
}

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


class OptionError(ValueError):
    """A flag or environment variable has a bad value (the CLI's usage error)."""


def add_curve_flags(parser: argparse.ArgumentParser, *, listens: bool) -> None:
    """The CURVE flags: our keypair, the server's key (dialling) and, for a command that can
    listen, the allow-list."""
    add = parser.add_argument
    ours = "CURVE: our secret key file, NAME.key_secret (env TENSORRPC_CURVE_KEYPAIR)"
    add("--curve-keypair", metavar="FILE", help=ours)
    theirs = (
        "CURVE, when dialling: the public key file of the side that listens "
        "(env TENSORRPC_CURVE_SERVER_KEY)"
    )
    add("--curve-server-key", metavar="FILE", help=theirs)
    if listens:
        allow = (
            "CURVE, when listening: a client's public key file, or a directory of *.key "
            "files, allowed to connect (repeat; env TENSORRPC_CURVE_ALLOW, paths separated "
            "by ':')"
        )
        add("--curve-allow", metavar="PATH", action="append", help=allow)
        anyone = (
            "CURVE, when listening: accept any client that knows our public key "
            "(env TENSORRPC_CURVE_ALLOW_ANY=1)"
        )
        add("--curve-allow-any", action="store_true", default=None, help=anyone)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``serve``'s metrics and tracing flags (CURVE: `add_curve_flags`)."""
    metrics = (
        "export Prometheus metrics on http://127.0.0.1:PORT/metrics (0: a free port; one "
        "port per engine process; env TENSORRPC_METRICS_PORT; needs the 'metrics' extra)"
    )
    parser.add_argument("--metrics-port", metavar="PORT", help=metrics)
    tracing = (
        "trace calls with OpenTelemetry; the standard OTEL_* variables configure the SDK "
        "(OTEL_TRACES_EXPORTER, default otlp; OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_SERVICE_NAME, "
        "default the service's name; OTEL_TRACES_SAMPLER) (env TENSORRPC_TRACING=1; needs "
        "opentelemetry-sdk)"
    )
    parser.add_argument("--tracing", action="store_true", default=None, help=tracing)


def apply_environment(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Fill each flag the command line left out from its ``TENSORRPC_*`` variable
    (`OptionError` for a malformed value)."""
    env = os.environ if environ is None else environ
    where = "--metrics-port"  # or the variable that gave it
    for dest, name in ENVIRONMENT.items():
        if not hasattr(args, dest) or getattr(args, dest) is not None:
            continue
        text = env.get(name)
        if text is None:
            continue
        if dest in ("tracing", "curve_allow_any"):
            setattr(args, dest, _flag(name, text))
        elif dest == "curve_allow":
            setattr(args, dest, [p for p in text.split(os.pathsep) if p] or None)
        elif text:
            setattr(args, dest, text)
            if dest == "metrics_port":
                where = name
    if getattr(args, "metrics_port", None) is not None:
        args.metrics_port = _port(args.metrics_port, where)


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise OptionError(f"{name}={text!r}: expected 1 or 0 (true/false)")


def _port(text: str, where: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise OptionError(f"{where} {text!r}: expected a TCP port (0..65535)")
    return port


def curve_config(args: argparse.Namespace, *, listening: bool) -> CurveConfig | None:
    """The CURVE configuration the flags ask for (``None``: plaintext); ``listening``: we
    are the CURVE server. `OptionError` for flags that do not fit the role; OSError or
    ValueError for a key file that cannot be used."""
    from tensorrpc._security import CurveClientConfig, load_keypair, load_public_key

    keypair_path = getattr(args, "curve_keypair", None)
    server_key = getattr(args, "curve_server_key", None)
    allow: list[str] = getattr(args, "curve_allow", None) or []
    allow_any = bool(getattr(args, "curve_allow_any", None))
    if keypair_path is None:
        if server_key or allow or allow_any:
            raise OptionError("CURVE needs our keypair too: give --curve-keypair FILE")
        return None
    if listening:
        if server_key:
            raise OptionError(
                "--curve-server-key is for the side that dials; this side listens, so it "
                "is the CURVE server: give --curve-allow PATH or --curve-allow-any"
            )
        if not allow and not allow_any:
            raise OptionError(
                "this side listens, so it is the CURVE server: give --curve-allow PATH "
                "(the clients' public keys) or --curve-allow-any"
            )
        return _server_config(keypair_path, allow, allow_any)
    if allow or allow_any:
        raise OptionError(
            "--curve-allow is for the side that listens; this side dials, so it is the "
            "CURVE client: give --curve-server-key FILE"
        )
    if not server_key:
        raise OptionError(
            "this side dials, so it is the CURVE client: give --curve-server-key FILE "
            "(the public key of the side that listens)"
        )
    return CurveClientConfig(load_keypair(keypair_path), load_public_key(server_key))


def _server_config(keypair_path: str, allow: list[str], allow_any: bool) -> CurveServerConfig:
    from tensorrpc._security import (
        CurveServerConfig,
        load_keypair,
        load_public_key,
        load_public_keys,
    )

    if allow and allow_any:
        raise OptionError("give --curve-allow or --curve-allow-any, not both")
    keypair = load_keypair(keypair_path)
    if allow_any:
        return CurveServerConfig(keypair, allowed_clients=None)
    keys: set[bytes] = set()
    for path in allow:
        if os.path.isdir(path):
            found = load_public_keys(path)
            if not found:
                raise OptionError(f"--curve-allow {path!r}: no *.key files in it")
            keys |= found
        else:
            keys.add(load_public_key(path))
    return CurveServerConfig(keypair, allowed_clients=keys)


def configure_tracing(service_name: str) -> Any:
    """Configure the OpenTelemetry SDK from the ``OTEL_*`` variables as its own tools do
    (docs/cli.md) and trace every call; the provider to ``shutdown()`` at exit, or None
    with ``OTEL_SDK_DISABLED=true``. `OptionError`: no SDK, or an unknown exporter."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    try:
        from importlib.metadata import entry_points

        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        import tensorrpc.tracing
    except ImportError as exc:
        raise OptionError(
            f"--tracing needs the OpenTelemetry SDK: pip install 'tensorrpc[otel]' "
            f"opentelemetry-sdk ({exc})"
        ) from None
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    names = [n for n in names if n and n != "none"]
    exporters = []
    for name in names:
        found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
        if not found:
            hint = " (pip install opentelemetry-exporter-otlp)" if name == "otlp" else ""
            raise OptionError(
                f"OTEL_TRACES_EXPORTER={name!r}: no such span exporter is installed{hint}; "
                "'console' ships with the SDK, 'none' exports nothing"
            )
        exporters.append(found[0].load()())
    attributes = {}
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = service_name
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    tensorrpc.tracing.instrument(provider)
    return provider
