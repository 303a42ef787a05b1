"""Per-request sampling parameters, validated when built."""
from __future__ import annotations

from typing import Any

import msgspec

from .errors import InvalidRequestError
from .kv_transfer.config import check_transfer_params

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class ReasoningGate(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Hold a grammar back while a reasoning model thinks (vLLM's structured output after reasoning).

    `end`: the token id that closes the reasoning; the grammar applies from the token after it.
    `start`: the token id that opens it; when the output does not start thinking, its first token may
    be `start` (then it thinks) or what the grammar allows (then it answers at once). None: the
    output cannot open a reasoning section. `thinking`: the prompt left the reasoning open, so the
    output starts inside it. While thinking, tokens are sampled freely. Markers are single tokens:
    `corectl.structured.reasoning.reasoning_gate` builds a gate from a tokenizer and a prompt.
    """

    end: int
    start: int | None = None
    thinking: bool = False

    def __post_init__(self) -> None:
        if self.end < 0 or (self.start is not None and self.start < 0) or self.start == self.end:
            raise InvalidRequestError(f"structured_outputs.reasoning needs two different token ids, got start "
                                      f"{self.start!r} and end {self.end!r}", param="structured_outputs.reasoning")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrain a request's output to a language (vLLM's `StructuredOutputsParams`); set exactly one of:

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular
    expression; choice: one of these strings; grammar: an EBNF grammar (GBNF style, a `root` rule);
    structural_tag: a structural tag in the backend's JSON format (text with tagged, schema-checked
    regions). `disable_any_whitespace` makes JSON compact, without optional whitespace.
    `reasoning` (a `ReasoningGate`) lets a reasoning model think freely first: the grammar holds the
    output from the token after its reasoning ends (None: from the first token).
    The engine compiles it with its structured-output backend (`EngineConfig.structured_outputs_backend`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    reasoning: ReasoningGate | None = None

    def __post_init__(self) -> None:
        chosen = [kind for kind in _STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequestError(
                f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KINDS)}; "
                f"got {', '.join(chosen) if chosen else 'none'}", param="structured_outputs")
        kind = chosen[0]
        value = getattr(self, kind)
        ok = {
            "json": isinstance(value, (dict, str)) and bool(value),
            "json_object": value is True,
            "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value),
        }.get(kind, isinstance(value, str) and bool(value.strip()))
        if not ok:
            expected = {"json": "a JSON schema (an object or its JSON text)", "json_object": "true",
                        "choice": "a non-empty list of non-empty strings"}.get(kind, "a non-empty string")
            raise InvalidRequestError(f"structured_outputs.{kind} must be {expected}, got {value!r}",
                                      param=f"structured_outputs.{kind}")

    @property
    def kind(self) -> str:
        """The one constraint that is set: json, json_object, regex, choice, grammar or structural_tag."""
        return next(kind for kind in _STRUCTURED_KINDS if getattr(self, kind) not in (None, False))


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens for one request (vLLM's fields and meanings).

    temperature 0 means greedy. top_k 0 or -1 disables top-k. `seed` makes the random path
    reproducible for this request whatever else is batched with it. `logprobs` returns that many
    top alternatives per generated token (0: only the chosen token's logprob). `structured_outputs`
    constrains the output to a grammar (JSON schema, regex, choice, EBNF): see `StructuredOutputsParams`.

    vLLM's extensions: `allowed_token_ids` restricts every step to those tokens; `bad_words` are never
    completed (intake tokenizes them into `bad_words_token_ids`, each word as is and after a space);
    `truncate_prompt_tokens` keeps only the prompt's last that many tokens; `cache_salt` keys the
    request's prefix-cache blocks, so only requests with the same salt share them;
    `spaces_between_special_tokens` separates special tokens from their neighbours in the text when
    they are not skipped. `kv_transfer_params` makes the request one half of a disaggregated
    prefill/decode pair (`corectl.kv_transfer.config`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    spaces_between_special_tokens: bool = True
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1 (disabled), 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "must not be empty"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
             "must be at least 1"),
            ("cache_salt", self.cache_salt is None or len(self.cache_salt) > 0, "must be a non-empty string"),
            ("bad_words_token_ids", all(self.bad_words_token_ids or [[0]]), "must hold non-empty token lists"),
        ]
        for field, ok, message in checks:
            if not ok:
                raise InvalidRequestError(f"{field} {message}, got {getattr(self, field)!r}", param=field)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise InvalidRequestError(
                        f"logit_bias for token {token} must be in [-100, 100], got {bias}", param="logit_bias"
                    )
        if self.stop and any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")
        check_transfer_params(self.kv_transfer_params)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        )

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
