"""The random path: temperature, top-k, top-p, min-p, then one draw per row, all without a host sync.

Truncation keeps, per row, the tokens whose logit reaches a threshold: the k-th largest logit
(top-k), the logit of the last token of the smallest prefix of the top-k-renormalised distribution
whose mass reaches p (top-p), and `max + log(min_p)` (min-p, since p_i >= min_p * p_max is
l_i >= l_max + log(min_p)). One masked fill applies the largest of them. Tokens tied with a
threshold stay in.

Sorting is the expensive part (torch sorts a 49k vocabulary in ~3 ms on a CPU core), so it happens
only for top-k or top-p and only over the candidates that can survive: `topk(max top-k)` when every
top-p row also has a top-k, the whole vocabulary otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..sampling_params import SamplingParams
from .transfer import DeviceTarget, row_column, to_device

_NEG_INF = float("-inf")
# How a random row's token is drawn, as the platform says (`PlatformCaps.sampling_draw`).
DRAWS = ("exponential_race", "inverse_cdf")
# A platform's one-pass exponential race: fp32 logits [B, V] -> int64 ids [B], each row's token drawn
# with probability softmax(row), the logits left as they were (`Sampler(race=...)`).
RaceKernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class RandomParams:
    """Per-row settings as `[B, 1]` columns; a column is None when no row uses it. Greedy rows of a
    mixed batch carry neutral values (their token is the argmax taken before this path runs)."""

    greedy_rows: torch.Tensor | None
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    log_min_p: torch.Tensor | None
    num_candidates: int
    generators: dict[int, torch.Generator]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        greedy: Sequence[bool],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        target: DeviceTarget,
    ) -> "RandomParams":
        top_k = [0 if g or p.top_k >= vocab_size else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        return cls(
            greedy_rows=to_device(list(greedy), torch.bool, target) if any(greedy) else None,
            temperature=row_column([1.0 if g else p.temperature for p, g in zip(params, greedy)], 1.0, target),
            top_k=row_column(top_k, 0, target, torch.int64),
            top_p=row_column(top_p, 1.0, target),
            log_min_p=row_column(
                [_NEG_INF if g or p.min_p == 0.0 else math.log(p.min_p) for p, g in zip(params, greedy)],
                _NEG_INF,
                target,
            ),
            num_candidates=_num_candidates(top_k, top_p, vocab_size),
            generators={
                row: gen for row, (gen, g) in enumerate(zip(generators, greedy)) if gen is not None and not g
            },
        )


def _num_candidates(top_k: list[int], top_p: list[float], vocab_size: int) -> int:
    """How many of the largest logits truncation must see: 0 when neither top-k nor top-p is used."""
    if any(p < 1.0 and k == 0 for k, p in zip(top_k, top_p)):
        return vocab_size
    return max(top_k)


def _top_p_threshold(ranked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`ranked` holds each row's candidates in descending order, top-k already masked to -inf."""
    probs = ranked.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # The top candidate always stays (mass 0 before it), unless NaN logits made every mass NaN.
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = ranked.gather(1, num_kept - 1)
    # A p of 1 keeps everything; the fp32 cumsum can overshoot 1 and would drop a tail of ~0 mass.
    return threshold.masked_fill_(top_p >= 1.0, _NEG_INF)


def _ranked(logits: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """The `num_candidates` largest logits of each row, in descending order."""
    if num_candidates == logits.shape[1]:
        # A full sort beats topk(V): 3.3 vs 4.8 ms on an H100 for 256 x 152k.
        return logits.sort(dim=-1, descending=True).values
    return logits.topk(num_candidates, dim=-1).values


def _thresholds(logits: torch.Tensor, params: RandomParams) -> list[torch.Tensor]:
    thresholds = []
    row_max = None
    if params.num_candidates:
        ranked = _ranked(logits, params.num_candidates)
        row_max = ranked[:, :1]
        if params.top_k is not None:
            kth = ranked.gather(1, (params.top_k - 1).clamp_(min=0))
            kth.masked_fill_(params.top_k == 0, _NEG_INF)
            thresholds.append(kth)
            if params.top_p is not None:
                ranked = ranked.masked_fill(ranked < kth, _NEG_INF)
        if params.top_p is not None:
            thresholds.append(_top_p_threshold(ranked, params.top_p))
    if params.log_min_p is not None:
        if row_max is None:
            row_max = logits.amax(dim=-1, keepdim=True)
        thresholds.append(row_max + params.log_min_p)
    return thresholds


def truncate(logits: torch.Tensor, params: RandomParams) -> None:
    """Mask, in place, every token that top-k, top-p or min-p rules out."""
    thresholds = _thresholds(logits, params)
    if not thresholds:
        return
    threshold = thresholds[0]
    for other in thresholds[1:]:
        threshold = torch.maximum(threshold, other)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def _log_exponential_noise(like: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """log(q) for q ~ Exp(1), in `like`'s dtype: q = -log1p(-w) for w uniform in [tiny, 1), drawn in
    float64. A light token wins the race only by a tiny q (at p = 1e-7 against a favourite's 0.4,
    q under ~3e-7), which -log(u) of an fp32 u cannot give: u's last steps below 1 are 6e-8 apart,
    and those few values would decide such tokens' share. q is finite and positive, so a masked
    (-inf) token always loses. (`exponential_` would do on a GPU, but on CPU it is ~6x slower than
    `uniform_` and can return 0, which would hand a masked token the win: -inf - log 0 is NaN.)"""
    w = torch.empty(like.shape, dtype=torch.float64, device=like.device)
    low = torch.finfo(torch.float64).tiny
    if len(generators) < like.shape[0]:
        w.uniform_(low, 1.0)
    for row, generator in generators.items():
        w[row].uniform_(low, 1.0, generator=generator)
    return w.neg_().log1p_().neg_().log_().to(like.dtype)


def _inverse_cdf_draw(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform u per row, scaled to (0, total mass]; the token is the first whose cumulative
    mass reaches u. A masked token adds no mass, so no u can land on it. The sum runs in fp64 so
    that tokens far below fp32's resolution of the running total keep their share."""
    weights = logits.sub(logits.amax(dim=-1, keepdim=True)).exp_()
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    draws = torch.empty(logits.shape[0], 1, dtype=torch.float64, device=logits.device)
    if len(generators) < logits.shape[0]:
        draws.uniform_()
    for row, generator in generators.items():
        draws[row].uniform_(generator=generator)
    targets = draws.neg_().add_(1.0).mul_(cdf[:, -1:])
    # NaN logits (a diverged activation) make the cdf NaN, where searchsorted answers one past the
    # vocabulary: an id no embedding holds. The clamp keeps it a token, as argmax does for greedy rows.
    return torch.searchsorted(cdf, targets).clamp_(max=logits.shape[-1] - 1).squeeze(1)


def temper_and_truncate(logits: torch.Tensor, params: RandomParams) -> None:
    """Divide by the temperature and mask what top-k, top-p and min-p rule out, in place: the
    logits of the distribution a random row samples from (speculative verification reads it too)."""
    if params.temperature is not None:
        logits.div_(params.temperature)
    truncate(logits, params)


def sample_random(logits: torch.Tensor, params: RandomParams, draw: str) -> torch.Tensor:
    """One token per row with probability softmax(logits)_i after temperature and truncation.
    Modifies `logits` in place. `draw` is one of `DRAWS`, chosen by the platform.

    "exponential_race" (GPUs): token i wins argmax(p_i / q_i), q_i ~ Exp(1), with probability
    p_i. It runs in log space, argmax(logit_i - log q_i), which needs no softmax (a pass over the
    batch fewer, and on a GPU torch gives a single row's softmax to one block). "inverse_cdf"
    (CPUs, where the race's vocabulary-sized noise dominates: 16 x 49k takes 7.8 ms, one uniform
    per row and an inverse-CDF search 1.2 ms): each row draws a single number instead."""
    temper_and_truncate(logits, params)
    return draw_tokens(logits, params.generators, draw)


def draw_tokens(logits: torch.Tensor, generators: dict[int, torch.Generator], draw: str,
                race: RaceKernel | None = None) -> torch.Tensor:
    """One token per row with probability softmax(logits)_i, drawn the platform's way (see
    `sample_random`); a seeded row draws from its generator. May modify `logits` in place.
    `race`, where the platform has one, runs the exponential race in one pass over the logits;
    seeded rows are then redrawn here, from their generators, as the torch form draws them."""
    if draw == "inverse_cdf":
        return _inverse_cdf_draw(logits, generators)
    if race is None:
        return logits.sub_(_log_exponential_noise(logits, generators)).argmax(dim=-1)
    tokens = race(logits)
    for row, generator in generators.items():
        tokens[row] = draw_tokens(logits[row:row + 1], {0: generator}, draw)[0]
    return tokens
