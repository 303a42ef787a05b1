"""Per-token logit edits: OpenAI's `logit_bias` and the stop-token suppression behind `min_tokens`.

Both touch a handful of (row, token) cells, so they travel as one flat index into the
contiguous `[B, V]` logits (`row * V + token`) and cost one indexed kernel each. The token ids are
inside the vocabulary: intake checked the request's (`corectl.engine.intake.check_request`), and
a check here would raise inside the engine's step, ending every request.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..sampling_params import SamplingParams
from .transfer import DeviceTarget, to_device


class LogitBias(NamedTuple):
    """Cells of the flattened logits and the bias to add to each."""

    flat_index: torch.Tensor
    values: torch.Tensor


def build_logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, target: DeviceTarget
) -> LogitBias | None:
    if not any(p.logit_bias for p in params):
        return None
    flat_index: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            flat_index.append(row * vocab_size + token)
            values.append(bias)
    return LogitBias(to_device(flat_index, torch.int64, target), to_device(values, torch.float32, target))


def build_min_tokens(
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_id: int | None,
    vocab_size: int,
    target: DeviceTarget,
) -> torch.Tensor | None:
    """Flat indices of the stop tokens to forbid in rows that have not yet produced `min_tokens` tokens.

    EOS counts as a stop token unless the request ignores it (vLLM's rule: an ignored EOS cannot
    end the request, so there is nothing to hold back). A row under a grammar is skipped: its
    bitmask already holds the stop tokens back unless the grammar allows nothing else.
    """
    flat_index: list[int] = []
    for row, (p, num_output) in enumerate(zip(params, num_output_tokens)):
        if num_output >= p.min_tokens or p.structured_outputs is not None:
            continue
        stops = set(p.stop_token_ids or ())
        if eos_token_id is not None and not p.ignore_eos:
            stops.add(eos_token_id)
        for token in stops:
            flat_index.append(row * vocab_size + token)
    if not flat_index:
        return None
    return to_device(flat_index, torch.int64, target)


def add_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    logits.view(-1).index_add_(0, bias.flat_index, bias.values)


def suppress_tokens(logits: torch.Tensor, flat_index: torch.Tensor) -> None:
    logits.view(-1).index_fill_(0, flat_index, float("-inf"))
