"""/v1/embeddings against real servers: the default model served as a pooling model, and the shared
generative server (which refuses embeddings, as the pooling one refuses text)."""
from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import torch
from support.openai_errors import expect_error
from support.server import API_KEY, ServerProcess

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEXTS = ["Paris is the capital of France.", "The sea is calm tonight.", "Spiders have eight legs."]


def _vectors(body: dict) -> list[np.ndarray]:
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [np.array(d["embedding"], dtype=np.float32) if isinstance(d["embedding"], list)
            else np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def test_embeddings_equal_transformers_last_token(pooling_http, hf_model):
    body = pooling_http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}).json()
    ids = [pooling_http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    for got, prompt_ids in zip(_vectors(body), ids):
        with torch.no_grad():
            last = hf_model(torch.tensor([prompt_ids])).last_hidden_state[0, -1]
        np.testing.assert_allclose(got, torch.nn.functional.normalize(last, dim=0).numpy(), atol=1e-5, rtol=1e-5)


def test_input_kinds_and_base64_agree(pooling_http):
    ids = [pooling_http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS[:2]]
    by_text = _vectors(pooling_http.post("/v1/embeddings", json={"input": TEXTS[0]}).json())
    by_ids = _vectors(pooling_http.post("/v1/embeddings", json={"input": ids[0]}).json())
    by_lists = _vectors(pooling_http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json())
    assert len(by_text) == len(by_ids) == 1 and len(by_lists) == 2
    np.testing.assert_allclose(by_text[0], by_ids[0], atol=1e-6)
    np.testing.assert_allclose(by_lists[0], by_ids[0], atol=1e-6)  # float JSON and float32 base64 agree
    assert abs(float(np.linalg.norm(by_lists[1])) - 1.0) < 1e-5


def test_openai_sdk_embeddings(pooling_server):
    from openai import OpenAI

    client = OpenAI(base_url=pooling_server.url + "/v1", api_key=API_KEY, max_retries=0)
    default = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert len(default.data) == 3 and default.usage.prompt_tokens == floats.usage.prompt_tokens > 0
    for a, b in zip(default.data, floats.data):
        assert len(a.embedding) == 576
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    short = client.embeddings.create(model=MODEL, input="Hello", dimensions=64, encoding_format="float")
    assert len(short.data[0].embedding) == 64


def test_dimensions_truncate_then_normalise(pooling_http):
    raw = _vectors(pooling_http.post("/v1/embeddings", json={"input": TEXTS[1], "normalize": False}).json())[0]
    short = _vectors(pooling_http.post("/v1/embeddings", json={"input": TEXTS[1], "dimensions": 32}).json())[0]
    np.testing.assert_allclose(short, raw[:32] / np.linalg.norm(raw[:32]), atol=1e-6)
    expect_error(pooling_http.post("/v1/embeddings", json={"input": "x", "dimensions": 577}), 400, "dimensions")
    expect_error(pooling_http.post("/v1/embeddings", json={"input": "x", "dimensions": 0}), 400, "dimensions")


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", 5]}, "input"),
    ({"input": [[1, 2], "a"]}, "input"),
    ({"input": [1, [2]]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": [1, -5]}, "input[1]"),
    ({"input": [1, 2 ** 40]}, "input[1]"),
    ({"input": [1, 49152]}, "input"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "dimensions": -3}, "dimensions"),
])
def test_bad_input_is_400_naming_the_field(pooling_http, body, param):
    expect_error(pooling_http.post("/v1/embeddings", json=body), 400, param)


def test_model_context_and_route_checks(pooling_http, http):
    expect_error(pooling_http.post("/v1/embeddings", json={"input": "a", "model": "gpt-4"}), 404, "model",
                 "model_not_found")
    error = expect_error(pooling_http.post("/v1/embeddings", json={"input": [7] * 513}), 400, "input",
                         "context_length_exceeded")
    assert "513" in error["message"] and "--embed-chunking" in error["message"]
    assert len(_vectors(pooling_http.post("/v1/embeddings", json={"input": [7] * 512}).json())[0]) == 576
    # A pooling model makes no text, a generative one no embeddings (vLLM answers both with 400).
    expect_error(pooling_http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 400, "model")
    expect_error(pooling_http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}),
                 400, "model")
    expect_error(http.post("/v1/embeddings", json={"input": "Hi"}), 400, "model")
    assert pooling_http.get("/health").status_code == 200
    assert "post" in pooling_http.get("/docs/openapi.json").json()["paths"]["/v1/embeddings"]


def _counter(text: str, name: str, **labels: str) -> float:
    """A counter's value in Prometheus text, the sample whose labels include `labels` and the model's."""
    wanted = {"model_name": MODEL, **labels}
    for match in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in wanted.items()):
            return float(match.group(2))
    return 0.0


def test_metrics_and_log_lines_cover_embeddings(pooling_server, pooling_http):
    before = pooling_http.get("/metrics").text
    body = pooling_http.post("/v1/embeddings", json={"input": TEXTS}).json()
    after = pooling_http.get("/metrics").text
    tokens = body["usage"]["prompt_tokens"]
    assert tokens > 0
    for name, labels, grew in [("vllm:prompt_tokens_total", {}, tokens),
                               ("vllm:request_success_total", {"finished_reason": "stop"}, 3),
                               ("vllm:request_prompt_tokens_count", {}, 3)]:
        assert _counter(after, name, **labels) - _counter(before, name, **labels) == grew, name
    request_id = body["id"]
    lines = [line for line in pooling_server.log().splitlines() if request_id in line and "request finished" in line]
    assert len(lines) == 3 and all('"prompt_tokens"' in line for line in lines)


def test_long_inputs_in_chunks():
    """With --embed-chunking an input past the context is split, each chunk pooled raw, and the chunk
    vectors averaged by token count before normalising (MEAN pooling: the mean of chunk-local hidden states).
    The server splits the input into ordinary pooling requests, so the engine runs in its process (the
    shared pooling server checks those requests across the process boundary)."""
    import httpx

    proc = ServerProcess("--max-model-len", "64", "--kv-cache-memory", "0.05", "--dtype", "float32", "--runner",
                         "pooling", "--pooling-type", "MEAN", "--embed-chunking", "--engine-in-process").wait_ready()
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            ids = list(range(100, 250))  # 150 tokens: chunks of 64, 64 and 22
            whole = _vectors(client.post("/v1/embeddings", json={"input": ids}).json())[0]
            chunks = [ids[:64], ids[64:128], ids[128:]]
            raw = _vectors(client.post("/v1/embeddings", json={"input": chunks, "normalize": False}).json())
            mean = sum(v * len(c) for v, c in zip(raw, chunks)) / len(ids)
            np.testing.assert_allclose(whole, mean / np.linalg.norm(mean), atol=1e-5)
            body = client.post("/v1/embeddings", json={"input": [ids, ids[:10]]}).json()
            assert body["usage"]["prompt_tokens"] == 160
            np.testing.assert_allclose(_vectors(body)[0], whole, atol=1e-6)
    finally:
        assert proc.stop() == 0


def test_invocations_with_an_input_embeds_as_the_embeddings_route(pooling_http):
    body = {"input": TEXTS[:2]}
    via_invocations = pooling_http.post("/invocations", json=body).json()
    direct = pooling_http.post("/v1/embeddings", json=body).json()
    assert via_invocations["object"] == "list"
    assert [d["embedding"] for d in via_invocations["data"]] == [d["embedding"] for d in direct["data"]]
