"""The encoder's share of a step (vLLM's encoder budget): how much image encoding one step may
start, and how many encoder rows the worker must keep for chunks still to come.

The worker encodes an image whole in the step whose chunk reaches its first placeholder, and keeps
the rows, pinned in its encoder cache, until the request's later chunks have taken them all
(`corectl.multimodal.step`). So a chunk that starts an image spends the image's length of the
step's encoder budget, and one that stops inside it also pins that many rows of the cache until a
later chunk moves past it. An image that does not fit what is left of either ends the chunk just
before its first placeholder (the text before it still runs), unless nothing else is spent or
pinned: an image larger than a whole budget runs rather than never.

A chunk that starts inside an image whose rows the worker has not kept (a request admitted after
a prefix hit that ends inside the image, or resumed after preemption: `admitted`) must have the
image encoded again, so it is charged like one that starts the image. The worker may still hold
its rows (its cache keeps finished images while room lasts): the charge is then for nothing, but
never too little, so a step never encodes more than a budget's worth of images at once.

`whole_images` (a model whose image tokens attend to each other both ways, Gemma 3): a chunk never
ends inside an image, it stops before it; the scheduler refuses a token budget smaller than one
image, so an image always fits a step of its own.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..request import Request
from .inputs import MultiModalInput

# Encoder rows the worker's cache keeps: ~117 MB at Qwen2.5-VL-7B's hidden size (3584) in bf16.
ENCODER_CACHE_ROWS = 16384


def pinned_rows(requests: Iterable[Request]) -> int:
    """Encoder rows the worker keeps for these requests: images their prefill entered, not left."""
    return sum(item.length for req in requests for item in req.mm_inputs
               if item.offset < req.num_computed_tokens < item.end)


@dataclass
class EncoderBudget:
    """One step's: `compute` encoder tokens it may start, `cache_rows` the worker's encoder cache
    holds, `pinned` of them taken by the running requests' begun images (set by the scheduler the
    first time a request with images asks)."""

    compute: int
    cache_rows: int
    pinned: int | None = None
    spent: int = 0
    whole_images: bool = False

    def fit(self, items: list[MultiModalInput], num_computed: int, num_tokens: int, admitted: bool = False) -> int:
        """How much of the chunk num_computed .. num_computed + num_tokens the budget has room for;
        `admitted`: the request's first chunk since it was admitted (or resumed)."""
        end = num_computed + num_tokens
        for item in items:
            if item.end <= num_computed or item.offset < num_computed and not admitted:
                continue  # computed already, or begun by an earlier chunk: its rows are pinned
            if item.offset >= end:
                break
            split = item.end > end
            if (split and self.whole_images or self.spent and self.spent + item.length > self.compute
                    or split and self.pinned and self.pinned + item.length > self.cache_rows):
                return max(item.offset - num_computed, 0)
            self.spent += item.length
            self.pinned += item.length if split else 0
        return num_tokens
