"""The requests an adversarial probe of `corectl serve` found (issue 8): each is a 4xx in OpenAI's shape
before any work is done for it, and the server goes on serving."""
from __future__ import annotations

import json

import httpx
import pytest
from support.openai_errors import expect_error

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
JSON = {"content-type": "application/json"}
BODY_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def _still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    out = http.post("/v1/completions", json={"prompt": "Still", "max_tokens": 1})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 1


@pytest.fixture(scope="module")
def keyless(keyless_server):
    with httpx.Client(base_url=keyless_server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("n", [1_000_000, 2 ** 40, 2 ** 70, 129, 0, -1])
def test_n_is_bounded(http, n):
    expect_error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "n": n, "temperature": 1}),
                 400, "n")


def test_choices_over_all_prompts_are_bounded(http):
    expect_error(http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 100, "max_tokens": 1}),
                 400, "prompt")
    out = http.post("/v1/completions", json={"prompt": "Hello", "n": 128, "max_tokens": 1, "temperature": 1})
    assert out.status_code == 200 and sorted(c["index"] for c in out.json()["choices"]) == list(range(128))
    _still_serving(http)


@pytest.mark.parametrize("field", ["seed", "top_k", "min_tokens", "max_tokens", "priority"])
@pytest.mark.parametrize("value", [2 ** 70, -(2 ** 70)])
def test_integers_the_engine_cannot_hold_are_400(http, field, value):
    expect_error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, field: value}), 400, field)


@pytest.mark.parametrize("seed", [2 ** 63 - 1, -(2 ** 63)])
def test_seeds_at_the_int64_limits_work(http, seed):
    """The second sample's seed is seed + 1, past int64 at the top: it still travels to the engine."""
    body = {"prompt": "Hello", "max_tokens": 2, "n": 2, "temperature": 1, "seed": seed}
    first, again = http.post("/v1/completions", json=body), http.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in again.json()["choices"]]


@pytest.mark.parametrize("body, param", [
    ({"stop": ["x" * 100_000]}, "stop[0]"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop": [str(i) for i in range(65)]}, "stop"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {"5": float("1e300")}}, "logit_bias"),
])
def test_client_sized_fields_are_bounded(http, body, param):
    expect_error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, **body}), 400, param)
    expect_error(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **body}), 400, param)


def test_message_and_token_lists_are_bounded(http):
    expect_error(http.post("/v1/chat/completions", json={"messages": CHAT * 4097, "max_tokens": 1}), 400, "messages")
    expect_error(http.post("/tokenize", json={"messages": CHAT * 4097}), 400, "messages")
    expect_error(http.post("/tokenize", json={"messages": []}), 400, "messages")  # found by test_fuzz: was a 500
    expect_error(http.post("/detokenize", json={"tokens": [1] * (2 ** 20 + 1)}), 400, "tokens")


def test_the_longest_stop_lists_still_cut_the_text(http):
    """64 stop strings of 1,024 characters (the bounds) next to one that matches."""
    full = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10, "temperature": 0}).json()
    text = full["choices"][0]["message"]["content"]
    stops = ["Paris"] + [f"{i:04d}" + "x" * 1020 for i in range(63)]
    cut = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10, "temperature": 0, "stop": stops})
    choice = cut.json()["choices"][0]
    assert choice["message"]["content"] == text[:text.index("Paris")] and choice["stop_reason"] == "Paris"


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xff\xfe", "messages": [], "tokens": []}',
    b'{"prompt": "\xed\xa0\x80"}',
    b"[" * 100_000,
    b'{"tools": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}",
    b'{"prompt": "a", "temperature": NaN}',
    b'{"prompt": "a", "temperature": Infinity}',
    b'{"prompt": "a", "temperature": 1e400}',
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "a\\udc00b"}',
    b'{"prompt": "a"',
    b"null",
], ids=["utf8", "encoded-surrogate", "deep-array", "deep-object", "nan", "infinity", "overflow", "high-surrogate",
        "low-surrogate", "truncated", "null"])
def test_malformed_bodies_are_400(http, route, raw):
    expect_error(http.post(route, content=raw, headers=JSON), 400)


def test_server_serves_after_malformed_bodies(http):
    _still_serving(http)


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx", None])
def test_only_json_bodies_are_read(keyless, route, content_type):
    """What a web page can send to any origin without a CORS preflight is refused, body unread."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "tokens": [1]})
    headers = {"content-type": content_type} if content_type else {}
    expect_error(keyless.post(route, content=body, headers=headers), 415, code="unsupported_media_type")


def test_json_with_parameters_is_json(keyless):
    body = json.dumps({"prompt": "Hello", "max_tokens": 1})
    out = keyless.post("/v1/completions", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert out.status_code == 200, out.text


def test_refused_requests_do_not_fill_the_queue(keyless):
    """Eight requests with numbers the wire cannot carry once left a server with --max-queued-requests 8
    answering 429 to everything."""
    for _ in range(8):
        expect_error(keyless.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "seed": 2 ** 70}),
                     400, "seed")
    _still_serving(keyless)
    assert keyless.get("/load").json()["num_requests_waiting"] == 0


def test_echo_with_max_tokens_zero_returns_the_prompt(http):
    prompt = "Hello, my name"
    n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    out = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == prompt and len(lp["token_logprobs"]) == n_prompt
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    one = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                                             "temperature": 0}).json()["choices"][0]["logprobs"]
    assert one["token_logprobs"][:n_prompt] == pytest.approx(lp["token_logprobs"])
    body = {"prompt": [prompt, "Hi"], "max_tokens": 0, "echo": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    texts = {c["index"]: c["text"] for chunk in chunks for c in chunk["choices"]}
    assert texts == {0: prompt, 1: "Hi"} and chunks[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_needs_echo(http):
    expect_error(http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 0}), 400, "max_tokens")
    expect_error(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 0}), 400, "max_tokens")
