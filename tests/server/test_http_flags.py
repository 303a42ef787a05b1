"""vLLM's HTTP-side launch flags against a real server: CORS credentials, methods and headers, no docs
page, request log lines clipped by --max-log-len with the outputs' text, and the flags vLLM scripts
pass that corectl already behaves by (access log off, request id headers, /load, V0's pinned values)."""
from __future__ import annotations

import json

import httpx
import pytest
from support.server import SMALL_ENGINE, running_server

ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server():
    with running_server(*SMALL_ENGINE, "--log-prompts", "--max-log-len", "6", "--enable-log-outputs",
                        "--disable-fastapi-docs", "--allowed-origins", ORIGIN, "--allow-credentials",
                        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["Content-Type"]',
                        "--disable-uvicorn-access-log", "--enable-request-id-headers",
                        "--enable-server-load-tracking", "--disable-cascade-attn", "--preemption-mode",
                        "recompute", "--num-scheduler-steps", "1", "--num-lookahead-slots", "0",
                        "--enable-tokenizer-info-endpoint") as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_no_docs_page_or_schema(http):
    assert http.get("/docs").status_code == 404
    assert http.get("/docs/openapi.json").status_code == 404
    assert http.get("/v1/models").status_code == 200


def test_cors_preflight_carries_the_credentials_methods_and_headers_asked(http):
    answer = http.options("/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert answer.status_code in (200, 204)
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    assert answer.headers["access-control-allow-credentials"] == "true"
    assert set(answer.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    refused = http.options("/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "PUT"})
    assert refused.status_code == 400


def test_request_log_lines_clip_prompts_and_outputs(server, http):
    body = http.post("/v1/completions", json={"prompt": "Hello there, how are you today?", "max_tokens": 8,
                                              "temperature": 0, "ignore_eos": True}).json()
    text = body["choices"][0]["text"]
    lines = [json.loads(line) for line in server.log().splitlines()
             if body["id"] in line and "request finished" in line]
    assert len(lines) == 1
    assert lines[0]["prompt"] == "Hello " and lines[0]["outputs"] == [text[:6]]
    assert http.get("/load").json()["server_load"] == 0


def test_tokenizer_info_describes_the_tokenizer_only_when_asked(http, keyless_server):
    info = http.get("/tokenizer_info")
    assert info.status_code == 200
    body = info.json()
    assert body["tokenizer_class"] and "<|im_start|>" in body["chat_template"] and body["eos_token"]
    off = httpx.get(keyless_server.url + "/tokenizer_info", timeout=60)
    assert off.status_code == 404 and "--enable-tokenizer-info-endpoint" in off.json()["error"]["message"]


def test_invocations_runs_each_api_by_its_body(http):
    """SageMaker's POST /invocations, as vLLM serves it: chat by `messages`, completions by `prompt`,
    streaming too; another body is a 400, and /ping answers beside it."""
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    text = http.post("/invocations", json={"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0})
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    same = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0})
    assert text.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]
    with http.stream("POST", "/invocations", json={"prompt": "Once", "max_tokens": 2, "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert "data: [DONE]" in stream.read().decode()
    for body, message in (({"max_tokens": 2}, "takes a chat completion"),
                          ({"prompt": "x", "max_tokens": "two"}, "invalid request body for completion")):
        refused = http.post("/invocations", json=body)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"], refused.text
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
