"""The OpenAI API through the official client and raw HTTP, against a real `corectl serve`."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.openai_errors import expect_error as _error
from support.server import API_KEY

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_served_model(http, model_id):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [model_id] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert body["data"][0]["max_model_len"] == 512


def test_models_retrieve_gives_one_card_or_a_404(openai_client, http, model_id):
    card = openai_client.models.retrieve(model_id)
    assert card.id == model_id and card.object == "model" and card.model_extra["max_model_len"] == 512
    for missing in ("nope", "org/nope"):
        with pytest.raises(openai.NotFoundError) as err:
            openai_client.models.retrieve(missing)
        assert err.value.body["code"] == "model_not_found" and missing in err.value.body["message"]


def test_chat_greedy_answer_streamed_equals_whole(openai_client, http, model_id):
    whole = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.model == model_id
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    stream = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    text, chunks = _stream_text(stream)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix-cache hit
    assert whole.usage.prompt_tokens == http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_completion_streamed_equals_whole_and_usage_is_exact(openai_client, http, model_id):
    prompt = "The three primary colors are"
    whole = openai_client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
    stream = openai_client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0,
                                              stream=True)
    text, chunks = _stream_text(stream)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert text == whole.choices[0].text and whole.choices[0].finish_reason == "length"
    prompt_ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 12
    by_ids = openai_client.completions.create(model=model_id, prompt=prompt_ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_n_and_several_prompts_index_choices(openai_client, model_id):
    out = openai_client.completions.create(model=model_id, prompt=["Red, green,", "One, two,"], n=2, max_tokens=4,
                                           temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text != out.choices[2].text == out.choices[3].text
    sampled = openai_client.chat.completions.create(model=model_id, messages=CHAT, n=3, max_tokens=8,
                                                    temperature=1.0, seed=3, logprobs=True)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert len({c.message.content for c in sampled.choices}) > 1
    # One logprob entry per generated token (an EOS token too, though it adds no text).
    assert sampled.usage.completion_tokens == sum(len(c.logprobs.content) for c in sampled.choices)


def test_completion_logprobs_shape_and_echo(openai_client, http, model_id):
    out = openai_client.completions.create(model=model_id, prompt="Hello, my name", max_tokens=5, temperature=0,
                                           logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    echoed = openai_client.completions.create(model=model_id, prompt="Hello, my name", max_tokens=5, temperature=0,
                                              logprobs=1, echo=True)
    choice = echoed.choices[0]
    assert choice.text == "Hello, my name" + out.choices[0].text
    n_prompt = http.post("/tokenize", json={"prompt": "Hello, my name"}).json()["count"]
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == n_prompt + 5
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs)
    assert choice.logprobs.text_offset[n_prompt] == len("Hello, my name")


def test_chat_logprobs_and_prompt_logprobs(openai_client, http, model_id):
    out = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    raw = http.post("/v1/completions", json={"prompt": "One two three", "max_tokens": 1, "prompt_logprobs": 1}).json()
    positions = raw["choices"][0]["prompt_logprobs"]
    prompt_ids = http.post("/tokenize", json={"prompt": "One two three"}).json()["tokens"]
    assert positions[0] is None and len(positions) == len(prompt_ids)
    for token, position in zip(prompt_ids[1:], positions[1:]):
        assert str(token) in position and set(position[str(token)]) == {"logprob", "rank", "decoded_token"}


def test_stops_and_vllm_extras(openai_client, model_id):
    full = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    cut = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0,
                                                stop=["Paris"])
    assert cut.choices[0].message.content == text[:text.index("Paris")]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == "Paris"
    kept = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0,
                                                 stop="Paris", extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content.endswith("Paris")
    longer = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0,
                                                   extra_body={"ignore_eos": True, "min_tokens": 24})
    assert longer.usage.completion_tokens == 24 and longer.choices[0].finish_reason == "length"
    topk = openai_client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=1.5,
                                                 seed=1, extra_body={"top_k": 1})
    assert topk.choices[0].message.content == text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "suffix": "!"}, "suffix"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "priority": 1}, "priority"),
])
def test_invalid_completion_fields_are_400_naming_the_field(http, body, param):
    _error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": "hello"}, "messages"),
])
def test_invalid_chat_fields_are_400(http, body, param):
    _error(http.post("/v1/chat/completions", json=body), 400, param)


def test_request_level_errors(http, server):
    _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 600}), 400, "max_tokens",
           "context_length_exceeded")
    _error(http.post("/v1/completions", json={"prompt": "hi " * 600}), 400, "prompt", "context_length_exceeded")
    _error(http.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"}), 404, "model", "model_not_found")
    _error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(http.post("/v1/completions", content=b"", headers={"content-type": "application/json"}), 400)
    _error(http.get("/v1/nothing-here"), 404, code="not_found")
    _error(http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (11 * 1024 * 1024) + b'"}',
                     headers={"content-type": "application/json"}), 413, code="request_too_large")
    assert http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_api_key_is_required_on_api_routes_only(server):
    with httpx.Client(base_url=server.url) as anonymous:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("GET", "/load")]:
            error = _error(anonymous.request(method, path, json={}), 401, code="invalid_api_key")
            assert error["type"] == "authentication_error"
        _error(anonymous.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        _error(anonymous.get("/v1/models", headers={"Authorization": API_KEY}), 401)
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/ping").status_code == 200 and anonymous.post("/ping").status_code == 200
        assert anonymous.get("/version").json()["version"]
        metrics = anonymous.get("/metrics")
        assert "vllm:num_requests_running" in metrics.text
        assert metrics.headers["content-type"] == "text/plain; version=1.0.0; charset=utf-8"
        assert anonymous.get("/docs/openapi.json").json()["paths"]["/v1/chat/completions"]
    from openai import OpenAI

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_tokenize_detokenize_round_trip(http):
    out = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 512
    assert out["token_strs"] == ["Hello", "Ġworld"]
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": "Hello world"}
    _error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    _error(http.post("/tokenize", json={}), 400)


def test_tokenize_counts_messages_as_chat_renders_them(http):
    """/tokenize with messages takes the chat route's template fields (vLLM's TokenizeChatRequest), so its
    count is the prompt_tokens of the same chat request."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    cases = [
        {"add_generation_prompt": False, "continue_final_message": True},
        {"chat_template": "X{{ messages[0].content }}X", "add_generation_prompt": False},
        {"chat_template": "{{ messages[0].content }}{% if flag %} flagged{% endif %}",
         "chat_template_kwargs": {"flag": True}},
        {"add_special_tokens": True, "chat_template": "{{ messages[0].content }}"},
    ]
    plain = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    for fields in cases:
        tokens = http.post("/tokenize", json={"messages": messages, **fields}).json()["tokens"]
        chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **fields}).json()
        assert tokens != plain and len(tokens) == chat["usage"]["prompt_tokens"], fields
    assert http.post("/tokenize", json={"messages": messages, "continue_final_message": True}).status_code == 400
    _error(http.post("/tokenize", json={"prompt": "hi", "chat_template": "x"}), 400, "chat_template")


def test_stream_is_framed_server_sent_events(http):
    """Streams are SSE frames: `data: {json}` then `data: [DONE]`."""
    with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in r.iter_lines() if line]
    assert frames[-1] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames)
    assert [json.loads(f[6:])["object"] for f in frames[:-1]] == ["text_completion"] * (len(frames) - 1)


@pytest.mark.parametrize("route, body", [("completions", {"prompt": "Once upon a time"}),
                                         ("chat.completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_continuous_usage_stats_need_include_usage(openai_client, model_id, route, body):
    """vLLM's `continuous_usage_stats` puts usage on every chunk only when `include_usage` asks for usage."""
    create = getattr(openai_client, route.split(".")[0])
    create = create.completions.create if route.startswith("chat") else create.create

    def chunks(**options):
        return list(create(model=model_id, max_tokens=3, stream=True, stream_options=options,
                           extra_body={"ignore_eos": True}, **body))

    assert all(chunk.usage is None for chunk in chunks(include_usage=False, continuous_usage_stats=True))
    both = chunks(include_usage=True, continuous_usage_stats=True)
    assert all(chunk.usage is not None for chunk in both[1:]) and both[-1].usage.completion_tokens == 3
