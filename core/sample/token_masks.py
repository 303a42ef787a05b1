"""Logit edits that forbid tokens: vLLM's `allowed_token_ids` and `bad_words`.

`allowed_token_ids` keeps a row's listed tokens and masks the rest: the listed cells are saved,
the rows filled with -inf, and the saved cells written back (three indexed kernels for the batch).

`bad_words` forbids the last token of a word whenever the output so far ends with the word's
other tokens (a one-token word is always forbidden), as vLLM's bad-words processor does. Whether
a prefix matches is read from the host's copy of the output; under async scheduling the newest
token may still be on the device only, and then the cell is forbidden on the condition that it
equals the word's token before the last (`BadWords.unread_*`), evaluated on the device.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..sampling_params import SamplingParams
from .transfer import DeviceTarget, to_device

_NEG_INF = float("-inf")


class AllowedTokens(NamedTuple):
    """The rows that restrict their tokens, and the flat `[B * V]` cells they keep."""

    rows: torch.Tensor
    kept: torch.Tensor


class BadWords(NamedTuple):
    """`banned`: flat cells forbidden outright. `unread_cells` are forbidden where the row's unread
    token (`unread_ids[unread_slot]`, the step's `UnreadOutputTokens.token_ids`) equals `unread_token`."""

    banned: torch.Tensor | None
    unread_cells: torch.Tensor | None = None
    unread_slot: torch.Tensor | None = None
    unread_token: torch.Tensor | None = None
    unread_ids: torch.Tensor | None = None


def build_allowed_tokens(params: Sequence[SamplingParams], vocab_size: int,
                         target: DeviceTarget) -> AllowedTokens | None:
    rows: list[int] = []
    kept: list[int] = []
    for row, p in enumerate(params):
        if p.allowed_token_ids:
            rows.append(row)
            kept.extend(row * vocab_size + token for token in set(p.allowed_token_ids))
    if not rows:
        return None
    return AllowedTokens(to_device(rows, torch.int64, target), to_device(kept, torch.int64, target))


def _ends_with(history: Sequence[int], prefix: Sequence[int]) -> bool:
    return not prefix or (len(history) >= len(prefix) and list(history[len(history) - len(prefix):]) == list(prefix))


def build_bad_words(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                    unread_rows: dict[int, int], unread_ids: torch.Tensor | None, vocab_size: int,
                    target: DeviceTarget) -> BadWords | None:
    """`unread_rows` maps a row whose newest output token is still on the device to its slot in
    `unread_ids`; `output_token_ids[row]` is the history the host holds."""
    banned: list[int] = []
    cells: list[int] = []
    slots: list[int] = []
    tokens: list[int] = []
    for row, (p, history) in enumerate(zip(params, output_token_ids)):
        for word in p.bad_words_token_ids or ():
            cell = row * vocab_size + word[-1]
            if row not in unread_rows or len(word) == 1:
                if _ends_with(history, word[:-1]):
                    banned.append(cell)
            elif _ends_with(history, word[:-2]):
                cells.append(cell)
                slots.append(unread_rows[row])
                tokens.append(word[-2])
    if not banned and not cells:
        return None
    if not cells:
        return BadWords(to_device(banned, torch.int64, target))
    return BadWords(to_device(banned, torch.int64, target) if banned else None,
                    to_device(cells, torch.int64, target), to_device(slots, torch.int64, target),
                    to_device(tokens, torch.int64, target), unread_ids)


def keep_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    flat = logits.view(-1)
    saved = flat.index_select(0, allowed.kept)
    logits.index_fill_(0, allowed.rows, _NEG_INF)
    flat.index_copy_(0, allowed.kept, saved)


def ban_bad_words(logits: torch.Tensor, bad: BadWords) -> None:
    flat = logits.view(-1)
    if bad.banned is not None:
        flat.index_fill_(0, bad.banned, _NEG_INF)
    if bad.unread_cells is not None:
        hit = bad.unread_ids.index_select(0, bad.unread_slot) == bad.unread_token
        # An additive -inf/0 edit, so a cell listed by two words takes both conditions.
        penalty = torch.zeros(hit.shape, dtype=logits.dtype, device=logits.device).masked_fill_(hit, _NEG_INF)
        flat.index_add_(0, bad.unread_cells, penalty)
