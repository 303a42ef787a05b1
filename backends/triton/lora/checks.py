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
    if check_indices:
        check_range("segments.slots", segments.slots, 0, num_slots)
        check_range("segments.starts", segments.starts, 0, max(num_tokens, 1))
        check_range("segments end", segments.starts + segments.lens, 1, num_tokens + 1)
        require(segments.num_segments == 0 or int(segments.lens.max()) <= segments.max_len,
                f"segments.max_len {segments.max_len} is below the longest segment")
