"""What the sampler needs for one step, built from per-request parameters.

Each part is decided by plain Python flags first and built only when some row needs it, so an
all-greedy batch with nothing to apply carries no tensors at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..sampling_params import SamplingParams
from .penalties import PenaltyParams
from .random_sampling import RandomParams
from .token_edits import LogitBias, build_logit_bias, build_min_tokens
from .token_masks import AllowedTokens, BadWords, build_allowed_tokens, build_bad_words
from .transfer import DeviceTarget, to_device


def is_plain_greedy(p: SamplingParams) -> bool:
    """A row the sampler answers with a bare argmax: nothing edits its logits, nothing is drawn and
    no logprobs are wanted. A batch of only such rows can use `PLAIN_GREEDY` without `build`."""
    return (p.greedy and p.logprobs is None and not p.logit_bias and not p.needs_penalties
            and p.min_tokens == 0 and not p.allowed_token_ids and not p.bad_words_token_ids)


def reads_prompt_ids(p: SamplingParams) -> bool:
    """Whether `build` reads this row's prompt ids (callers may pass an empty list otherwise)."""
    return p.repetition_penalty != 1.0


def reads_output_ids(p: SamplingParams) -> bool:
    """Whether `build` reads this row's output ids (callers may pass an empty list otherwise)."""
    return p.needs_penalties or p.min_tokens > 0 or bool(p.bad_words_token_ids)


def _check_rows(params: Sequence[SamplingParams], **per_row: Sequence) -> None:
    for name, values in per_row.items():
        if len(values) != len(params):
            raise ValueError(f"{name} has {len(values)} rows for {len(params)} sampling params")


@dataclass(frozen=True, slots=True)
class UnreadOutputTokens:
    """Output tokens the host has not read yet (async scheduling): one per row in `rows`, its id
    in `token_ids` on the device. Penalties count them there; min_tokens needs only their number."""

    rows: list[int]
    token_ids: torch.Tensor


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """`random` is None when every row is greedy; `min_tokens` holds flat `[B * V]` indices of the
    stop tokens to forbid this step; `max_num_logprobs` is None when no row wants logprobs;
    `allowed` and `bad_words` are vLLM's `allowed_token_ids` and `bad_words` (`token_masks`)."""

    random: RandomParams | None
    logit_bias: LogitBias | None
    min_tokens: torch.Tensor | None
    penalties: PenaltyParams | None
    max_num_logprobs: int | None
    allowed: AllowedTokens | None = None
    bad_words: BadWords | None = None

    @property
    def all_greedy(self) -> bool:
        return self.random is None

    @property
    def edits_logits(self) -> bool:
        return (self.logit_bias is not None or self.min_tokens is not None or self.penalties is not None
                or self.allowed is not None or self.bad_words is not None)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_id: int | None,
        vocab_size: int,
        target: DeviceTarget,
        unread: UnreadOutputTokens | None = None,
    ) -> "SamplingMetadata":
        """One row per request that samples this step. `prompt_token_ids[i]` is read only where
        `reads_prompt_ids` and `output_token_ids[i]` only where `reads_output_ids` holds;
        `generators[i]` (for seeded requests) only for random rows. `unread` adds output tokens
        whose ids are still on the device to the rows' histories."""
        _check_rows(
            params, prompt_token_ids=prompt_token_ids, output_token_ids=output_token_ids, generators=generators
        )
        greedy = [p.greedy for p in params]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        num_output = [len(ids) for ids in output_token_ids]
        penalties = PenaltyParams.build(params, prompt_token_ids, output_token_ids, vocab_size, target)
        unread_rows = {} if unread is None else {row: slot for slot, row in enumerate(unread.rows)}
        bad_words = None
        if any(p.bad_words_token_ids for p in params):
            bad_words = build_bad_words(params, output_token_ids, unread_rows,
                                        None if unread is None else unread.token_ids, vocab_size, target)
        if unread is not None:
            for row in unread.rows:
                num_output[row] += 1
            if penalties is not None:
                rows = to_device(unread.rows, torch.int64, target)
                penalties = penalties.with_output_tokens(rows, unread.token_ids, vocab_size)
        return cls(
            random=None if all(greedy) else RandomParams.build(params, greedy, generators, vocab_size, target),
            logit_bias=build_logit_bias(params, vocab_size, target),
            min_tokens=build_min_tokens(params, num_output, eos_token_id, vocab_size, target),
            penalties=penalties,
            max_num_logprobs=max(requested) if requested else None,
            allowed=build_allowed_tokens(params, vocab_size, target),
            bad_words=bad_words,
        )


PLAIN_GREEDY = SamplingMetadata(random=None, logit_bias=None, min_tokens=None, penalties=None, max_num_logprobs=None)
