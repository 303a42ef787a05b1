"""The harmony chat format of gpt-oss: a chat request rendered as the model was trained to read it.

The rendering follows OpenAI's harmony library (`openai-harmony`, `src/encoding.rs`), whose
encoding needs the o200k vocabulary downloaded at run time; this renders the same text, which the
served tokenizer (gpt-oss ships harmony's special tokens as its added tokens) turns into the same
tokens. The conversation becomes:

- a system message: the model identity, knowledge cutoff, current date, `Reasoning: <effort>`
  (the request's `reasoning_effort`, medium by default) and the valid channels;
- a developer message when the request has system/developer messages (their text as
  `# Instructions`) or function tools (`# Tools`, a TypeScript-like `namespace functions`);
- the user messages, earlier assistant answers (channel `final`), earlier tool calls (channel
  `commentary`, recipient `functions.<name>`, JSON arguments, ended by `<|call|>`) and tool results
  (author `functions.<name>`, to the assistant);
- `<|start|>assistant`, after which the model writes its channels (`harmony_output.HarmonyText`).
"""
from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

from corectl.errors import InvalidRequestError
from corectl.sampling_params import SamplingParams

from .errors import APIError
from .protocol import ChatCompletionRequest, message_dicts

MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
CHANNELS = ("analysis", "commentary", "final")
# The harmony tokens the renderer and the output parser use (the `o200k_harmony` special tokens).
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# OpenAI's reasoning_effort values; harmony knows three ("minimal" reasons as little as it can: low).
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high"}
# The models that read harmony (`EngineInfo.architecture`).
HARMONY_ARCHITECTURES = frozenset({"GptOssForCausalLM"})
# Chat fields that feed a chat template, which harmony does not use.
_TEMPLATE_FIELDS = ("continue_final_message", "documents", "chat_template_kwargs")


def uses_harmony(architecture: str, data: ChatCompletionRequest) -> bool:
    """Whether the request is rendered as harmony: a harmony model, unless it sends its own template."""
    return architecture in HARMONY_ARCHITECTURES and data.chat_template is None


def harmony_prompt(data: ChatCompletionRequest, tool_choice: str, params: SamplingParams, tokenizer,
                   tools: list[dict] | None) -> tuple[list[int], SamplingParams]:
    """The request's harmony prompt tokens, and its params keeping the special tokens the channels
    are marked with; a 400 naming a field harmony cannot honour."""
    if tool_choice in ("required", "named"):
        raise APIError(400, "a forced tool_choice constrains the output to JSON calls, which the harmony format "
                       "(gpt-oss) writes in its own channels: send tool_choice \"auto\"", "tool_choice")
    for field in _TEMPLATE_FIELDS:
        if getattr(data, field):
            raise APIError(400, f"{field} is read by chat templates; the harmony format (gpt-oss) has none", field)
    text = render_chat(message_dicts(data.messages), tools, data.reasoning_effort, today(),
                       data.add_generation_prompt)
    prompt = tokenizer.encode(text, add_special_tokens=data.add_special_tokens)
    return prompt, params.clone(skip_special_tokens=False, spaces_between_special_tokens=False)


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def render_chat(messages: Sequence[dict[str, Any]], tools: list[dict] | None, reasoning_effort: str | None,
                date: str | None, add_generation_prompt: bool = True) -> str:
    """The harmony prompt of OpenAI-style `messages` (role, content, tool_calls, tool_call_id) and
    function `tools` (`{"type": "function", "function": {...}}`); `date` is the current date the
    system message states (None: none)."""
    functions = [tool["function"] for tool in tools or []]
    parts = [_message("system", None, None, system_text(EFFORTS[reasoning_effort or "medium"], date, bool(functions)))]
    instructions = "\n\n".join(_text(m.get("content")) for m in messages if m["role"] in ("system", "developer"))
    if instructions or functions:
        parts.append(_message("developer", None, None, developer_text(instructions, functions)))
    call_names: dict[str, str] = {}
    for message in messages:
        parts.append(_conversation_message(message, call_names))
    if add_generation_prompt:
        parts.append(START + "assistant")
    return "".join(parts)


def system_text(effort: str, date: str | None, has_functions: bool) -> str:
    top = [MODEL_IDENTITY, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}"] + ([f"Current date: {date}"] if date else [])
    channels = f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
    if has_functions:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return "\n\n".join(["\n".join(top), f"Reasoning: {effort}", channels])


def developer_text(instructions: str, functions: list[dict]) -> str:
    sections = ["# Instructions", instructions] if instructions else []
    if functions:
        sections.append(tools_section(functions))
    return "\n\n".join(sections)


def tools_section(functions: list[dict]) -> str:
    """harmony's `# Tools` section for the `functions` namespace."""
    lines = ["## functions\n", "namespace functions {\n"]
    for function in functions:
        lines += [f"// {line}" for line in (function.get("description") or "").splitlines()]
        parameters = function.get("parameters")
        if parameters is not None:
            lines.append(f"type {function['name']} = (_: {schema_to_typescript(parameters, '')}) => any;\n")
        else:
            lines.append(f"type {function['name']} = () => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _conversation_message(message: dict[str, Any], call_names: dict[str, str]) -> str:
    role = message["role"]
    if role in ("system", "developer"):
        return ""  # their text is the developer message's instructions
    if role == "user":
        return _message("user", None, None, _text(message.get("content")))
    if role == "tool":
        name = call_names.get(message.get("tool_call_id") or "")
        if name is None:
            raise InvalidRequestError("a tool message's tool_call_id must name a call of an earlier assistant "
                                      "message (harmony addresses the result from that function)", param="messages")
        return _message(f"functions.{name} to=assistant", "commentary", None, _text(message.get("content")))
    out = []
    content = _text(message.get("content"))
    if content:
        out.append(_message("assistant", "final", None, content))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        call_names[call.get("id") or ""] = function["name"]
        arguments = function["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append(_message("assistant", f"commentary to=functions.{function['name']} {CONSTRAIN}json", None,
                            arguments, end=CALL))
    return "".join(out)


def _message(header: str, channel: str | None, content_type: str | None, text: str, end: str = END) -> str:
    head = header + (CHANNEL + channel if channel else "") + (f" {content_type}" if content_type else "")
    return f"{START}{head}{MESSAGE}{text}{end}"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")


def _default_comment(schema: dict, value: Any) -> str:
    if isinstance(value, str) and not schema.get("enum"):
        return f'default: "{value}"'
    return f"default: {value if isinstance(value, str) else _json(value)}"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _nullable(schema: dict, text: str) -> str:
    return f"{text} | null" if schema.get("nullable") and "null" not in text else text


def schema_to_typescript(schema: dict, indent: str) -> str:
    """harmony's `json_schema_to_typescript`: a JSON schema as the TypeScript-like type the model reads."""
    if isinstance(schema.get("oneOf"), list):
        return "".join(f"\n{indent} | " + _variant(v, indent) for v in schema["oneOf"])
    kind = schema.get("type")
    if isinstance(kind, list) and kind:
        return " | ".join("number" if k == "integer" else str(k) for k in kind)
    if kind == "object":
        return _object_type(schema, indent)
    if kind == "string":
        values = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)]
        return " | ".join(values) if values else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        items = schema.get("items")
        return f"{schema_to_typescript(items, indent)}[]" if items is not None else "Array<any>"
    return "any"


def _variant(variant: dict, indent: str) -> str:
    text = _nullable(variant, schema_to_typescript(variant, indent + "   "))
    comments = [variant["description"]] if isinstance(variant.get("description"), str) else []
    if "default" in variant:
        comments.append(_default_comment(variant, variant["default"]))
    return text + (f" // {' '.join(comments)}" if comments else "")


def _object_type(schema: dict, indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    required = set(schema.get("required") or [])
    for key, value in (schema.get("properties") or {}).items():
        mark = "" if key in required else "?"
        if isinstance(value.get("title"), str):
            out += f"{indent}// {value['title']}\n{indent}//\n"
        if "oneOf" not in value and isinstance(value.get("description"), str):
            out += f"{indent}// {value['description']}\n"
        examples = [e for e in value.get("examples") or [] if isinstance(e, str)]
        if value.get("examples"):
            out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples)
        if isinstance(value.get("oneOf"), list):
            out += _one_of_property(key + mark, value, indent)
            continue
        out += f"{indent}{key}{mark}: {_nullable(value, schema_to_typescript(value, indent + '    '))},"
        if "default" in value:
            out += f" // {_default_comment(value, value['default'])}"
        out += "\n"
    return out + f"{indent}}}"


def _one_of_property(name: str, value: dict, indent: str) -> str:
    variants = value["oneOf"]
    description = value.get("description") if isinstance(value.get("description"), str) else None
    first = variants[0].get("description") if variants else None
    above = description is not None and description != first
    out = f"{indent}// {description}\n" if above else ""
    if "default" in value:
        out += f"{indent}// {_default_comment(value, value['default'])}\n"
    out += f"{indent}{name}:\n"
    for i, variant in enumerate(variants):
        text = _nullable(variant, schema_to_typescript(variant, indent + "   "))
        comments = []
        own = variant.get("description")
        if not (i == 0 and above) and isinstance(own, str) and own != description:
            comments.append(own)
        if "default" in variant:
            comments.append(_default_comment(variant, variant["default"]))
        out += f"{indent} | {text}" + (f" // {' '.join(comments)}" if comments else "") + "\n"
    return out + f"{indent},\n"
