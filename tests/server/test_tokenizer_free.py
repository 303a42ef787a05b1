"""Serving a model without a tokenizer (a shape preset on dummy weights): token-id prompts work, every
route or field that needs text answers a 400 naming the field, and `corectl bench serve` can load it."""
from __future__ import annotations

import json

import httpx
import pytest
from support.server import SMALL_ENGINE_FP32, ServerProcess
from support.server_a_cli import cli_runs

PROMPT = [5, 17, 42, 99, 3, 250]


@pytest.fixture(scope="module")
def tiny():
    proc = ServerProcess("llama-tiny", "--load-format", "dummy", *SMALL_ENGINE_FP32).wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def tiny_http(tiny):
    with httpx.Client(base_url=tiny.url, timeout=120) as client:
        yield client


def _complete(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, **fields})


def _stream_chunks(http: httpx.Client, **fields) -> list[dict]:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "stream": True, **fields}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_models_lists_the_preset(tiny_http):
    models = tiny_http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["llama-tiny"] and models[0]["max_model_len"] == 512


def test_token_id_prompt_completes_with_empty_text_in_openai_shape(tiny_http):
    body = _complete(tiny_http, ignore_eos=True, n=2).json()
    assert [c["text"] for c in body["choices"]] == ["", ""]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 10, "total_tokens": 16}
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]


def test_return_token_ids_carries_prompt_and_generated_ids(tiny_http):
    choice = _complete(tiny_http, ignore_eos=True, return_token_ids=True).json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT
    assert len(choice["token_ids"]) == 5 and all(0 <= t < 512 for t in choice["token_ids"])


def test_stream_sends_a_chunk_per_token_and_ids_on_request(tiny_http):
    whole = _complete(tiny_http, ignore_eos=True, return_token_ids=True).json()["choices"][0]
    # Without text, each new token still makes a chunk: clients can time the stream.
    plain = _stream_chunks(tiny_http)
    assert len(plain) >= 2 and all(c["choices"][0]["text"] == "" for c in plain)
    chunks = _stream_chunks(tiny_http, return_token_ids=True)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]


def test_prompt_logprobs_work_keyed_by_token_id(tiny_http):
    choice = _complete(tiny_http, prompt_logprobs=1).json()["choices"][0]
    positions = choice["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(PROMPT)
    assert str(PROMPT[1]) in positions[1]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hello"}, "prompt"),
    ("/v1/completions", {"prompt": ["Hello", "there"]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["\n"]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": "x", "stream": True}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}, "messages"),
    ("/tokenize", {"prompt": "Hello"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ("/detokenize", {"tokens": PROMPT}, "tokens"),
])
def test_text_fields_answer_400_naming_the_field(tiny_http, path, body, param):
    response = tiny_http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "runs without a tokenizer" in error["message"]


def test_the_server_keeps_serving_after_the_refusals(tiny_http):
    assert tiny_http.get("/health").status_code == 200
    assert _complete(tiny_http).status_code == 200


BENCH = ["bench", "serve", "--input-len", "20", "--output-len", "4", "--num-prompts", "4", "--ignore-eos"]
GENERATE = ["--model", "llama-tiny", "--load-format", "dummy", "--kv-cache-memory", "0.01", "--max-tokens", "3"]


@pytest.fixture(scope="module")
def cli(tiny, tmp_path_factory):
    """The module's command lines, run in one interpreter (one import of torch and corectl, not six)."""
    bench_result = tmp_path_factory.mktemp("bench") / "bench.json"
    bench = [*BENCH, "--base-url", tiny.url]
    runs = {
        "bench-ids": [*bench, "--prompt-token-ids", "--max-concurrency", "2", "--save-result", str(bench_result)],
        "bench-chat": [*bench, "--prompt-token-ids", "--endpoint", "/v1/chat/completions"],
        "bench-text": bench,
        "generate-ids": ["generate", "5,17,42", "--token-ids", *GENERATE],
        "generate-text": ["generate", "Hello", *GENERATE],
        "generate-chat": ["generate", "Hello", "--chat", *GENERATE],
    }
    return {**dict(zip(runs, cli_runs(*runs.values()))), "bench_result": bench_result}


def test_bench_serve_sends_token_id_prompts(cli):
    out = cli["bench-ids"]
    assert out.returncode == 0, out.stdout + out.stderr
    saved = json.loads(cli["bench_result"].read_text())
    assert saved["completed"] == 4 and saved["failed"] == 0
    assert saved["input_lens"] == [20] * 4 and saved["output_lens"] == [4] * 4
    assert saved["ttft_ms"]["mean"] > 0 and all(len(itl) >= 1 for itl in saved["itls"])


def test_bench_serve_token_ids_refuse_the_chat_endpoint(cli):
    out = cli["bench-chat"]
    assert out.returncode == 2 and "--prompt-token-ids needs /v1/completions" in out.stderr


def test_bench_serve_text_prompts_report_why_they_fail(cli):
    out = cli["bench-text"]
    assert out.returncode == 1 and "prompts must be lists of token ids" in out.stdout


def test_return_token_ids_alongside_text(http):
    """With a tokenizer, the ids come with the text and match the usage counts."""
    body = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0,
                                              "ignore_eos": True, "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == [1, 2, 3] and len(choice["token_ids"]) == 4 and choice["text"]


def test_generate_prints_token_ids_and_refuses_text_in_one_line(cli):
    out = cli["generate-ids"]
    assert out.returncode == 0, out.stderr
    ids = [int(t) for t in out.stdout.split()]
    assert 1 <= len(ids) <= 3 and all(0 <= t < 512 for t in ids)  # an end-of-sequence token may come early
    for out in (cli["generate-text"], cli["generate-chat"]):
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert out.stderr.startswith("corectl: error: prompt:") and "pass --token-ids" in out.stderr
