"""Hostile and careless grammars through the real server (issue 27, defects 1, 6 and 7): a grammar that
admits no string is a 400 naming the field (before any output, or as the stream's last event), never
a retryable 503; a deep schema is refused by its bounds and never holds the event loop."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from support.openai_errors import expect_error

LOOPING_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
# Not empty (it can be "b"), so it passes validation; a request pushed to write "a" is at a dead end.
DEAD_END_AFTER_A = 'root ::= "b" | "a" x\nx ::= x'


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for level in range(levels):
        schema = {"type": "object", "properties": {f"k{level}": schema}, "required": [f"k{level}"]}
    return schema


def token_of(http: httpx.Client, text: str) -> int:
    (token,) = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return token


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": r"[^\s\S]"}, "guided_regex"),
    ({"structured_outputs": {"regex": r"id-[^\s\S]"}}, "structured_outputs.regex"),
    ({"guided_json": LOOPING_REF}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": LOOPING_REF}}},
     "response_format"),
    ({"guided_grammar": 'root ::= x\nx ::= x "a"'}, "guided_grammar"),
])
def test_a_grammar_that_admits_no_string_is_a_400_naming_the_field(http, body, param):
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **body})
    error = expect_error(response, 400, param, "grammar_admits_no_string")
    assert "admits no string" in error["message"]


def test_a_mask_that_empties_is_a_400_before_output_and_an_error_event_when_streaming(http):
    a = token_of(http, "a")
    body = {"prompt": "Say something.", "max_tokens": 8, "temperature": 0, "logit_bias": {str(a): 100},
            "guided_grammar": DEAD_END_AFTER_A}
    error = expect_error(http.post("/v1/completions", json=body), 400, "guided_grammar")
    assert "admits no string that continues this output" in error["message"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200  # the first token ("a") is out before the dead end
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert set(last) == {"error"} and "admits no string that continues" in last["error"]["message"]
    assert last["error"]["type"] == "invalid_request_error"
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_the_official_client_does_not_retry_it(openai_client, model_id):
    import openai

    started = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="admits no string"):
        openai_client.with_options(max_retries=3).completions.create(
            model=model_id, prompt="Hi", max_tokens=4, extra_body={"guided_regex": r"[^\s\S]"})
    assert time.monotonic() - started < 5  # a retried 5xx would back off for seconds


def test_a_deep_schema_is_refused_by_its_nesting_bound(http):
    error = expect_error(http.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 4, "guided_json": deep_schema(300)}), 400, "guided_json")
    assert "levels deep; at most 64" in error["message"]
    as_text = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep_schema(40)}}})
    expect_error(as_text, 400, "response_format")
