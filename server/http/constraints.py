"""The request fields that constrain output to a grammar, mapped to the engine's `StructuredOutputsParams`.

Clients say the same thing several ways: OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `structured_outputs` object, and vLLM's older `guided_json`, `guided_regex`, `guided_choice`
and `guided_grammar` fields (still sent by many clients). A request may use one of them; each is
bounded here like every other client-controlled input (docs/serving.md, "Request bounds"), and a
grammar the backend refuses comes back as a 400 naming the field the client sent (`errors_name`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from corectl.errors import InvalidRequestError
from corectl.sampling_params import StructuredOutputsParams

# A grammar compiles in time that grows with its size; these keep one request's compile well inside the
# engine's compile bound (`structured_outputs_compile_timeout`) and its text small on the wire.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_SCHEMA_BYTES = 64 * 1024
# Parsing a schema costs roughly the cube of its nesting (300 nested objects: ~20 s); 64 levels
# (32 objects inside each other, with their "properties") take ~40 ms. $refs are not nesting.
MAX_SCHEMA_DEPTH = 64
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024

GrammarText = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]
Choices = Annotated[list[Annotated[str, Meta(max_length=MAX_CHOICE_CHARS)]], Meta(max_length=MAX_CHOICES)]
Schema = dict[str, Any] | GrammarText


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`: `schema` is the JSON schema the output must match.
    `strict` is accepted either way: the grammar always holds the output to the whole schema."""

    name: Annotated[str, Meta(max_length=256)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format`: plain `text`, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` request object (the fields of its `StructuredOutputsParams`; a key
    outside them is a 400, not dropped). Two need nothing done: `disable_fallback` (one backend serves
    a request, so none falls back) and `disable_additional_properties` (xgrammar's strict mode already
    holds objects to their listed properties)."""

    json: Schema | None = None
    json_object: bool | None = None
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    structural_tag: GrammarText | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # refused: xgrammar takes no whitespace pattern

    def spec(self) -> StructuredOutputsParams:
        if self.whitespace_pattern is not None:
            raise InvalidRequestError("structured_outputs.whitespace_pattern is not supported: the xgrammar backend "
                                      "takes no whitespace pattern (structured_outputs.disable_any_whitespace "
                                      "allows none)", param="structured_outputs.whitespace_pattern")
        check_schema_bounds(self.json)
        return StructuredOutputsParams(json=self.json, json_object=self.json_object, regex=self.regex,
                                       choice=self.choice, grammar=self.grammar, structural_tag=self.structural_tag,
                                       disable_any_whitespace=self.disable_any_whitespace)


class ConstraintFields(msgspec.Struct, kw_only=True):
    """The constraint fields shared by completions and chat completions."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Schema | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None

    @property
    def constraint_field(self) -> str | None:
        """The field that constrains this request's output (None: none does)."""
        sent = self.sent_constraints()
        return sent[0] if sent else None

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The constraint this request asks for, from whichever field it was sent in."""
        sent = self.sent_constraints()
        if len(sent) > 1:
            raise InvalidRequestError(f"a request may constrain its output one way; it sets {', '.join(sent)}",
                                      param=sent[1])
        if not sent:
            return None
        with errors_name(sent[0]):
            return self._spec(sent[0])

    def sent_constraints(self) -> list[str]:
        sent = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
                if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            sent.insert(0, "response_format")
        return sent

    def _spec(self, field: str) -> StructuredOutputsParams:
        if field == "response_format":
            return _response_format_spec(self.response_format)
        if field == "structured_outputs":
            return self.structured_outputs.spec()
        kind = field.removeprefix("guided_")
        value = getattr(self, field)
        if kind == "json":
            check_schema_bounds(value)
        return StructuredOutputsParams(**{kind: value})


def _response_format_spec(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                  param="response_format")
    check_schema_bounds(fmt.json_schema.schema_)
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def check_schema_bounds(schema: dict | str | None, param: str = "structured_outputs") -> None:
    """The schema's size and nesting bounds (a string schema that is not JSON is left to the backend)."""
    if schema is None:
        return
    size = len(schema.encode()) if isinstance(schema, str) else len(msgspec.json.encode(schema))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"the JSON schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted",
                                  param=param)
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError:
            return
    depth = nesting_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"the JSON schema nests objects and arrays {depth} levels deep; at most "
                                  f"{MAX_SCHEMA_DEPTH} are accepted (use $defs and $ref for deep structures)",
                                  param=param)


def nesting_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a decoded JSON value (iteratively: any depth is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


@contextlib.contextmanager
def errors_name(field: str | None) -> Iterator[None]:
    """Errors about the engine's `structured_outputs` (built here, or refused by the grammar backend
    when the request is submitted) name `field`, the field the client actually sent."""
    try:
        yield
    except InvalidRequestError as exc:
        named = named_for(exc, field)
        if named is exc:
            raise
        raise named from exc


def named_for(exc: InvalidRequestError, field: str | None) -> InvalidRequestError:
    """`exc` naming `field` where it names the engine's `structured_outputs` (itself otherwise)."""
    param = exc.param
    if field is None or param is None or not param.startswith("structured_outputs") or field == "structured_outputs":
        return exc
    return InvalidRequestError(str(exc).replace(param, field, 1), param=field, code=exc.code)
