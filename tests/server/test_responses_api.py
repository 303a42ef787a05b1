"""POST /v1/responses and GET /v1/responses/{id} through the official `openai` client on the embedded
SmolLM2: text and message input, instructions, streaming with its typed events, forced function calls,
json_schema text format, reasoning items, previous_response_id over the bounded store."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from support.server import API_KEY

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


def test_max_output_tokens_makes_it_incomplete(client):
    response = client.responses.create(input="Tell me a long story.", temperature=0,
                                       max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


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
    events = list(client.responses.create(input="Hi", stream=True, **GREEDY))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == item.content[0].text == events[-1].response.output[0].content[0].text
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(input="Hi", previous_response_id=response.id)
