"""One token per row from a step's logits, vLLM V1's order of operations.

logit_bias -> min_tokens suppression -> penalties -> allowed_token_ids -> bad_words; greedy rows take the argmax of those logits,
random rows go on through temperature, top-k, top-p, min-p and the platform's draw. Logprobs
come from the raw logits (vLLM V1's default), before any of it, or, by the sampler's
`logprobs_mode`, from the logits each row samples from (`LOGPROBS_MODES`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LOGPROBS_MODES
from .logprobs import LogprobsTensors, gather_logprobs, reported_values
from .metadata import SamplingMetadata
from .penalties import apply_penalties
from .random_sampling import DRAWS, RaceKernel, draw_tokens, temper_and_truncate
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


def processed_and_reported(logits: torch.Tensor, meta: SamplingMetadata,
                           logprobs_mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`target_logits` of `logits` (in place where it can), and the values `logprobs_mode` reports,
    taken before (raw modes) or after (processed modes) the processing; None when no row asks for
    logprobs. The sampler and speculative verification both sample this way."""
    wanted = meta.max_num_logprobs is not None
    raw = logprobs_mode.startswith("raw_")
    reported = reported_values(logits, logprobs_mode) if wanted and raw else None
    processed = target_logits(logits, meta)
    if wanted and not raw:
        reported = reported_values(processed, logprobs_mode)
    return processed, reported


class Sampler:
    """Stateless; per-request state (generators, token histories) arrives in `SamplingMetadata`.
    `draw` is how random rows draw their token (`PlatformCaps.sampling_draw`, one of `DRAWS`), and
    `race` the platform's one-pass kernel for the exponential race, if it has one;
    `logprobs_mode` what sampled logprobs report (one of `LOGPROBS_MODES`)."""

    def __init__(self, draw: str = "exponential_race", logprobs_mode: str = "raw_logprobs",
                 race: RaceKernel | None = None):
        if draw not in DRAWS:
            raise ValueError(f"unknown sampling draw {draw!r}; expected one of {', '.join(DRAWS)}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs mode {logprobs_mode!r}; expected one of {', '.join(LOGPROBS_MODES)}")
        self.draw = draw
        self.logprobs_mode = logprobs_mode
        self.race = race if draw == "exponential_race" else None

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from fp32 `logits` [B, V]. `logits` may be modified in place."""
        logits, reported = processed_and_reported(logits, meta, self.logprobs_mode)
        if meta.random is None:
            sampled = logits.argmax(dim=-1)
        else:
            # Greedy rows keep temperature 1 and no truncation (RandomParams): their processed logits
            # are their edited ones, whose argmax is taken before the draw changes them.
            greedy = None if meta.random.greedy_rows is None else logits.argmax(dim=-1)
            sampled = draw_tokens(logits, meta.random.generators, self.draw, self.race)
            if greedy is not None:
                sampled = torch.where(meta.random.greedy_rows, greedy, sampled)
        if reported is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(reported, sampled, meta.max_num_logprobs))
