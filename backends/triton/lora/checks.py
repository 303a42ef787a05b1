"""Argument checks shared by the LoRA shrink and expand launchers."""
from __future__ import annotations

import torch
from corectl.lora.punica import LoRASegments

from ..checks import check_index, check_range, check_same_device, require


def check_slots(token_slots: torch.Tensor, num_tokens: int, num_slots: int, segments: LoRASegments | None,
                check_indices: bool) -> None:
    """token_slots [T] int32 (-1: base); segments, when given, cover rows of [0, T) with slots."""
    check_index("token_slots", token_slots, 1, (torch.int32,))
    require(token_slots.shape[0] == num_tokens,
            f"token_slots has {token_slots.shape[0]} rows for {num_tokens} tokens")
    if check_indices:
        check_range("token_slots", token_slots, -1, num_slots)
    if segments is None:
        return
    for name in ("starts", "lens", "slots"):
        check_index(f"segments.{name}", getattr(segments, name), 1, (torch.int32,))
        require(getattr(segments, name).shape[0] == segments.num_segments,
                f"segments.{name} must have one entry per segment ({segments.num_segments})")
    check_same_device(token_slots=token_slots, starts=segments.starts, lens=segments.lens, slots=segments.slots)
    # Sorted tiles index `order` (zero-length ones are padding); plain segments index token rows.
    order = segments.order
    if order is not None:
        check_index("segments.order", order, 1, (torch.int32,))
        check_same_device(token_slots=token_slots, order=order)
    if check_indices:
        check_range("segments.slots", segments.slots, 0, num_slots)
        live = segments.lens > 0
        ends, positions = segments.starts[live] + segments.lens[live], num_tokens if order is None else order.shape[0]
        check_range("segments.starts", segments.starts[live], 0, max(positions, 1))
        check_range("segments end", ends, 1, positions + 1)
        if order is not None and ends.numel():
            check_range("segments.order", order[:int(ends.max())], 0, num_tokens)
        require(segments.num_segments == 0 or int(segments.lens.max()) <= segments.max_len,
                f"segments.max_len {segments.max_len} is below the longest segment")
