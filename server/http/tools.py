"""Tool calling on chat: the `tools` and `tool_choice` request fields, the grammar that forces calls
(`tool_choice` "required" or a named function), and tool calls in the conversation history.

"required" and a named choice are grammar-constrained, so a call's arguments always parse and match
its function's JSON schema, on any model. A named choice constrains the output to the function's
arguments object; "required" to a JSON array of `{"name": ..., "parameters": {...}}` objects, one of
the tools each (at most one call unless `parallel_tool_calls`). Both grammars are compact JSON (no
optional whitespace), which keeps small models from wandering into whitespace. "auto" leaves the
model free and a tool parser (`--tool-call-parser`) finds the calls in its text.
"""
from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from corectl.errors import InvalidRequestError
from corectl.sampling_params import StructuredOutputsParams

from .constraints import check_schema_bounds

# OpenAI's limits: 128 tools a request, function names of at most 64 letters, digits, '_' or '-'.
MAX_TOOLS = 128
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as chat templates read them: templates write `arguments` with `tojson`,
    so a JSON string becomes the object it holds (vLLM renders them the same way)."""
    out = []
    for call in calls:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass  # not JSON: the template gets the text as sent
        out.append({**call, "function": function})
    return out


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(tool) for tool in tools]


def check_tool_choice(tools: list[ChatTool] | None, choice: ToolChoice | None, auto_enabled: bool) -> str:
    """The effective tool choice ("none", "auto", "required" or "named"); raises a 400 for a choice
    the request or server cannot take."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return "none"
    if not tools:
        raise InvalidRequestError(f"tool_choice {_shown(choice)} needs tools", param="tool_choice")
    if choice == "auto":
        if not auto_enabled:
            raise InvalidRequestError(
                '"auto" tool choice (the default when tools are sent) requires --enable-auto-tool-choice and '
                '--tool-call-parser to be set; send tool_choice "none", "required" or a named function instead',
                param="tool_choice")
        return "auto"
    if choice == "required":
        return "required"
    if choice.function.name not in {tool.function.name for tool in tools}:
        raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not among the "
                                  "request's tools", param="tool_choice")
    return "named"


def _shown(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def forced_calls_spec(tools: list[ChatTool], choice: ToolChoice, parallel: bool) -> StructuredOutputsParams:
    """The grammar for "required" or a named choice."""
    if isinstance(choice, NamedToolChoice):
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        schema = function.parameters or EMPTY_PARAMETERS
    else:
        schema = _required_calls_schema(tools)
        if not parallel:
            schema["maxItems"] = 1
    check_schema_bounds(schema, "tools")
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _required_calls_schema(tools: list[ChatTool]) -> dict[str, Any]:
    """An array of calls, each one tool's. A tool's parameters are a schema whose local `$ref`s
    ("#/$defs/Item", as pydantic writes nested models) point into that schema; wrapped, they would
    point into the wrapper. So each tool's parameters sit whole under the wrapper's `$defs`, with
    their references rebased there."""
    defs, calls = {}, []
    for index, tool in enumerate(tools):
        parameters = tool.function.parameters or EMPTY_PARAMETERS
        check_schema_bounds(parameters, "tools")
        base = f"#/$defs/tool_{index}"
        defs[f"tool_{index}"] = _rebased(parameters, base)
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": {"$ref": base}},
                      "required": ["name", "parameters"], "additionalProperties": False})
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}


# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, base: str) -> Any:
    """A copy of `schema` with every local reference ("#..." JSON pointer) made relative to `base`."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out
