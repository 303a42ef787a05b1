"""Tools and template arguments agent frameworks send, through the real server and the `openai` client
(issue 27, defects 2 and 3): tools whose parameters pydantic generated for nested models (`$defs`,
`$ref`) under tool_choice "required", and chat_template_kwargs that collide with the renderer."""
from __future__ import annotations

import json

import jsonschema
import pytest
from corectl.server.http.tools import ChatTool, FunctionDefinition, forced_calls_spec
from corectl.structured.xgrammar_backend import XGrammarBackend
from pydantic import BaseModel, Field
from support.openai_errors import expect_error


class Address(BaseModel):
    city: str = Field(max_length=8)


class Person(BaseModel):
    name: str = Field(max_length=8)
    home: Address


class Meeting(BaseModel):
    host: Person
    guests: list[Person] = Field(max_length=1)


class Zone(BaseModel):
    zone: str = Field(pattern="^(north|south)$")


class Shipment(BaseModel):
    to: Zone
    # A "$ref"-like string that is data: the wrapping must leave it alone.
    label: str = Field(json_schema_extra={"enum": ["#/$defs/Zone"]})


def tool(name: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}


ASK = [{"role": "user", "content": "Book a meeting with Ann from Paris."}]


def test_the_required_wrapper_keeps_each_tools_references():
    tools = [ChatTool(function=FunctionDefinition(**tool(name, model)["function"]))
             for name, model in [("meet", Meeting), ("ship", Shipment)]]
    assert all("$ref" in json.dumps(t.function.parameters) for t in tools)  # what pydantic writes
    spec = forced_calls_spec(tools, "required", parallel=True)
    XGrammarBackend.validate(spec)  # compiles: every reference resolves
    meet = {"name": "meet", "parameters": {"host": {"name": "Ann", "home": {"city": "Paris"}}, "guests": []}}
    ship = {"name": "ship", "parameters": {"to": {"zone": "north"}, "label": "#/$defs/Zone"}}
    jsonschema.validate([meet, ship], spec.json)
    for wrong in ([{**meet, "parameters": {"host": {"name": "Ann", "home": {"town": "Paris"}}}}],
                  [{**ship, "parameters": {"to": {"zone": "north"}, "label": "#/$defs/tool_1/$defs/Zone"}}],
                  [{"name": "ship", "parameters": meet["parameters"]}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, spec.json)


def test_required_choice_takes_nested_pydantic_tools_end_to_end(openai_client, model_id):
    response = openai_client.chat.completions.create(
        model=model_id, messages=ASK, tools=[tool("meet", Meeting), tool("ship", Shipment)], temperature=0,
        tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    {"meet": Meeting, "ship": Shipment}[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.parametrize("kwargs", [{"tools": []}, {"messages": "x"}, {"eos_token": "<|endoftext|>"},
                                    {"tokenize": True}, {"continue_final_message": True}])
def test_reserved_template_arguments_are_a_400_naming_chat_template_kwargs(http, kwargs):
    response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2,
                                                       "chat_template_kwargs": kwargs})
    error = expect_error(response, 400, "chat_template_kwargs")
    assert next(iter(kwargs)) in error["message"]
    assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200
