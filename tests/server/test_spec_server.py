"""`corectl serve --speculative-config` (n-gram lookup, k = 4) through the OpenAI SDK, against the same
server without speculation: the same greedy text, streams that join to it with several tokens a
delta, `max_tokens` ending inside a draft, sampling with `n`, seeds and logprobs, stop strings and a
JSON schema, and vLLM's `spec_decode_*` counters in /metrics."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from support.server import API_KEY, SMALL_ENGINE, running_server

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
# A passage the answer repeats: lookup finds drafts in nearly every step.
PASSAGE = "The quick brown fox jumps over the lazy dog near the old river bank. " * 4
REPEAT = [{"role": "user", "content": "Repeat this text exactly: " + PASSAGE}]


@pytest.fixture(scope="module")
def spec_server():
    with running_server(*SMALL_ENGINE, "--api-key", API_KEY, "--speculative-config", NGRAM) as proc:
        yield proc


@pytest.fixture(scope="module")
def plain_server():
    with running_server(*SMALL_ENGINE, "--api-key", API_KEY) as proc:
        yield proc


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def spec(spec_server):
    return _client(spec_server)


@pytest.fixture(scope="module")
def plain(plain_server):
    return _client(plain_server)


@pytest.fixture(scope="module")
def model(spec):
    return spec.models.list().data[0].id


def _counters(server) -> dict[str, float]:
    """vLLM's spec_decode_* counters of /metrics, the per-position one keyed by its position."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    found = {}
    for name, labels, value in re.findall(r"^vllm:(spec_decode_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        position = re.search(r'position="(\d+)"', labels)
        found[name + (f"[{position.group(1)}]" if position else "")] = float(value)
    return found


def test_greedy_text_is_the_same_as_without_speculation(spec_server, spec, plain, model):
    before = _counters(spec_server)
    for client_args in (dict(messages=REPEAT, max_tokens=48), dict(messages=[{"role": "user", "content": "Count: 1, 2, 3,"}],
                                                                   max_tokens=24)):
        with_spec = spec.chat.completions.create(model=model, temperature=0, **client_args)
        without = plain.chat.completions.create(model=model, temperature=0, **client_args)
        assert with_spec.choices[0].message.content == without.choices[0].message.content
        assert with_spec.usage.completion_tokens == without.usage.completion_tokens
    completion = dict(model=model, prompt=PASSAGE, max_tokens=40, temperature=0)
    assert spec.completions.create(**completion).choices[0].text == plain.completions.create(**completion).choices[0].text
    after = _counters(spec_server)
    assert after["spec_decode_num_accepted_tokens_total"] > before.get("spec_decode_num_accepted_tokens_total", 0)


def test_stream_joins_to_the_text_and_max_tokens_ends_inside_a_draft(spec, model):
    # 23 tokens: not a whole number of (k + 1)-token steps, so the last step's accepted draft is cut.
    args = dict(model=model, messages=REPEAT, max_tokens=23, temperature=0, extra_body={"ignore_eos": True})
    whole = spec.chat.completions.create(**args)
    assert whole.usage.completion_tokens == 23 and whole.choices[0].finish_reason == "length"
    chunks = list(spec.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    # Accepted drafts arrive together: fewer deltas than tokens.
    assert len(pieces) < 23
    assert chunks[-1].usage.completion_tokens == 23


def test_sampling_with_n_seed_and_logprobs(spec, model):
    args = dict(model=model, messages=REPEAT, max_tokens=20, temperature=0.8, n=2, seed=7, logprobs=True,
                top_logprobs=2, extra_body={"ignore_eos": True})
    first, again = spec.chat.completions.create(**args), spec.chat.completions.create(**args)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    for choice in first.choices:
        assert len(choice.logprobs.content) == 20
        assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in choice.logprobs.content)
    assert first.usage.completion_tokens == 40


def test_stop_strings_and_json_schema(spec, plain, model):
    stopped = spec.chat.completions.create(model=model, messages=REPEAT, max_tokens=60, temperature=0, stop=["lazy"])
    assert stopped.choices[0].finish_reason == "stop" and "lazy" not in stopped.choices[0].message.content
    reference = plain.chat.completions.create(model=model, messages=REPEAT, max_tokens=60, temperature=0, stop=["lazy"])
    assert stopped.choices[0].message.content == reference.choices[0].message.content
    schema = {"type": "object", "properties": {"animal": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["animal", "count"], "additionalProperties": False}
    answer = spec.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe the fox as JSON. " + PASSAGE}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "fox", "schema": schema}})
    parsed = json.loads(answer.choices[0].message.content)
    assert set(parsed) == {"animal", "count"} and isinstance(parsed["count"], int)


def test_metrics_count_drafts_and_acceptance_by_position(spec_server, spec, model):
    spec.chat.completions.create(model=model, messages=REPEAT, max_tokens=30, temperature=0)
    counters = _counters(spec_server)
    drafts, proposed = counters["spec_decode_num_drafts_total"], counters["spec_decode_num_draft_tokens_total"]
    accepted = counters["spec_decode_num_accepted_tokens_total"]
    assert 0 < drafts <= proposed <= 4 * drafts
    assert 0 < accepted <= proposed
    by_position = [counters[f"spec_decode_num_accepted_tokens_per_pos_total[{p}]"] for p in range(4)]
    # A draft token is accepted only after every one before it: acceptance never rises with position.
    assert by_position == sorted(by_position, reverse=True) and sum(by_position) == accepted
