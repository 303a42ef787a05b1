"""One token per row from a step's logits, vLLM V1's order of operations.

logit_bias -> min_tokens suppression -> penalties -> allowed_token_ids -> bad_words; greedy rows take the argmax of those logits,
random rows go on through temperature, top-k, top-p, min-p and the platform's draw. Logprobs
come from the raw logits (vLLM V1's default), before any of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .logprobs import LogprobsTensors, gather_logprobs
from .metadata import SamplingMetadata
from .penalties import apply_penalties
from .random_sampling import DRAWS, RandomParams, sample_random, temper_and_truncate
from .token_edits import add_logit_bias, suppress_tokens
from .token_masks import ban_bad_words, keep_allowed_tokens


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def edit_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Apply logit_bias, min_tokens, penalties, allowed_token_ids and bad_words; returns the edited
    logits (in place where it can)."""
    logits = logits.contiguous()
    if meta.logit_bias is not None:
        add_logit_bias(logits, meta.logit_bias)
    if meta.min_tokens is not None:
        suppress_tokens(logits, meta.min_tokens)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    if meta.allowed is not None:
        keep_allowed_tokens(logits, meta.allowed)
    if meta.bad_words is not None:
        ban_bad_words(logits, meta.bad_words)
    return logits


def target_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits of the distribution each row samples from, after every edit and (random rows)
    temperature and truncation; a greedy row's token is their argmax. Speculative verification
    measures draft tokens against them."""
    if meta.edits_logits:
        logits = edit_logits(logits, meta)
    if meta.random is not None:
        temper_and_truncate(logits, meta.random)
    return logits


def _sample(logits: torch.Tensor, params: RandomParams, draw: str) -> torch.Tensor:
    if params.greedy_rows is None:
        return sample_random(logits, params, draw)
    greedy = logits.argmax(dim=-1)
    return torch.where(params.greedy_rows, greedy, sample_random(logits, params, draw))


class Sampler:
    """Stateless; per-request state (generators, token histories) arrives in `SamplingMetadata`.
    `draw` is how random rows draw their token (`PlatformCaps.sampling_draw`, one of `DRAWS`)."""

    def __init__(self, draw: str = "exponential_race"):
        if draw not in DRAWS:
            raise ValueError(f"unknown sampling draw {draw!r}; expected one of {', '.join(DRAWS)}")
        self.draw = draw

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from fp32 `logits` [B, V]. `logits` may be modified in place."""
        raw_logprobs = None if meta.max_num_logprobs is None else logits.log_softmax(dim=-1)
        if meta.edits_logits:
            logits = edit_logits(logits, meta)
        if meta.random is None:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = _sample(logits, meta.random, self.draw)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs))
