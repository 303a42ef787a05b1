"""Generated request bodies against a live server: every answer is a 2xx, or a 4xx in OpenAI's error
shape, never a 5xx; streams carry no server error; and the server answers a normal request afterwards.

Bodies mix plausible values with hostile ones (wrong types, huge and negative numbers, NaN/Infinity
literals, deep nesting, invalid UTF-8, lone surrogates, NUL, empty and oversized lists). Hypothesis is
derandomized and does not shrink, so a run is the same every time and bounded by `max_examples`;
every generated request asks for at most a few tokens.
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from support.openai_errors import openai_error

FUZZ = settings(derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))
JSON = {"content-type": "application/json"}

HUGE_INTS = [2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 31), -(2 ** 63) - 1, -(2 ** 70)]
ints = st.integers(-3, 8) | st.sampled_from(HUGE_INTS)
floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([-0.0, 1e308, -1e308, 5e-324, 100.0001])
# Any code point, lone surrogates and NUL included: json.dumps escapes them as \\uXXXX.
any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=12)
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=16)  # valid Unicode, NUL included
scalars = st.none() | st.booleans() | ints | floats | any_text
trees = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
                     max_leaves=12)
junk = trees | st.lists(ints, min_size=200, max_size=400) | st.just([]) | st.just({})
vocab_ids = st.lists(st.integers(0, 49_151), min_size=1, max_size=10)
token_ids = st.lists(st.integers(-2, 50_000) | st.sampled_from(HUGE_INTS), max_size=12)
role = st.sampled_from(["system", "developer", "user", "assistant"])
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2)
messages = st.lists(st.fixed_dictionaries({"role": role, "content": text | parts}), min_size=1, max_size=3)
bad_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["tool", "robot", ""]) | junk, "name": any_text,
    "content": any_text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text"]) | junk},
                                                        optional={"text": junk}), max_size=3)})

WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}}, "required": ["city"]}}}

# Each field: (a value the server accepts, hostile values). Every count a valid body can carry is small,
# so no accepted request generates more than a few dozen tokens.
SAMPLING = {
    "model": (st.just("SmolLM2-135M-Instruct.Q4_1"), st.sampled_from(["gpt-4", ""]) | any_text),
    "n": (st.integers(1, 2), st.sampled_from([0, -1, 129, 2 ** 40, 2 ** 70, 1.5, "2"])),
    "temperature": (st.floats(0, 2), floats), "top_p": (st.floats(0.05, 1), floats),
    "top_k": (st.integers(-1, 50), ints), "min_p": (st.floats(0, 1), floats),
    "presence_penalty": (st.floats(-2, 2), floats), "frequency_penalty": (st.floats(-2, 2), floats),
    "repetition_penalty": (st.floats(0.5, 2), floats),
    "stop": (text.filter(bool) | st.lists(text.filter(bool), max_size=3),
             any_text | st.lists(st.just("ab"), min_size=65, max_size=70) | st.just("x" * 1025)),
    "stop_token_ids": (st.lists(st.integers(0, 49_151), max_size=4), token_ids | st.lists(st.just(1), min_size=65)),
    "logit_bias": (st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=4),
                   st.dictionaries(st.integers(-5, 60_000).map(str) | any_text, floats | ints, max_size=4)),
    "seed": (st.integers(-(2 ** 63), 2 ** 63 - 1), ints), "min_tokens": (st.integers(0, 1), ints),
    "ignore_eos": (st.booleans(), junk), "skip_special_tokens": (st.booleans(), junk),
    "include_stop_str_in_output": (st.booleans(), junk), "priority": (st.just(0), ints),
    "stream": (st.booleans(), junk),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "prompt_logprobs": (st.integers(0, 3), ints), "user": (text, junk),
    # Output constraints: grammars the backend compiles (bad ones must be 400s, never a crash).
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
                         "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
                             "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}}}]),
                        st.fixed_dictionaries({"type": any_text}) | st.fixed_dictionaries(
                            {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": trees})})),
    "guided_json": (st.just({"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}),
                    trees | any_text),
    "guided_regex": (st.sampled_from(["[a-c]{1,3}", "(yes|no)"]), any_text),
    "guided_choice": (st.lists(text.filter(bool), min_size=1, max_size=3),
                      st.lists(any_text, max_size=3) | st.lists(st.just("c"), min_size=1025, max_size=1030)),
    "guided_grammar": (st.just('root ::= "ok" | "no"'), any_text),
    "structured_outputs": (st.sampled_from([{"choice": ["x", "y"]}, {"regex": "[0-9]{2}"}, {"json_object": True}]),
                           st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object",
                                                            "structural_tag"]), junk, max_size=2)),
}
COMPLETION = {
    **SAMPLING,
    "max_tokens": (st.integers(1, 3), st.sampled_from([0, -1, 2 ** 31, 2 ** 70, 1e10, 0.5, "many"])),
    "prompt": (text | st.lists(text, min_size=1, max_size=2) | vocab_ids | st.lists(vocab_ids, min_size=1, max_size=2),
               any_text | token_ids | st.lists(token_ids, max_size=3) | st.lists(text, min_size=129, max_size=140)),
    "echo": (st.booleans(), junk), "logprobs": (st.integers(0, 3), ints), "suffix": (st.none(), any_text),
    "best_of": (st.none(), ints), "return_token_ids": (st.booleans(), junk),
}
CHAT = {
    **SAMPLING,
    "max_completion_tokens": COMPLETION["max_tokens"], "max_tokens": COMPLETION["max_tokens"],
    "messages": (messages, st.lists(bad_message, max_size=3) | junk), "logprobs": (st.booleans(), junk),
    "top_logprobs": (st.integers(0, 3), ints), "add_generation_prompt": (st.booleans(), junk),
    "tools": (st.just([WEATHER_TOOL]), st.lists(trees, min_size=1, max_size=2)),
    "tool_choice": (st.sampled_from(["none", "required", {"type": "function", "function": {"name": "weather"}}]),
                    any_text | st.fixed_dictionaries({"type": st.just("function"),
                                                      "function": st.fixed_dictionaries({"name": any_text})})),
    "parallel_tool_calls": (st.booleans(), junk),
    "chat_template_kwargs": (st.just({"enable_thinking": False}), st.dictionaries(any_text, junk, max_size=3)),
}
TOKENIZE_OPTIONS = {
    "model": SAMPLING["model"], "add_special_tokens": (st.booleans(), junk),
    "add_generation_prompt": (st.booleans(), junk), "return_token_strs": (st.booleans(), junk),
}
DETOKENIZE = {"model": SAMPLING["model"], "tokens": (vocab_ids, token_ids | junk)}
EMBEDDINGS = {
    "model": SAMPLING["model"],
    "input": (text.filter(bool) | st.lists(text.filter(bool), min_size=1, max_size=3) | vocab_ids
              | st.lists(vocab_ids, min_size=1, max_size=2),
              any_text | token_ids | st.lists(token_ids, max_size=3) | st.lists(any_text, max_size=3)
              | st.just(["a"] * 2049) | st.just([[1], "a"])),
    "encoding_format": (st.sampled_from(["float", "base64"]), any_text),
    "dimensions": (st.integers(1, 576), ints | floats), "normalize": (st.booleans(), junk),
    "add_special_tokens": (st.booleans(), junk), "priority": (st.just(0), ints), "user": (text, junk),
}


LENGTHS = ("max_tokens", "max_completion_tokens")


@st.composite
def bodies(draw, fields: dict, required: tuple[str, ...]) -> object:
    """A body of valid fields (`required` and a few others) with up to two made hostile, or now and
    then something that is not an object at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(junk)
    names = sorted(fields)
    chosen = list(required) + draw(st.lists(st.sampled_from(names), unique=True, max_size=6))
    body = {name: draw(fields[name][0]) for name in chosen}
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=2)):
        hostile = fields[name][1] | junk
        # null would mean "the rest of the context": hundreds of tokens per example on a CPU.
        body[name] = draw(hostile.filter(lambda v: v is not None) if name in LENGTHS else hostile)
    return body


def check(http: httpx.Client, route: str, content: bytes) -> None:
    """Send one body; the answer must be a 2xx or an OpenAI-shaped 4xx, and a stream must end cleanly."""
    with http.stream("POST", route, content=content, headers=JSON) as response:
        if response.status_code != 200:
            response.read()
            assert 400 <= response.status_code < 500, (response.status_code, response.text, content[:300])
            openai_error(response)
            return
        if not response.headers["content-type"].startswith("text/event-stream"):
            response.read()
            assert isinstance(response.json(), dict)
            return
        frames = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]", content[:300]
    for frame in frames[:-1]:
        chunk = json.loads(frame)
        assert chunk.get("error", {}).get("type") != "server_error", (chunk, content[:300])


def encode(body) -> bytes:
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def unhandled(server):
    """Fails the module if the server logged an unhandled error (a 500) while it ran."""
    start = len(server.log())
    yield
    assert '"unhandled error' not in server.log()[start:]


@settings(FUZZ, max_examples=80)
@given(body=bodies(COMPLETION, ("prompt", "max_tokens")))
def test_completions(http, unhandled, body):
    check(http, "/v1/completions", encode(body))


@settings(FUZZ, max_examples=60)
@given(body=bodies(CHAT, ("messages", "max_completion_tokens")))
def test_chat_completions(http, unhandled, body):
    check(http, "/v1/chat/completions", encode(body))


@settings(FUZZ, max_examples=60)
@given(body=bodies({**TOKENIZE_OPTIONS, "prompt": (text, any_text | junk)}, ("prompt",))
       | bodies({**TOKENIZE_OPTIONS, "messages": CHAT["messages"]}, ("messages",)))
def test_tokenize(http, unhandled, body):
    check(http, "/tokenize", encode(body))


@settings(FUZZ, max_examples=60)
@given(body=bodies(DETOKENIZE, ("tokens",)))
def test_detokenize(http, unhandled, body):
    check(http, "/detokenize", encode(body))


@pytest.fixture(scope="module")
def pooling_unhandled(pooling_server):
    """Fails the module if the pooling server logged an unhandled error (a 500) while it ran."""
    start = len(pooling_server.log())
    yield
    assert '"unhandled error' not in pooling_server.log()[start:]


@settings(FUZZ, max_examples=60)
@given(body=bodies(EMBEDDINGS, ("input",)))
def test_embeddings(pooling_http, pooling_unhandled, body):
    check(pooling_http, "/v1/embeddings", encode(body))


def mutated(valid: bytes, data: st.DataObject) -> bytes:
    """A valid body made invalid at the byte level, the way a broken or hostile client would."""
    kind = data.draw(st.sampled_from(["byte", "literal", "nest", "cut", "raw-control"]))
    at = data.draw(st.integers(0, len(valid)))
    if kind == "byte":
        bad = data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]))
        return valid[:at] + bad + valid[at:]
    if kind == "literal":
        return valid.replace(b"1", data.draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999"])), 1)
    if kind == "nest":
        depth = data.draw(st.sampled_from([10, 1_000, 100_000]))
        return valid[:at] + b"[" * depth + b"1" + b"]" * depth + valid[at:]
    if kind == "cut":
        return valid[:at]
    return valid[:at] + data.draw(st.sampled_from([b"\x00", b"\n", b"\x1f"])) + valid[at:]


@settings(FUZZ, max_examples=100)
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), data=st.data())
def test_mutated_bytes(http, unhandled, route, data):
    valid = encode({"prompt": "Hello 1", "messages": [{"role": "user", "content": "Hi 1"}], "tokens": [1, 2],
                    "max_tokens": 1, "max_completion_tokens": 1, "stop": ["\\u0000"]})
    check(http, route, mutated(valid, data))


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_embeddings_mutated_bytes(pooling_http, pooling_unhandled, data):
    check(pooling_http, "/v1/embeddings", mutated(encode({"input": ["Hello 1", "Hi"], "dimensions": 16}), data))


def test_server_answers_after_fuzzing(http, unhandled):
    assert http.get("/health").status_code == 200
    out = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2


def test_pooling_server_answers_after_fuzzing(pooling_http, pooling_unhandled):
    out = pooling_http.post("/v1/embeddings", json={"input": ["Hi", "there"]})
    assert out.status_code == 200 and len(out.json()["data"]) == 2
