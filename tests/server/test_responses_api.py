"""POST /v1/responses and GET /v1/responses/{id} through the official `openai` client on the embedded
SmolLM2: text and message input, instructions, streaming with its typed events, forced function calls,
json_schema text format, reasoning items, previous_response_id over the bounded store, output logprobs,
vLLM's sampling extras, reasoning.effort in the template, and every other field of OpenAI's and vLLM's
request models echoed or refused by name."""
from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import msgspec
import openai
import pytest
from corectl.server.http.responses_protocol import LIMITED_FIELDS, REFUSED_FIELDS, ResponsesRequest
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from support.server import API_KEY, SMALL_ENGINE, ServerProcess

pytest_plugins = ["support.server_a_fixtures"]  # tools_server

GREEDY = dict(temperature=0, max_output_tokens=4)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": SCHEMA}


@pytest.fixture(scope="module")
def client(server):
    """The shared server (tests/server/conftest.py): its store holds two responses, so eviction shows
    after a third."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_text(client):
    """What chat completions answer for a prompt, greedy: a Responses turn must say the same."""
    model = client.models.list().data[0].id

    def answer(messages, max_tokens=4):
        out = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
        return out.choices[0].message.content
    return answer


def test_text_input_and_instructions_match_chat(client, chat_text):
    response = client.responses.create(input="Name a color.",
                                       instructions="Answer in one word.", **GREEDY)
    expected = chat_text([{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "Name a color."}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == expected
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 4
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"


def test_message_list_input(client, chat_text):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]}]
    response = client.responses.create(input=messages, **GREEDY)
    flat = messages[:2] + [{"role": "user", "content": "Count to three."}]
    assert response.output_text == chat_text(flat)


def test_max_output_tokens_makes_it_and_its_message_incomplete(client):
    response = client.responses.create(input="Tell me a long story.", temperature=0,
                                       max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2
    assert [item.status for item in response.output] == ["incomplete"]
    events = list(client.responses.create(input="Tell me a long story.", temperature=0, max_output_tokens=2,
                                          stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    done = next(e for e in events if e.type == "response.output_item.done")
    assert added.item.status == "in_progress" and done.item.status == "incomplete"
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"


def test_stream_events_in_order(client):
    whole = client.responses.create(input="Name a fruit.", **GREEDY)
    events = list(client.responses.create(input="Name a fruit.", stream=True, **GREEDY))
    types = [event.type for event in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = next(event for event in events if event.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {final.output[0].id}


def test_required_function_call_streamed(client):
    events = list(client.responses.create(input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False, temperature=0,
                                          max_output_tokens=30, stream=True))
    final = events[-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == "".join(e.arguments for e in done) == "".join(call.arguments for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMA)


def test_forced_function_call_and_its_output(client):
    first = client.responses.create(input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=24)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    follow = client.responses.create(previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], **GREEDY)
    assert follow.output_text and follow.previous_response_id == first.id


def test_json_schema_text_format(client):
    response = client.responses.create(
        input="Give a city as JSON.", temperature=0, max_output_tokens=24,
        text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_previous_response_id_renders_the_history(client, chat_text):
    first = client.responses.create(input="My name is Ada.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                     **GREEDY)
    # The instructions are not carried over; the earlier turn and its answer are.
    assert second.output_text == chat_text([{"role": "user", "content": "My name is Ada."},
                                            {"role": "assistant", "content": first.output_text},
                                            {"role": "user", "content": "What is my name?"}])
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_store_false_unknown_and_evicted_ids_are_clear_errors(client):
    unstored = client.responses.create(input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="no stored response") as err:
        client.responses.create(input="Again", previous_response_id=unstored.id, **GREEDY)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    kept = [client.responses.create(input=f"Say {n}", temperature=0, max_output_tokens=1).id for n in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept[0])  # the store holds two
    assert client.responses.retrieve(kept[2]).id == kept[2]


def test_bad_input_is_a_400_and_the_server_stays_up(server, client):
    bad = [({"input": [{"type": "input_image", "role": "user"}]}, "input"),
           ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
           ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
           ({"input": "x", "tool_choice": "required"}, "tool_choice"),
           ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format")]
    for body, param in bad:
        r = httpx.post(server.url + "/v1/responses", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert client.responses.create(input="Hi", **GREEDY).output_text


def test_store_disabled_refuses_previous_response_id(tools_server):
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # deepseek_r1 reads the output as reasoning until </think>, which SmolLM2 never writes.
    response = client.responses.create(input="Hi", **GREEDY)
    [item] = response.output
    assert item.type == "reasoning" and item.content[0].text
    # Reasoning cut at max_output_tokens, with nothing after it, is the incomplete item.
    assert item.status == ("incomplete" if response.status == "incomplete" else "completed")
    events = list(client.responses.create(input="Hi", stream=True, **GREEDY))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == item.content[0].text == events[-1].response.output[0].content[0].text
    assert events[-1].response.output[0].status == item.status
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(input="Hi", previous_response_id=response.id)


# -- every field of OpenAI's and vLLM's request models -----------------------------------------------

# vLLM's ResponsesRequest (vllm/entrypoints/openai/responses/protocol.py), as data.
VLLM_FIELDS = [
    "background", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
    "logit_bias", "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier", "store",
    "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "top_k", "truncation", "user",
    "skip_special_tokens", "include_stop_str_in_output", "prompt_cache_key", "request_id", "mm_processor_kwargs",
    "priority", "cache_salt", "enable_response_messages", "previous_input_messages", "previous_response",
    "structured_outputs", "repetition_penalty", "seed", "stop", "ignore_eos", "vllm_xargs",
]
# A value each refused field (REFUSED_FIELDS, LIMITED_FIELDS: dotted names are nested) is refused at.
REFUSED_VALUES = {
    "background": True, "background_options": {"completion_window": "2h"}, "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"}, "previous_response": {"id": "resp_1"}, "previous_input_messages": [{}],
    "enable_response_messages": True, "mm_processor_kwargs": {"do_resize": False},
    "context_management": [{"type": "compaction"}], "prompt_cache_options": {"mode": "explicit"},
    "access_programs": {"cyber": "standard"}, "image": {"detail": "low"}, "moderation": {"model": "m"},
    "service_tier": "flex", "truncation": "auto", "prompt_cache_retention": "24h", "reasoning.summary": "detailed",
    "reasoning.generate_summary": "concise", "reasoning.context": "all_turns", "text.verbosity": "low",
    "stream_options.include_obfuscation": True,
}


def _nested(name: str, value) -> dict:
    outer, _, inner = name.partition(".")
    return {outer: {inner: value} if inner else value}


def test_every_field_of_openais_and_vllms_request_is_declared():
    """msgspec drops undeclared fields: each of the SDK's create() fields and vLLM's must be declared,
    so it is honoured or refused, never dropped."""
    declared = {field.encode_name for field in msgspec.structs.fields(ResponsesRequest)}
    assert (set(ResponseCreateParamsBase.__annotations__) | {"stream"} | set(VLLM_FIELDS)) - declared == set()
    assert set(REFUSED_VALUES) == set(REFUSED_FIELDS) | set(LIMITED_FIELDS)


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_refused_field_is_a_400_naming_it(server, name):
    body = {"input": "hi", "max_output_tokens": 1, "stream": name.startswith("stream_options"),
            **_nested(name, REFUSED_VALUES[name])}
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


@pytest.mark.parametrize("body,param", [
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without include message.output_text.logprobs
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # without stream
    ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ({"reasoning": {"effort": "xhigh"}}, "reasoning.effort"),
])
def test_settings_it_cannot_honour_are_400s(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_fields_that_change_nothing_here_are_echoed(client):
    response = client.responses.create(
        input="Hi", **GREEDY, service_tier="default", truncation="disabled", max_tool_calls=2,
        prompt_cache_key="tenant-7", safety_identifier="user-7", prompt_cache_retention="in_memory",
        background=False, reasoning={"summary": "auto"}, text={"verbosity": "medium"})
    assert (response.service_tier, response.truncation, response.max_tool_calls, response.background) == (
        "default", "disabled", 2, False)
    assert (response.prompt_cache_key, response.safety_identifier, response.prompt_cache_retention) == (
        "tenant-7", "user-7", "in_memory")
    assert response.reasoning.summary == "auto" and response.text.verbosity == "medium"
    events = list(client.responses.create(input="Hi", **GREEDY, stream=True,
                                          stream_options={"include_obfuscation": False}))
    assert events[-1].response.output_text == response.output_text


def test_output_text_logprobs_match_chat(client, model_id):
    """include message.output_text.logprobs with top_logprobs: chat's logprobs of the same turn, in
    OpenAI's shape, whole and streamed (each delta with its tokens')."""
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Name a color."}],
                                          temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    expected = [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
                for t in chat.choices[0].logprobs.content]
    asked = dict(input="Name a color.", include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY)
    response = client.responses.create(**asked)
    logprobs = response.output[0].content[0].logprobs
    assert response.top_logprobs == 2 and len(logprobs) == response.usage.output_tokens == len(expected)
    for got, (token, logprob, top) in zip(logprobs, expected):
        assert got.token == token and got.bytes == list(token.encode()) and got.logprob == pytest.approx(logprob)
        assert [t.token for t in got.top_logprobs] == [t for t, _ in top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp for _, lp in top])
    events = list(client.responses.create(stream=True, **asked))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0].logprobs
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs] == [lp.token for lp in final] == [
        t for t, _, _ in expected]


def _chat_text(client, model_id, prompt: str, temperature: float, extras: dict) -> str:
    out = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=8, temperature=temperature, extra_body=extras)
    return out.choices[0].message.content


def test_vllm_sampling_extras_reach_the_sampler(client, model_id, server):
    """Each vLLM extra changes chat's output here, and the Responses turn with it equals that chat."""
    prompt = "Count from one to ten."
    plain = _chat_text(client, model_id, prompt, 0, {})
    token = httpx.post(server.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False},
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"][0]
    cases = [(0, {}, {"logit_bias": {str(token): 100}}), (0, {}, {"stop": [plain[3:6]]}),
             (0, {"stop": [plain[3:6]]}, {"include_stop_str_in_output": True}),
             (2.0, {"seed": 5}, {"top_k": 1}), (0, {}, {"repetition_penalty": 5.0})]
    for temperature, base, extra in cases:
        expected = _chat_text(client, model_id, prompt, temperature, {**base, **extra})
        assert expected != _chat_text(client, model_id, prompt, temperature, base), extra  # it has an effect
        answer = client.responses.create(input=prompt, max_output_tokens=8, temperature=temperature,
                                         extra_body={**base, **extra})
        assert answer.output_text == expected, extra


def test_cache_salt_and_request_id(client, server):
    prompt = "Describe the sea in three careful words. " * 4
    client.responses.create(input=prompt, **GREEDY)
    assert client.responses.create(input=prompt, **GREEDY).usage.input_tokens_details.cached_tokens > 0
    salted = client.responses.create(input=prompt, **GREEDY, extra_body={"cache_salt": uuid.uuid4().hex})
    assert salted.usage.input_tokens_details.cached_tokens == 0
    rid = f"mine-{uuid.uuid4().hex}"
    r = httpx.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 1, "request_id": rid},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.json()["id"] == f"resp_{rid}" and r.headers["x-request-id"] == rid


# A template that writes the reasoning effort into the prompt, so its token count shows it arrived.
EFFORT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                   "{% if reasoning_effort %}[EFFORT {{ reasoning_effort }} effort effort effort]{% endif %}")


@pytest.fixture(scope="module")
def effort_client(tmp_path_factory):
    template = tmp_path_factory.mktemp("effort") / "effort.jinja"
    template.write_text(EFFORT_TEMPLATE)
    proc = ServerProcess(*SMALL_ENGINE, "--chat-template", str(template), "--engine-in-process").wait_ready()
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert proc.stop() == 0


def test_reasoning_effort_reaches_the_chat_template(effort_client):
    model = effort_client.models.list().data[0].id
    chat = effort_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=1, reasoning_effort="high")
    plain = effort_client.responses.create(input="hi", max_output_tokens=1)
    high = effort_client.responses.create(input="hi", max_output_tokens=1, reasoning={"effort": "high"})
    assert high.usage.input_tokens == chat.usage.prompt_tokens > plain.usage.input_tokens
    assert high.reasoning.effort == "high"
