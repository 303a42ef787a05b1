"""OpenTelemetry tracing: one span per request with vLLM's attribute names, parented on the caller's
`traceparent`; exported over OTLP by `corectl serve --otlp-traces-endpoint`; a clear error without
the `corectl[otel]` extra."""
from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading

import httpx
import pytest
from corectl.config import EngineConfig
from corectl.errors import ConfigError
from corectl.server.cli import serve as cli_serve
from corectl.server.http.app import create_app
from corectl.server.http.state import ServerState, ServeSettings
from corectl.server.http.tracing import RequestTracer
from litestar.testing import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.server import SMALL_ENGINE, ServerProcess

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
MODEL = "smol"


@pytest.fixture(scope="module")
def traced():
    """(test client, span exporter) of an in-process app whose tracer keeps spans in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = EngineConfig(max_model_len=512, kv_cache_memory_gib=0.05, dtype="float32")
    server = ServerState(ServeSettings(engine=engine, served_model_names=[MODEL], engine_in_process=True))
    server.tracer = RequestTracer(provider)
    with TestClient(create_app(server), timeout=120) as client:
        yield client, exporter


@pytest.fixture(scope="module")
def traced_pooling():
    """The same for the default model served as a pooling model (/v1/embeddings)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = EngineConfig(max_model_len=512, kv_cache_memory_gib=0.05, dtype="float32", runner="pooling")
    server = ServerState(ServeSettings(engine=engine, served_model_names=[MODEL], engine_in_process=True))
    server.tracer = RequestTracer(provider)
    with TestClient(create_app(server), timeout=120) as client:
        yield client, exporter


def _only_span(exporter: InMemorySpanExporter):
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.attributes for s in spans]
    return spans[0]


def test_a_request_becomes_one_span_under_the_callers_trace(traced):
    client, exporter = traced
    exporter.clear()
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
            "ignore_eos": True}
    response = client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200, response.text
    out = response.json()
    span = _only_span(exporter)
    assert span.name == "llm_request" and span.kind.name == "SERVER"
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == PARENT_SPAN_ID
    attrs = span.attributes
    assert attrs["gen_ai.request.id"] == out["id"]
    assert attrs["gen_ai.response.model"] == MODEL
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"], attrs["gen_ai.request.top_p"],
            attrs["gen_ai.request.n"]) == (5, 0.5, 0.9, 1)
    assert attrs["gen_ai.usage.prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == out["usage"]["completion_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    queue, ttft, e2e = (attrs[f"gen_ai.latency.{name}"] for name in ("time_in_queue", "time_to_first_token", "e2e"))
    assert 0 <= queue <= ttft <= e2e
    assert attrs["gen_ai.latency.time_in_model_decode"] <= attrs["gen_ai.latency.time_in_model_inference"]
    assert span.end_time - span.start_time == pytest.approx(e2e * 1e9, abs=1e6)


def test_an_embedding_input_becomes_one_span_with_no_sampling_attributes(traced_pooling):
    client, exporter = traced_pooling
    exporter.clear()
    response = client.post("/v1/embeddings", json={"model": MODEL, "input": "The sky is blue"},
                           headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200, response.text
    span = _only_span(exporter)
    assert span.name == "llm_request" and f"{span.parent.span_id:016x}" == PARENT_SPAN_ID
    attrs = span.attributes
    assert attrs["gen_ai.request.id"].startswith(response.json()["id"])
    assert attrs["gen_ai.usage.prompt_tokens"] == response.json()["usage"]["prompt_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",) and attrs["gen_ai.latency.e2e"] > 0
    assert not any(name.startswith("gen_ai.request.t") or name == "gen_ai.request.n" for name in attrs)


def test_a_streamed_request_with_several_samples_is_one_root_span(traced):
    client, exporter = traced
    exporter.clear()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1].removeprefix("data: "))["usage"]
    span = _only_span(exporter)
    assert span.parent is None
    assert span.attributes["gen_ai.request.n"] == 2
    assert span.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 8


def test_the_flag_exports_spans_over_otlp(monkeypatch):
    """`corectl serve --otlp-traces-endpoint` sends the span to a collector (here a bare HTTP one). The
    engine runs in the server's process (`--engine-in-process`), and this test also checks that flag:
    no engine child process, requests served, a clean stop (one server start for both)."""
    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    server = ServerProcess(*SMALL_ENGINE, "--engine-in-process", "--otlp-traces-endpoint", endpoint).wait_ready()
    try:
        with pytest.raises(LookupError):
            server.engine_pid()
        out = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True},
                         headers={"traceparent": TRACEPARENT}, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 2
    finally:
        assert server.stop() == 0  # shutdown flushes the batch
        collector.shutdown()
    spans = [span for body in received for resource in ExportTraceServiceRequest.FromString(body).resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    assert [s.name for s in spans] == ["llm_request"]
    assert spans[0].trace_id.hex() == TRACE_ID and spans[0].parent_span_id.hex() == PARENT_SPAN_ID
    attrs = {a.key: a.value for a in spans[0].attributes}
    assert attrs["gen_ai.request.id"].string_value == out["id"]
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 2


def test_the_flag_without_the_extra_is_a_clear_startup_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    parser = argparse.ArgumentParser()
    cli_serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    with pytest.raises(ConfigError, match=r"corectl\[otel\]"):
        cli_serve.settings_from_args(args)
