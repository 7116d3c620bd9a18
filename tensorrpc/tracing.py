"""OpenTelemetry traces across tensorrpc calls (the ``otel`` extra; docs/observability.md).

```python
# sketch: configure an OpenTelemetry SDK as usual, then
import tensorrpc.tracing

tensorrpc.tracing.instrument()  # every Client and Server created from now on
```

or pass ``observer=tensorrpc.tracing.TracingObserver()`` to the ones you want. A client
call is a CLIENT span whose context travels in the CALL; the engine runs the handler in a
SERVER span, its child; each batch of a batched method is an INTERNAL span linked to its
items' calls. With the API alone (no SDK, no ``tracer_provider``) no span is made."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import context as otel_context, trace as otel_trace
    from opentelemetry.trace import (
        Link,
        NonRecordingSpan,
        ProxyTracerProvider,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tensorrpc.tracing needs opentelemetry-api: pip install 'tensorrpc[otel]'"
    ) from exc

from tensorrpc import _observe
from tensorrpc._observe import CallObservation, Observer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = [
    "TracingObserver",
    "decode_trace_context",
    "encode_trace_context",
    "instrument",
    "uninstrument",
]

_NO_OUTCOME_ERROR = frozenset({"ok", "cancelled"})
_PROXY = ProxyTracerProvider


def encode_trace_context(span_context: SpanContext) -> bytes:
    """The 26-byte binary W3C ``traceparent`` of a span context (docs/protocol.md §3)."""
    return (
        b"\x00"
        + span_context.trace_id.to_bytes(16, "big")
        + span_context.span_id.to_bytes(8, "big")
        + bytes([int(span_context.trace_flags) & 0xFF])
    )


def decode_trace_context(data: bytes) -> SpanContext | None:
    """The remote span context of a CALL's trace context, or None if it is not valid."""
    if len(data) != 26 or data[0] != 0:
        return None
    span_context = SpanContext(
        trace_id=int.from_bytes(data[1:17], "big"),
        span_id=int.from_bytes(data[17:25], "big"),
        is_remote=True,
        trace_flags=TraceFlags(data[25]),
    )
    return span_context if span_context.is_valid else None


class _Span(CallObservation):
    """A call's (or a batch's) span: counts stream items, ends with the outcome."""

    __slots__ = ("_items", "_span")

    def __init__(self, span: Span) -> None:
        self._span = span
        self._items = 0

    def item(self) -> None:
        self._items += 1

    def finished(self, outcome: str, nbytes: int) -> None:
        span = self._span
        if self._items:
            span.set_attribute("tensorrpc.stream_items", self._items)
        span.set_attribute("tensorrpc.outcome", outcome)
        if outcome not in _NO_OUTCOME_ERROR:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


class _ClientSpan(_Span):
    __slots__ = ()

    def trace_context(self) -> bytes:
        return encode_trace_context(self._span.get_span_context())

    def finished(self, outcome: str, nbytes: int) -> None:
        self._span.set_attribute("tensorrpc.response_bytes", nbytes)
        super().finished(outcome, nbytes)


class _EngineSpan(_Span):
    __slots__ = ("_code", "_token")

    def __init__(self, span: Span) -> None:
        super().__init__(span)
        self._token: object = None
        self._code = ""

    def started(self) -> None:
        # In the worker task that runs the handler: its calls become children.
        self._span.add_event("handler.start")
        self._token = otel_context.attach(otel_trace.set_span_in_context(self._span))

    def error(self, code: str) -> None:
        self._code = code

    def finished(self, outcome: str, nbytes: int) -> None:
        token, self._token = self._token, None
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
        super().finished(self._code or outcome, nbytes)


def _current_trace() -> bytes:
    """The binary trace context of the current span (``b""`` for none)."""
    context = otel_trace.get_current_span().get_span_context()
    return encode_trace_context(context) if context.is_valid else b""


class TracingObserver(Observer):
    """An [`Observer`][tensorrpc.Observer] that makes OpenTelemetry spans of calls.

    Args:
        tracer_provider: Where spans go (default: the global provider, as configured by
            your OpenTelemetry SDK setup).
    """

    __slots__ = ("_provider", "_tracer")

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self._provider = tracer_provider
        self._tracer: Tracer = otel_trace.get_tracer("tensorrpc", tracer_provider=tracer_provider)

    def _idle(self) -> bool:
        # No SDK configured (the global provider is still the API's proxy) and none given:
        # every span would be a no-op, so make none and send no context (one type test).
        return self._provider is None and type(otel_trace.get_tracer_provider()) is _PROXY

    def client_call(
        self, service: str, method: str, engine: str, stream: bool, nbytes: int, transport: str
    ) -> CallObservation | None:
        if self._idle():
            return None
        span = self._span(
            service, method, engine, SpanKind.CLIENT,
            {"tensorrpc.transport": transport, "tensorrpc.request_bytes": nbytes,
             "tensorrpc.stream": stream},
        )  # fmt: skip
        if not span.get_span_context().is_valid:
            return None
        return _ClientSpan(span)

    def engine_call(
        self,
        service: str,
        method: str,
        engine: str,
        client: str,
        stream: bool,
        trace: bytes,
        nbytes: int,
    ) -> CallObservation | None:
        if self._idle():
            return None
        parent = decode_trace_context(trace) if trace else None
        ctx: Any = None
        if parent is not None:
            ctx = otel_trace.set_span_in_context(NonRecordingSpan(parent), otel_context.Context())
        span = self._span(
            service, method, engine, SpanKind.SERVER,
            {"tensorrpc.client_id": client, "tensorrpc.request_bytes": nbytes,
             "tensorrpc.stream": stream},
            context=ctx,
        )  # fmt: skip
        return _EngineSpan(span)

    def engine_batch(
        self, service: str, method: str, engine: str, size: int, items: Sequence[bytes]
    ) -> CallObservation | None:
        if self._idle():
            return None
        contexts = (decode_trace_context(data) for data in items if data)
        links = [Link(context) for context in contexts if context is not None]
        span = self._span(
            service, method, engine, SpanKind.INTERNAL, {"tensorrpc.batch_size": size},
            context=otel_context.Context(), links=links, suffix=" batch",
        )  # fmt: skip
        return _Span(span)

    def _span(
        self,
        service: str,
        method: str,
        engine: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        *,
        suffix: str = "",
        **options: Any,
    ) -> Span:
        """Start a span ``Service/method`` with the RPC attributes and ``attributes``."""
        common = {"rpc.system": "tensorrpc", "rpc.service": service, "rpc.method": method}
        return self._tracer.start_span(
            f"{service}/{method}{suffix}",
            kind=kind,
            attributes={**common, "tensorrpc.engine_id": engine, **attributes},
            **options,
        )


_instrumented: TracingObserver | None = None


def instrument(tracer_provider: TracerProvider | None = None) -> TracingObserver:
    """Trace every [`Client`][tensorrpc.Client] and [`Server`][tensorrpc.Server] created
    from now on (idempotent: a second call returns the first observer); spans go to
    ``tracer_provider`` (default: the global provider). Returns the installed observer
    (also usable as ``observer=`` of peers made earlier)."""
    global _instrumented
    if _instrumented is None:
        _instrumented = TracingObserver(tracer_provider)
        _observe.install(_instrumented)
    return _instrumented


def uninstrument() -> None:
    """Stop tracing clients and engines created from now on."""
    global _instrumented
    if _instrumented is not None:
        _observe.uninstall(_instrumented)
        _instrumented = None


# Batched methods read the current call's span context through this (see _observe).
_observe.current_trace = _current_trace
