"""Structured outputs, tool calls and reasoning through the OpenAI API and the official `openai` SDK,
against a real `corectl serve` of the embedded SmolLM2 (its default 4-bit CPU path) with the ChatML tools
template of examples/, the hermes tool parser and the deepseek_r1 reasoning parser (under which an
unconstrained answer is all reasoning: the template would have opened <think>)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel, Field
from support.openai_errors import expect_error

pytest_plugins = ["support.server_a_fixtures"]  # tools_server
MODEL = "SmolLM2-135M-Instruct.Q4_1"

SCHEMAS = [
    ({"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "author": {"type": "object", "properties": {"last_name": {"type": "string", "maxLength": 16}},
                   "required": ["last_name"], "additionalProperties": False}},
        "required": ["title", "author"], "additionalProperties": False}},
      "required": ["book"], "additionalProperties": False}, "Describe a famous book and its author as JSON."),
    ({"type": "object", "properties": {"day": {"enum": ["monday", "friday", "sunday"]},
                                       "mood": {"type": "string", "enum": ["happy", "tired"]}},
      "required": ["day", "mood"], "additionalProperties": False}, "Which day is best, and how do you feel? JSON."),
    ({"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                                  "items": {"type": "string", "maxLength": 10}}},
      "required": ["colors"], "additionalProperties": False}, "Name the colors of a rainbow as JSON."),
    ({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5}},
      "required": ["age", "height_m"], "additionalProperties": False}, "Give a person's age and height as JSON."),
    ({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                       "country": {"type": "string", "maxLength": 20},
                                       "capital": {"type": "boolean"}},
      "required": ["city", "capital"], "additionalProperties": False}, "Name a city as JSON."),
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def client(tools_server):
    from openai import OpenAI

    return OpenAI(base_url=tools_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def raw(tools_server):
    import httpx

    with httpx.Client(base_url=tools_server.url, timeout=300) as http:
        yield http


def ask(client, question: str, **fields):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          temperature=0, max_tokens=fields.pop("max_tokens", 100), **fields)


def together(*calls):
    """Run the requests concurrently (the engine batches them) and return their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def test_json_schema_response_formats_validate(client):
    """Nested objects, enums, bounded arrays, number ranges and required fields."""
    outs = together(*[lambda schema=schema, question=question: ask(client, question, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        for schema, question in SCHEMAS])
    for (schema, _), out in zip(SCHEMAS, outs):
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


class Pet(BaseModel):
    name: str = Field(max_length=16)
    species: str = Field(pattern="^(cat|dog|parrot)$")
    age: int = Field(ge=0, le=30)


def test_sdk_parse_returns_the_pydantic_object(client):
    out = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}],
                                        temperature=0, max_tokens=80, response_format=Pet)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.species in ("cat", "dog", "parrot") and 0 <= pet.age <= 30


def test_every_constraint_field_holds_on_completions_and_chat(client):
    prompt = "Q: What is the capital of France?\nA:"
    fields = [
        ({"guided_regex": r" \d{3}-\d{4}"}, lambda t: re.fullmatch(r" \d{3}-\d{4}", t)),
        ({"guided_choice": ["Paris", "Lyon"]}, lambda t: t in ("Paris", "Lyon")),
        ({"guided_grammar": 'root ::= " It is " ("Paris" | "Rome") "."'}, lambda t: t in (" It is Paris.",
                                                                                      " It is Rome.")),
        ({"guided_json": SCHEMAS[1][0]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1][0]) is None),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["up", "down"], "disable_fallback": True,
                                 "disable_additional_properties": True}}, lambda t: t in ("up", "down")),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ]
    completions = together(*[lambda extra=extra: client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=60, extra_body=extra) for extra, _ in fields])
    chats = together(*[lambda extra=extra: ask(client, "Answer briefly: what is the capital of France?",
                                               max_tokens=60, extra_body=extra) for extra, _ in fields])
    for (extra, holds), completion, chat in zip(fields, completions, chats):
        assert holds(completion.choices[0].text), (extra, completion.choices[0].text)
        assert holds(chat.choices[0].message.content), (extra, chat.choices[0].message.content)


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("completions", {"guided_regex": "(abc"}, "guided_regex"),
    ("completions", {"guided_json": "{not json"}, "guided_json"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("completions", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": ["b"], "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("completions", {"structured_outputs": {"choice": ["b"], "no_such_key": 1}}, "structured_outputs"),
    ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("completions", {"guided_choice": ["x"] * 1025}, "guided_choice"),
    ("completions", {"guided_json": {"type": "object", "description": "x" * 70_000}}, "guided_json"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
              "tool_choice": "required"}, "tools"),
    ("chat", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_constraints_and_tools_are_400_naming_the_field(raw, route, body, param):
    if route == "chat":
        response = raw.post("/v1/chat/completions", json={"messages": ASK_WEATHER, "max_tokens": 4, **body})
    else:
        response = raw.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **body})
    error = expect_error(response, 400)
    assert error["param"] == param or error["param"].startswith(param + "["), error
    assert raw.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_auto_tool_choice_needs_the_server_flag(http):
    """The shared server runs without --enable-auto-tool-choice: tools alone (auto) are refused,
    while "none" and forced choices need no flag."""
    body = {"messages": ASK_WEATHER, "max_tokens": 40, "temperature": 0, "tools": [WEATHER]}
    error = expect_error(http.post("/v1/chat/completions", json=body), 400, "tool_choice")
    assert "--enable-auto-tool-choice" in error["message"]
    assert http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200
    named = http.post("/v1/chat/completions", json={**body, "tool_choice": {"type": "function",
                                                                          "function": {"name": "get_weather"}}})
    (call,) = named.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def check_calls(calls, tools) -> list[str]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [call.function.name for call in calls]


def test_required_and_named_tool_choices_give_valid_calls(client):
    required = ask(client, "What is the weather like in Paris?", tools=[WEATHER, TIME], tool_choice="required",
                   parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(check_calls(choice.message.tool_calls, [WEATHER, TIME])) == 1
    named = ask(client, "What time is it in Tokyo?", tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert check_calls(named.choices[0].message.tool_calls, [WEATHER, TIME]) == ["get_time"]
    assert named.choices[0].finish_reason == "tool_calls"
    parallel = ask(client, "Weather in Paris and the time in Tokyo?", tools=[WEATHER, TIME], tool_choice="required",
                   max_tokens=120)
    assert len(check_calls(parallel.choices[0].message.tool_calls, [WEATHER, TIME])) >= 1


def test_a_named_call_cut_by_max_tokens_is_the_same_call_whole_and_streamed(client):
    """The grammar let the output be nothing but the function's arguments: cut short, it is still that
    call (arguments unfinished, finish_reason "length"), as the stream sent it."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = ask(client, "What is the weather like in Paris?", tools=[WEATHER], tool_choice=named, max_tokens=3)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=3,
                                                 tools=[WEATHER], tool_choice=named, stream=True))
    deltas = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_calls_assemble_through_the_sdk_stream_helper(client, tool_choice):
    whole = ask(client, "What is the weather like in Paris?", tools=[WEATHER], tool_choice=tool_choice)
    with client.chat.completions.stream(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=100,
                                        tools=[WEATHER], tool_choice=tool_choice) as stream:
        deltas = [event for event in stream if event.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    (expected,) = whole.choices[0].message.tool_calls
    assert check_calls([call], [WEATHER]) == ["get_weather"] and len(deltas) > 1
    assert call.function.arguments == expected.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>'


def test_auto_tool_choice_reads_hermes_calls_whole_and_streamed(client):
    """The model's free text goes through --tool-call-parser hermes; a regex makes SmolLM2 write a
    Qwen-style call so the parser's path through the server is exercised for certain."""
    forced = {"guided_regex": "Let me check.\\n" + HERMES_CALL}
    out = ask(client, "What is the weather like in Paris?", tools=[WEATHER], extra_body=forced)
    message = out.choices[0].message
    assert message.content == "Let me check.\n" and out.choices[0].finish_reason == "tool_calls"
    assert check_calls(message.tool_calls, [WEATHER]) == ["get_weather"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=100,
                                                 tools=[WEATHER], extra_body=forced, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    pieces = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check.\n" and pieces[0].function.name == "get_weather" and pieces[0].id
    assert "".join(p.function.arguments or "" for p in pieces) == message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    free = ask(client, "Say hello.", tools=[WEATHER], max_tokens=8)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.reasoning_content


def test_tool_results_in_the_history_reach_the_template(raw):
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    ids = raw.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
    text = raw.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
            in text)
    assert "<tool_response>\n22 degrees, sunny\n</tool_response>" in text
    answer = raw.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 8,
                                                    "tool_choice": "none"})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["reasoning_content"]


def test_reasoning_parser_whole_and_streamed(client):
    """--reasoning-parser deepseek_r1: SmolLM2 never writes </think>, so its answer is all reasoning,
    streamed as reasoning deltas. Its `<think>` is several tokens of SmolLM2's tokenizer, so a constrained output
    cannot think first: it follows its grammar from the first token and is all content."""
    message = ask(client, "What is the capital of France?", max_tokens=12).choices[0].message
    assert message.reasoning_content == message.reasoning and "Paris" in message.reasoning_content
    assert message.content == ""
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": (
        "What is the capital of France?")}], temperature=0, max_tokens=12, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    constrained = ask(client, "What is the capital of France?", extra_body={"guided_choice": ["Paris", "Rome"]})
    assert constrained.choices[0].message.content in ("Paris", "Rome")
    assert getattr(constrained.choices[0].message, "reasoning_content", None) is None


def test_bench_serve_sends_a_json_schema_workload(tools_server, tmp_path, capsys):
    from corectl.server.cli.main import main

    result = tmp_path / "bench.json"
    # `main` is what the `corectl` script runs; here it saves an interpreter's start and imports.
    code = main(["bench", "serve", "--base-url", tools_server.url, "--input-len", "16", "--output-len", "12",
                 "--num-prompts", "3", "--structured-output", "json", "--save-result", str(result)])
    assert code == 0, capsys.readouterr().err
    saved = json.loads(result.read_text())
    assert saved["completed"] == 3 and saved["failed"] == 0 and saved["structured_output"] == "json"
    assert all(1 <= n <= 12 for n in saved["output_lens"])
