"""`--speculative-config`: vLLM's JSON form, validated at the edge.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "path/to/small-llama", "num_speculative_tokens": 3}
    {"method": "eagle3", "model": "path/to/eagle3-head", "num_speculative_tokens": 3}

The engine option `EngineConfig.speculative_config` takes a dict, a JSON string or a
`SpeculativeConfig`; `resolve_speculative_config` turns any of them into one checked
`SpeculativeConfig` or raises a `ConfigError` naming what is wrong. As in vLLM, a missing
`method` is "ngram" when `model` is "ngram" (or "[ngram]") and "draft_model" when another model
is named; an n-gram config with one lookup bound takes it for both, with none 5 and 5.
"""
from __future__ import annotations

from typing import Any

import msgspec

from ..errors import ConfigError
from ..json_option import decode_json_option

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
# The token id of a draft position that the scheduler reserves and the worker's draft model fills.
PLACEHOLDER = -1
_DEFAULT_LOOKUP = 5


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """method: how draft tokens are proposed; num_speculative_tokens: k, the draft tokens a step
    verifies per request (1..16); prompt_lookup_min/max: the n-gram lengths matched against the
    request's own tokens (ngram); model: the draft model (draft_model: a local HF directory, a
    `.gguf` file or a shape preset with the target's vocabulary) or the EAGLE / EAGLE-3 head made
    for the target (eagle, eagle3: a local HF directory or hub id); draft_tensor_parallel_size: the
    target's tensor-parallel size (the default: the draft is split as the target is) or 1 (every
    rank holds and runs the whole draft). vLLM's others: revision and quantization load the draft or
    head (as the engine's options of those names load the target); max_model_len: no drafts for a
    request once its length reaches it; disable_by_batch_size: no drafts in a step whose running
    requests are at least this many (where the verify steps' extra rows cost more than drafts win);
    enforce_eager false (the draft runs as the target does)."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    revision: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None
    enforce_eager: bool = False

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def draft_engine_config(config, **changes):
    """The engine config (an `EngineConfig`) that loads `config`'s draft model or head: its
    `speculative_config.model` as the model, with none of the target's tokenizer, overrides,
    quantization or speculation; `changes` on top (a plan's `load_format="dummy"`)."""
    spec = config.speculative_config
    return config.replace(model=spec.model, revision=spec.revision, tokenizer=None, hf_overrides=None,
                          quantization=spec.quantization, speculative_config=None, **changes)


def _error(message: str) -> ConfigError:
    return ConfigError(FIELD, message)


def _parse(value: Any) -> SpeculativeConfig:
    if isinstance(value, SpeculativeConfig):
        return value
    value = decode_json_option(FIELD, value)
    if not isinstance(value, dict):
        raise _error(f"must be a JSON object such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                     f"got {value!r}")
    try:
        return msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise _error(str(exc).replace("$.", "")) from None


def _method(spec: SpeculativeConfig) -> str:
    method = spec.method
    if method is None:
        if spec.model is None:
            raise _error("say which proposer to use: \"method\" is one of " + ", ".join(METHODS))
        method = "ngram" if spec.model in ("ngram", "[ngram]") else "draft_model"
    if method not in METHODS:
        raise _error(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    return method


def _lookup_bounds(spec: SpeculativeConfig) -> tuple[int, int]:
    low, high = spec.prompt_lookup_min, spec.prompt_lookup_max
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if value is not None and (isinstance(value, bool) or value < 1):
            raise _error(f"{name} must be at least 1, got {value!r}")
    if low is None and high is None:
        low = high = _DEFAULT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    if low > high:
        raise _error(f"prompt_lookup_min ({low}) is larger than prompt_lookup_max ({high})")
    return low, high


def _check_k(k: int | None) -> int:
    if k is None:
        raise _error("num_speculative_tokens is required (the draft tokens each step verifies, 1 to "
                     f"{MAX_SPECULATIVE_TOKENS})")
    if isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise _error(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {k!r}")
    return k


def _check_limits(spec: SpeculativeConfig) -> dict[str, Any]:
    """vLLM's limits on when to draft, checked: the fields to keep."""
    if spec.enforce_eager:
        raise _error("enforce_eager is the engine's (--enforce-eager): the draft runs as the target does")
    for name in ("max_model_len", "disable_by_batch_size"):
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or value < 2):
            raise _error(f"{name} must be at least 2, got {value!r}")
    return {"max_model_len": spec.max_model_len, "disable_by_batch_size": spec.disable_by_batch_size}


def resolve_speculative_config(value: Any, tensor_parallel_size: int = 1) -> SpeculativeConfig | None:
    """The checked config (method and n-gram bounds filled in), None when `value` is None."""
    if value is None:
        return None
    spec = _parse(value)
    method = _method(spec)
    k = _check_k(spec.num_speculative_tokens)
    limits = _check_limits(spec)
    if method == "ngram":
        if spec.model not in (None, "ngram", "[ngram]"):
            raise _error(f"method \"ngram\" proposes from the request's own tokens; it takes no model "
                         f"(got {spec.model!r})")
        unused = [name for name in ("draft_tensor_parallel_size", "revision", "quantization")
                  if getattr(spec, name) not in (None, 1)]
        if unused:
            raise _error(f"method \"ngram\" runs no draft model: {unused[0]} does not apply")
        low, high = _lookup_bounds(spec)
        return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=low,
                                 prompt_lookup_max=high, **limits)
    if spec.prompt_lookup_min is not None or spec.prompt_lookup_max is not None:
        raise _error(f"prompt_lookup_min/max apply to method \"ngram\" only, not {method!r}")
    if not spec.model:
        raise _error(f"method {method!r} needs \"model\": the " + ("draft model's path" if method == "draft_model"
                                                                 else "head's path or hub id"))
    draft_tp = tensor_parallel_size if spec.draft_tensor_parallel_size is None else spec.draft_tensor_parallel_size
    if draft_tp not in (1, tensor_parallel_size):
        raise _error(f"draft_tensor_parallel_size must be 1 (the whole draft on every rank) or the target's "
                     f"tensor_parallel_size {tensor_parallel_size} (the draft split as the target is), got {draft_tp!r}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, model=spec.model,
                             draft_tensor_parallel_size=draft_tp, revision=spec.revision,
                             quantization=spec.quantization, **limits)
