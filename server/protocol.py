"""Request bodies of the OpenAI API (plus vLLM's sampling extensions) as msgspec Structs.

Fields follow the OpenAI reference; unknown fields are ignored as OpenAI clients send extras.
`sampling_params()` turns a request into `SamplingParams`, which validates the ranges and names the
field at fault.
"""
from __future__ import annotations

from typing import Any

import msgspec
from corectl.errors import InvalidRequestError
from corectl.sampling_params import SamplingParams

from .errors import APIError


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_fields(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not available when stream is true", "prompt_logprobs")

    def build_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                              prompt_logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request; out-of-range values raise InvalidRequestError(param=...)."""
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, seed=self.seed, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self._logit_bias(),
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        repetition_penalty=self.repetition_penalty)
        values.update({k: v for k, v in optional.items() if v is not None})
        if values["n"] < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}", param="n")
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
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's extension: each choice also carries prompt_token_ids and token_ids.
    return_token_ids: bool = False

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
            return list(prompt)  # type: ignore[arg-type]
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a list "
                                  "of token-id lists, not a mix", param="prompt")

    def check_supported(self) -> None:
        self.check_stream_fields()
        if self.suffix is not None:
            raise APIError(400, "suffix (insertion) is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (it must be unset or equal to n)", "best_of")
        if self.echo and self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not available when stream is true", "prompt_logprobs")

    def sampling_params(self) -> SamplingParams:
        # Echoing with logprobs returns the prompt's logprobs too, as OpenAI does.
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self.build_sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them (text parts are joined by the tokenizer)."""
    return [msgspec.to_builtins(m) for m in messages]


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        self.check_stream_fields()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                               f"got {message.role!r}", "messages")
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError(400, "tool calling is not supported by this server", "tools")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.build_sampling_params(max_tokens, logprobs, self.prompt_logprobs)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]

