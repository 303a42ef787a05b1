"""Verifying draft tokens on the device: speculative (rejection) sampling, Leviathan et al. 2023.

A request with k draft tokens d_0..d_{k-1} gets k + 1 target rows: row j holds the target's
distribution p_j for the token after d_0..d_{j-1}. Draft j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token comes from norm(max(0, p_j - q_j))
and the rest is dropped; when all k are accepted, row k gives a bonus token from p_k. The tokens
that come out are distributed exactly as sampling from the target alone. An n-gram draft has no
distribution: q_j is one-hot on d_j, so acceptance is p_j(d_j) and a rejection samples p_j
without d_j. Greedy rows accept a draft iff it is the argmax, and emit the argmax where not.

Rows are flat (`T = sum(k_i + 1)`, request after request, as the step's logits come); the
per-request prefix of accepted drafts is taken in a padded `[B, K + 1]` view, built from host
index arrays (`VerifyLayout`) so nothing is read back before the step's one result copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..sample.random_sampling import RaceKernel, draw_tokens
from ..sample.transfer import DeviceTarget, to_device


@dataclass(frozen=True, slots=True)
class VerifyLayout:
    """Index arrays of one verify step (device tensors): `draft_ids[t]` is the draft that flat row
    t checks (0 on a bonus row, `is_bonus`); `padded_rows[i, j]` is the flat row of request i's
    position j (its bonus row past its end), `valid[i, j]` whether that position exists;
    `flat_positions[t]` is row t's index in the flattened `[B, K + 1]` view."""

    draft_ids: torch.Tensor
    is_bonus: torch.Tensor
    padded_rows: torch.Tensor
    valid: torch.Tensor
    flat_positions: torch.Tensor

    @classmethod
    def build(cls, drafts: list[list[int]], target: DeviceTarget) -> "VerifyLayout":
        counts = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
        width = int(counts.max())
        offsets = np.cumsum(counts) - counts
        req_of_row = np.repeat(np.arange(len(drafts)), counts)
        position = np.arange(int(counts.sum())) - offsets[req_of_row]
        is_bonus = position == counts[req_of_row] - 1
        draft_ids = np.zeros(position.shape[0], dtype=np.int64)
        draft_ids[~is_bonus] = [token for d in drafts for token in d]
        columns = np.arange(width)
        padded_rows = offsets[:, None] + np.minimum(columns, counts[:, None] - 1)
        return cls(
            draft_ids=to_device(draft_ids, torch.int64, target),
            is_bonus=to_device(is_bonus, torch.bool, target),
            padded_rows=to_device(padded_rows, torch.int64, target),
            valid=to_device(columns < counts[:, None], torch.bool, target),
            flat_positions=to_device(req_of_row * width + position, torch.int64, target),
        )


@dataclass(frozen=True, slots=True)
class Verified:
    """`token_ids[i, :num_emitted[i]]` are request i's new tokens (accepted drafts, then one
    recovered or bonus token); `row_token_ids[t]` is the token emitted at flat row t (meaningful
    for the rows up to each request's first rejection)."""

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    row_token_ids: torch.Tensor


def _uniforms(num_rows: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    draws = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) < num_rows:
        draws.uniform_()
    for row, generator in generators.items():
        draws[row].uniform_(generator=generator)
    return draws


def _random_verdicts(logits: torch.Tensor, layout: VerifyLayout, draft_probs: torch.Tensor | None,
                     generators: dict[int, torch.Generator], draw: str,
                     race: RaceKernel | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [T] bool, recovered [T] int64) for rows sampling from softmax(logits).

    Each row's token is drawn first, the platform's way, and a bonus row draws from the target's
    logits themselves: a seeded request without drafts gets the token plain sampling gives it,
    whatever else the step verifies. The acceptance uniforms are drawn after."""
    probs = logits.softmax(dim=-1)
    drafted = layout.draft_ids.unsqueeze(1)
    p_draft = probs.gather(1, drafted).squeeze(1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        # p without the draft token; a bonus row keeps all of p.
        residual = probs.scatter(1, drafted, torch.where(layout.is_bonus, p_draft, 0.0).unsqueeze(1))
    else:
        q = draft_probs.masked_fill(layout.is_bonus.unsqueeze(1), 0.0)
        q_draft = q.gather(1, drafted).squeeze(1)
        residual = (probs - q).clamp_(min=0.0)
    # A row whose draft took all of p has nothing left to recover (and is always accepted).
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    recovered = draw_tokens(torch.where(layout.is_bonus.unsqueeze(1), logits, residual.log()), generators, draw,
                            race)
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=torch.finfo(q_draft.dtype).tiny), 0.0)
    accepted = (_uniforms(probs.shape[0], generators, probs.device) < ratio) & ~layout.is_bonus
    return accepted, recovered


def rejection_sample(logits: torch.Tensor, layout: VerifyLayout, *, greedy_rows: torch.Tensor | None,
                     all_greedy: bool, generators: dict[int, torch.Generator], draw: str,
                     draft_probs: torch.Tensor | None = None, race: RaceKernel | None = None) -> Verified:
    """Verify the drafts of a step. `logits` `[T, V]` fp32 are the target's after every edit,
    temperature and truncation (`corectl.sample.sampler.target_logits`); `greedy_rows` `[T]` marks
    greedy rows of a mixed batch (None: none, or every row when `all_greedy`); `generators` maps a
    seeded request's flat row to the generator of its output position (its recovered or bonus
    token's draw, then its accept draw); `draw` is the platform's way of drawing a token
    (`PlatformCaps.sampling_draw`), `race` its one-pass kernel if it has one; `draft_probs` `[T, V]`
    is the draft's distribution per row (None: one-hot drafts)."""
    if all_greedy:
        argmax = logits.argmax(dim=-1)
        accepted, recovered = (argmax == layout.draft_ids) & ~layout.is_bonus, argmax
    else:
        accepted, recovered = _random_verdicts(logits, layout, draft_probs, generators, draw, race)
        if greedy_rows is not None:
            argmax = logits.argmax(dim=-1)
            accepted = torch.where(greedy_rows, (argmax == layout.draft_ids) & ~layout.is_bonus, accepted)
            recovered = torch.where(greedy_rows, argmax, recovered)
    prefix = (accepted[layout.padded_rows] & layout.valid).long().cumprod(dim=1)
    num_accepted = prefix.sum(dim=1)
    token_ids = torch.where(prefix.bool(), layout.draft_ids[layout.padded_rows], recovered[layout.padded_rows])
    return Verified(token_ids, num_accepted + 1, token_ids.view(-1)[layout.flat_positions])
