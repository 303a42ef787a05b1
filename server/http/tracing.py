"""OpenTelemetry tracing (`corectl serve --otlp-traces-endpoint URL`): one span per engine request.

Spans carry vLLM's attribute names (`vllm/tracing.py`: the OpenTelemetry GenAI conventions plus
its own `gen_ai.latency.*`), so dashboards built for vLLM read them. A W3C `traceparent` header on
the HTTP request makes the span its child. The SDK and the OTLP exporter are the optional extra
`corectl[otel]`, imported only when tracing is on. The exporter's protocol comes from OpenTelemetry's
own `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (grpc by default, as in vLLM; or http/protobuf).
"""
from __future__ import annotations

import os
import time
from contextvars import ContextVar
from typing import Any

from corectl.errors import ConfigError
from corectl.outputs import RequestMetrics
from corectl.sampling_params import SamplingParams

INSTALL = "pip install 'corectl[otel]'"
SPAN_NAME = "llm_request"
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# The caller's trace context, set per HTTP request by the middleware; None: the span is a root.
_incoming: ContextVar[Any] = ContextVar("corectl_incoming_trace_context", default=None)


def exporter_class() -> type:
    """The OTLP span exporter for the configured protocol; a ConfigError saying what to install
    when the extra is missing (called before the server starts, so the flag fails at once)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        else:
            raise ConfigError("otlp_traces_endpoint", f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not "
                                                      "supported; use grpc or http/protobuf")
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError("otlp_traces_endpoint", f"tracing needs the OpenTelemetry SDK and OTLP exporter "
                                                  f"({exc.name} is not installed): {INSTALL}") from None
    return OTLPSpanExporter


class RequestTracer:
    """Turns each finished engine request into a span. One per server (`ServerState.tracer`)."""

    def __init__(self, provider):
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        self._provider = provider
        self._tracer = provider.get_tracer("corectl.server")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER

    @classmethod
    def export_to(cls, endpoint: str) -> RequestTracer:
        """Spans batched in the background and exported over OTLP to `endpoint`."""
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter_class()(endpoint=endpoint)))
        return cls(provider)

    def shutdown(self) -> None:
        """Export the spans still queued, then stop."""
        self._provider.shutdown()

    def middleware(self, app):
        """ASGI middleware: the request's W3C trace headers become the parent of its spans."""

        async def extract_trace_context(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS}
            token = _incoming.set(self._propagator.extract(carrier) if carrier else None)
            try:
                await app(scope, receive, send)
            finally:
                _incoming.reset(token)

        return extract_trace_context

    @staticmethod
    def parent():
        """The current HTTP request's incoming trace context (read when its generation starts)."""
        return _incoming.get()

    def emit(self, parent, request_id: str, model: str, params: SamplingParams | None, metrics: RequestMetrics,
             finish_reasons: list[str], now: float) -> None:
        """One span from the request's arrival to its end (`now` if it did not finish). `params` is
        None for an embedding request, which has no sampling settings to report."""
        # RequestMetrics are time.monotonic() readings, spans take epoch nanoseconds.
        offset_ns = time.time_ns() - time.monotonic_ns()
        attributes = _attributes(request_id, model, params, metrics, finish_reasons, now)
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._kind, attributes=attributes,
                                       start_time=int(metrics.arrival_time * 1e9) + offset_ns)
        span.end(end_time=int((metrics.finished_time or now) * 1e9) + offset_ns)


def _attributes(request_id: str, model: str, params: SamplingParams | None, metrics: RequestMetrics,
                finish_reasons: list[str], now: float) -> dict[str, Any]:
    arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
    first, last = metrics.first_token_time, metrics.last_token_time
    attributes: dict[str, Any] = {
        "gen_ai.response.model": model,
        "gen_ai.request.id": request_id,
        "gen_ai.usage.prompt_tokens": metrics.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": metrics.num_generation_tokens,
        "gen_ai.response.finish_reasons": finish_reasons,
        "gen_ai.latency.e2e": (metrics.finished_time or now) - arrival,
    }
    if params is not None:
        attributes.update({"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                           "gen_ai.request.n": params.n, "gen_ai.usage.num_sequences": params.n})
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
    if scheduled is not None:
        attributes["gen_ai.latency.time_in_queue"] = scheduled - arrival
    if first is not None:
        attributes["gen_ai.latency.time_to_first_token"] = first - arrival
    if scheduled is not None and first is not None:
        attributes["gen_ai.latency.time_in_model_prefill"] = first - scheduled
        attributes["gen_ai.latency.time_in_model_decode"] = last - first
        attributes["gen_ai.latency.time_in_model_inference"] = last - scheduled
    return attributes
