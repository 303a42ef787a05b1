"""Response bodies and stream chunks of the OpenAI API as msgspec Structs (encoded once, no copies)."""
from __future__ import annotations

import msgspec


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(msgspec.Struct):
    """vLLM's prompt-logprobs entry, keyed by token id in a per-position dict."""

    logprob: float
    rank: int
    decoded_token: str | None


PromptLogprobsList = list[dict[int, PromptLogprob] | None]


# -- completions -------------------------------------------------------------------------------------

class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    # Only with return_token_ids (UNSET fields are left out, so plain responses keep OpenAI's shape);
    # streamed, prompt_token_ids comes in a choice's first chunk and token_ids is each chunk's delta.
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- chat ----------------------------------------------------------------------------------------------

class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprob] | None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessageOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`content` is null when the message holds only tool calls. With a reasoning parser the reasoning
    comes as `reasoning_content` and, under vLLM's newer name, `reasoning` (both null without it)."""

    role: str
    content: str | None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | None | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # with return_token_ids only


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # with return_token_ids only


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of tool call `index`: its first carries the id, type and name; the rest
    carry argument text, to be concatenated."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # the chunk's, with return_token_ids only


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # the first chunk's, with return_token_ids


# -- models, tokenizer, ops -------------------------------------------------------------------------

class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "corectl"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class EngineLoad(msgspec.Struct):
    """One engine core's gauges; `engine` is its label in `/metrics` ("0" without data parallelism)."""

    engine: str
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float


class LoadResponse(msgspec.Struct):
    """`server_load`: generation requests this server is handling now (vLLM's field); the gauges
    cover every engine core, and `engines` gives each one's."""

    server_load: int
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    engines: list[EngineLoad]
