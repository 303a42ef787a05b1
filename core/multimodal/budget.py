"""The encoder's share of a step (vLLM's encoder budget): how much image encoding one step may do.

The worker encodes an image whole in the step whose chunk reaches its first placeholder, and keeps
the rows until the request's later chunks have taken them all (`corectl.multimodal.step`). So a
chunk that starts an image spends the image's whole length of the step's encoder budget; one that
continues an image begun earlier spends nothing. An image that does not fit what the step has left
ends the chunk just before its first placeholder (the text before it still runs), unless it is the
step's first image: one larger than the whole budget runs alone rather than never.
"""
from __future__ import annotations

from .inputs import MultiModalInput


def fit_encoder_budget(items: list[MultiModalInput], num_computed: int, num_tokens: int,
                       budget: int, spent: int) -> tuple[int, int]:
    """(tokens of the chunk num_computed .. num_computed + num_tokens that fit, encoder tokens
    they spend) with `spent` of the step's `budget` already spent by other chunks."""
    used = 0
    for item in items:
        if item.offset < num_computed:
            continue  # begun by an earlier chunk: its rows are cached
        if item.offset >= num_computed + num_tokens:
            break
        if spent + used > 0 and spent + used + item.length > budget:
            return item.offset - num_computed, used
        used += item.length
    return num_tokens, used
