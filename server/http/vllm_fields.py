"""vLLM's request fields this server cannot honour, refused by name instead of dropped.

vLLM clients send these, and OpenAI's chat fields this server cannot honour; a request that sets one
to anything but its default gets a 400 naming the field and saying why, so no one mistakes an ignored
setting for an applied one. Fields outside vLLM's and OpenAI's request models are ignored, as vLLM
ignores them.
"""
from __future__ import annotations

import functools
from typing import Any

import msgspec
from corectl.sampling_params import SamplingParams

from .constraints import ConstraintFields
from .errors import APIError

# field -> why it is refused. A field counts as sent when it differs from its default.
REFUSED_REASONS = {
    "logits_processors": "this server loads no custom logits processors",
    "vllm_xargs": "this server has no extensions that read vllm_xargs",
    "prompt_embeds": "this server takes prompts as text or token ids, not embeddings",
    "guided_decoding_backend": "the structured-output backend is chosen at start-up (--structured-outputs-backend)",
    "guided_whitespace_pattern": "JSON whitespace is set with structured_outputs.disable_any_whitespace",
    "structural_tag": "send the structural tag as structured_outputs.structural_tag",
    "include_reasoning": "reasoning is always returned in reasoning_content when a reasoning parser is set",
    # OpenAI's chat fields that would change the answer or its shape in ways this server does not serve.
    "functions": "send functions as tools (the legacy functions and function_call fields are not served)",
    "function_call": "send the choice as tool_choice (the legacy functions and function_call fields are not served)",
    "audio": "this server generates text only",
    "web_search_options": "this server has no web search tool",
    "verbosity": "the served model has no verbosity setting; ask for brevity in the messages",
    "store": "chat completions are not stored here (the Responses API stores responses: POST /v1/responses)",
}


def check_limited_fields(request: Any, limited: dict[str, tuple[tuple, str]]) -> None:
    """A 400 naming the first of `limited` (field -> (the values honoured, why no other is)) set to
    another value; a dotted name ("a.b") is field b of field a, unset where a part is."""
    for name, (honoured, reason) in limited.items():
        value: Any = request
        for part in name.split("."):
            value = getattr(value, part, None)
        if value is not None and value not in honoured:
            raise APIError(400, f"{name} {msgspec.json.encode(value).decode()} is not supported: {reason}", name)


def check_max_logprobs(params: SamplingParams, limit: int, logprobs_field: str) -> None:
    """The server's `--max-logprobs` bound on a request's logprobs and prompt_logprobs."""
    for field, value in ((logprobs_field, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None and value > limit:
            raise APIError(400, f"{field} must be at most {limit} on this server (--max-logprobs), got {value}", field)


def check_ranking(field: str, logprobs_mode: str) -> None:
    """Beam search and best_of rank samples by cumulative logprob, which a server whose
    --logprobs-mode reports logits does not have."""
    if logprobs_mode.endswith("_logits"):
        raise APIError(400, f"{field} ranks samples by their logprobs, which this server does not report "
                       f"(--logprobs-mode {logprobs_mode} reports logits)", field)


class RefusedFields(ConstraintFields, kw_only=True):
    """The refused fields completions and chat requests share, at their vLLM defaults (each request
    declares its own others); `check_refused` checks every field named in REFUSED_REASONS."""

    logits_processors: Any = None
    vllm_xargs: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    def check_refused(self) -> None:
        for name, default in _refused_defaults(type(self)):
            value = getattr(self, name)
            if not (value is None or value == default or (default is None and value is False)):
                raise APIError(400, f"{name} is not supported: {REFUSED_REASONS[name]}", name)


@functools.cache
def _refused_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each refused field of the request struct `cls`, once a class:
    `msgspec.structs.fields` evaluates the class's string annotations on every call, which cost
    ~2 ms of the API process's CPU per request."""
    return tuple((f.name, f.default) for f in msgspec.structs.fields(cls) if f.name in REFUSED_REASONS)
