"""Grammar-constrained rows: a step's next-token bitmask applied to the logits on the device.

The engine fills one int32 bitmask for the step's constrained rows (`GrammarBitmask`, xgrammar's
layout: bit `t % 32` of word `t // 32` allows token `t`). Here it is unpacked with torch ops and
every forbidden logit becomes -inf, before anything else reads the logits (so logprobs are those
of the constrained distribution, as in vLLM). It runs on whatever device holds the logits and reads
nothing back; rows without a grammar are not touched. Tokens beyond the mask's words (a logits
vocabulary padded past the tokenizer's) are forbidden.
"""
from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 `[R, W]` words -> bool `[R, vocab_size]`, True where the token is allowed."""
    num_rows = bitmask.shape[0]
    # Little-endian words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7, lowest bit first.
    as_bytes = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    allowed = ((as_bytes.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.cat([allowed, allowed.new_zeros(num_rows, vocab_size - width)], dim=1)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Set the logits a row's grammar forbids to -inf, in place. `logits` `[B, V]`; `bitmask`
    int32 `[R, W]` on the logits' device; `rows` int64 `[R]`, the logits row of each mask row
    (None: the mask covers every row, in order)."""
    forbidden = ~unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(forbidden, float("-inf"))
        return
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))
