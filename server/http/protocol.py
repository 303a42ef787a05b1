"""Request bodies of the OpenAI API (plus vLLM's sampling extensions) as msgspec Structs.

Fields follow the OpenAI reference; unknown fields are ignored as OpenAI clients send extras.
`sampling_params()` turns a request into `SamplingParams`, which validates the ranges and names the
field at fault.

Everything a client controls is bounded here, before any work is done for it (docs/serving.md,
"Request bounds"): integers to what the engine's generators and the msgpack wire hold, and sizes that
cost host work per token or per engine step (samples, stop lists, logit_bias) to small constants.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from corectl.errors import InvalidRequestError
from corectl.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

from .errors import APIError
from .tools import MAX_TOOLS, ChatTool, ToolCallIn, ToolChoice, forced_calls_spec, template_tool_calls
from .vllm_fields import RefusedFields


# OpenAI's cap on `n`; a completions request also holds at most MAX_CHOICES samples over all its prompts
# (each is an engine request: one HTTP request must not flood the engine).
MAX_N = 128
MAX_CHOICES = 256
# Stop strings are matched per generated token in this process; stop token ids and logit_bias entries
# are read by the engine in every step.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_MESSAGES = 4096
MAX_DETOKENIZE_TOKENS = 1 << 20
# allowed_token_ids may list a whole vocabulary; bad words cost a tail comparison per word per step.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 64
MAX_DOCUMENTS = 256
INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
# vLLM's request id (names the request in logs and responses) and prefix-cache salt, on every route.
RequestId = Annotated[str, Meta(min_length=1, max_length=256)]
CacheSalt = Annotated[str, Meta(min_length=1, max_length=1024)]
# A chat template of the request's own, its variables, and image-processor options (chat and /tokenize).
ChatTemplate = Annotated[str, Meta(max_length=1 << 16)]
TemplateKwargs = Annotated[dict[str, Any], Meta(max_length=64)]
ProcessorKwargs = Annotated[dict[str, Any], Meta(max_length=16)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    # vLLM's extension: usage on every chunk, not only in a last one.
    continuous_usage_stats: bool = False


class SamplingFields(RefusedFields, kw_only=True):
    """Fields shared by completions and chat completions (the output constraints among them)."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    prompt_logprobs: int | None = None
    # vLLM v0's best_of: that many samples, the n of highest cumulative logprob returned.
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    # vLLM's beam search: n beams, scored with length_penalty (beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: Annotated[list[int], Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[StopString], Meta(max_length=MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    cache_salt: CacheSalt | None = None
    spaces_between_special_tokens: bool = True
    # vLLM's disaggregated prefill/decode: this request's half of a KV transfer (`corectl proxy` sets it).
    kv_transfer_params: dict[str, Any] | None = None
    # The request's id in logs and responses (an X-Request-Id header takes precedence).
    request_id: RequestId | None = None
    # vLLM's: logprobs name their tokens "token_id:<id>" instead of their text (as the server's
    # --return-tokens-as-token-ids does for every request).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the response also carries the prompt's token ids and each choice's (streamed: the
    # prompt's in the first chunk, each chunk's delta of the choice's).
    return_token_ids: bool = False

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether logprobs name tokens by id: the request's choice, else the server's."""
        return server_default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids

    def stream_usage(self, force_include: bool) -> tuple[bool, bool]:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`, or the server's
        --enable-force-include-usage) and whether every chunk carries the usage so far (vLLM's
        `continuous_usage_stats`, which applies only with the first, as in vLLM)."""
        options = self.stream_options
        include = force_include or (options is not None and options.include_usage)
        return include, include and options is not None and options.continuous_usage_stats

    @property
    def keep_best(self) -> int | None:
        """With best_of > n, the n samples to keep of the best_of generated; else None."""
        return self.n if self.best_of is not None and self.best_of > self.n else None

    def check_stream_fields(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not available when stream is true", "prompt_logprobs")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of must be at least n ({self.n}), got {self.best_of}", "best_of")
        if self.keep_best is not None and self.stream:
            raise APIError(400, "best_of > n cannot be streamed: the best samples are known only once all "
                           "have finished", "best_of")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise APIError(400, "length_penalty weighs beam search: it needs use_beam_search", "length_penalty")
        self.check_refused()

    def build_sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                              structured_outputs: StructuredOutputsParams | None,
                              defaults: Mapping[str, Any]) -> SamplingParams:
        """SamplingParams for this request; out-of-range values raise InvalidRequestError(param=...).
        `defaults` fill the sampling fields the request leaves unset (the model's generation config)."""
        if self.keep_best is not None and logprobs is None:
            logprobs = 0  # the chosen tokens' logprobs, which rank the samples (not returned)
        values: dict[str, Any] = dict(
            structured_outputs=structured_outputs,
            n=self.best_of or self.n, max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            seed=self.seed, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens, cache_salt=self.cache_salt,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            kv_transfer_params=self.kv_transfer_params,
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        repetition_penalty=self.repetition_penalty)
        values.update({k: defaults.get(k) if v is None else v for k, v in optional.items()
                       if v is not None or defaults.get(k) is not None})
        return SamplingParams(**values)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)",
                                      param="logit_bias") from None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt` is a string, a list of strings, a list of token ids or a list of
    token-id lists."""

    prompt: str | list[str | int | list[int]]
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    # vLLM's extension: whether text prompts get the tokenizer's special tokens (BOS).
    add_special_tokens: bool = True
    prompt_embeds: Any = None  # refused (vllm_fields)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        kinds = {type(p) for p in prompt}
        if kinds == {int}:
            return [list(prompt)]  # type: ignore[arg-type]
        if len(kinds) == 1 and kinds <= {str, list}:
            samples = self.best_of or self.n
            if len(prompt) * samples > MAX_CHOICES:
                raise InvalidRequestError(f"{len(prompt)} prompts with {samples} samples each ask for "
                                          f"{len(prompt) * samples}; a request may have at most {MAX_CHOICES}",
                                          param="prompt")
            return list(prompt)  # type: ignore[arg-type]
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a list "
                                  "of token-id lists, not a mix", param="prompt")

    def check_supported(self) -> None:
        self.check_stream_fields()
        if self.suffix is not None:
            raise APIError(400, "suffix (insertion) is not supported by this server", "suffix")
        if self.echo and self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not available when stream is true", "prompt_logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is only allowed with echo, which then returns "
                           "the prompt alone)", "max_tokens")

    @property
    def echo_only(self) -> bool:
        """OpenAI's `echo` with `max_tokens` 0: the prompt comes back and nothing is generated."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: Mapping[str, Any] = _NO_DEFAULTS) -> SamplingParams:
        # Echoing with logprobs returns the prompt's logprobs too, as OpenAI does.
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        # The engine computes prompt logprobs on the way to a first token, so echo_only runs one token
        # and the response leaves it out (vLLM does the same).
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self.build_sampling_params(max_tokens, self.logprobs, prompt_logprobs, self.structured_spec(), defaults)


ImageAddress = Annotated[str, Meta(max_length=64 * 2 ** 20)]


class ImageURL(msgspec.Struct, kw_only=True, omit_defaults=True):
    url: ImageAddress
    # OpenAI's; the model's processor decides the resolution, so each value reads the image alike.
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None
    # An http(s) or data: URL (corectl.server.http.media); vLLM also takes the URL as a bare string.
    image_url: ImageURL | ImageAddress | None = None

    def __post_init__(self) -> None:
        if isinstance(self.image_url, str):
            self.image_url = ImageURL(url=self.image_url)


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's calls, and the id of the call a `tool` message answers.
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them (text parts are joined by the tokenizer)."""
    out = []
    for message in messages:
        rendered = msgspec.to_builtins(message)
        if message.tool_calls:
            rendered["tool_calls"] = template_tool_calls(rendered["tool_calls"])
        out.append(rendered)
    return out


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[ChatTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extensions: extra variables for the chat template (e.g. Qwen3's enable_thinking); the
    # final message continued instead of a new one started; echo the last message when the
    # assistant wrote it; RAG documents and OpenAI's reasoning_effort for templates that read them;
    # a template for this request (a Jinja string); special tokens on top of the template's.
    chat_template_kwargs: TemplateKwargs | None = None
    # The model's image-processor options for this request's images (corectl.multimodal.processing).
    mm_processor_kwargs: ProcessorKwargs | None = None
    continue_final_message: bool = False
    echo: bool = False
    documents: Annotated[list[dict[str, str]], Meta(max_length=MAX_DOCUMENTS)] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    chat_template: ChatTemplate | None = None
    add_special_tokens: bool = False
    structural_tag: Any = None  # refused (vllm_fields)
    include_reasoning: bool = True  # refused when false (vllm_fields)
    # OpenAI's: refused when set (vllm_fields), but for `modalities` ["text"].
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    store: bool = False
    modalities: list[str] | None = None
    # OpenAI's, accepted with nothing to do: a prediction only shortens latency, never changes the
    # answer; metadata tags stored completions. The one service tier is "default" (`priority` orders).
    prediction: Any = None
    service_tier: Literal["auto", "default"] | None = None
    metadata: Any = None

    def check_supported(self) -> None:
        self.check_stream_fields()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                               f"got {message.role!r}", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        check_continuation(self.messages, self.continue_final_message, self.add_generation_prompt)
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise APIError(400, f"modalities {self.modalities} are not supported: this server generates text only",
                           "modalities")

    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's variables: chat_template_kwargs, plus reasoning_effort for the templates that
        read it (the request's field wins over the same name in chat_template_kwargs)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def echoed_text(self) -> str:
        """vLLM's chat `echo`: the last message's text, prepended to the reply when the assistant wrote it."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "".join(part.text or "" for part in last.content if part.type == "text")

    def sampling_params(self, tool_choice: str, defaults: Mapping[str, Any] = _NO_DEFAULTS) -> SamplingParams:
        """`tool_choice` is the effective choice (`tools.check_tool_choice`): "required" and "named"
        constrain the output to calls, which leaves no room for another constraint."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        spec = self.structured_spec()
        if tool_choice in ("required", "named"):
            if spec is not None:
                raise APIError(400, f"tool_choice {tool_choice!r} constrains the output to tool calls; it cannot "
                               f"be combined with {self.constraint_field}", self.constraint_field)
            spec = forced_calls_spec(self.tools, self.tool_choice, self.parallel_tool_calls)
        return self.build_sampling_params(max_tokens, logprobs, self.prompt_logprobs, spec, defaults)


def check_continuation(messages: list[ChatMessage], continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (set "
                       "add_generation_prompt to false to continue the last message)", "continue_final_message")
    if continue_final_message and messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message continues the last message, which must be the "
                       "assistant's", "continue_final_message")


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template (vLLM's
    TokenizeCompletionRequest and TokenizeChatRequest), counted as the generation routes would."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    # Default: true for a prompt, false for messages (the template writes its own), as the routes do.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # With messages, each as a chat request sends it: the tools the template renders, image-processor
    # options, the last message continued, a template of the request's own and its variables.
    tools: Annotated[list[ChatTool], Meta(max_length=MAX_TOOLS)] | None = None
    mm_processor_kwargs: ProcessorKwargs | None = None
    continue_final_message: bool = False
    chat_template: ChatTemplate | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    def check_prompt_fields(self) -> None:
        """A text prompt goes through no template: the messages' fields are refused with it."""
        for name in ("tools", "mm_processor_kwargs", "chat_template", "chat_template_kwargs"):
            if getattr(self, name):
                raise APIError(400, f"{name} applies to messages; a text prompt goes through no chat template", name)
        if self.continue_final_message:
            raise APIError(400, "continue_final_message applies to messages", "continue_final_message")


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[int], Meta(max_length=MAX_DETOKENIZE_TOKENS)]

