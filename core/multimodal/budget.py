"""The encoder's share of a step (vLLM's encoder budget): how much image encoding one step may
start, and the encoder-cache room the images it encodes take (`cache_manager.py`).

The worker encodes an image whole in the step whose chunk first overlaps it and keeps its rows in
its encoder cache, which the scheduler's `EncoderCacheManager` mirrors. A chunk that overlaps an
image the cache holds (a repeated image, one an earlier chunk of the same request began, one a
prefix hit or a preemption ended inside) costs no encoding: the request references the entry until
its prefill moves past it. An image the cache lacks spends its length of the step's compute budget
(`max_num_batched_tokens`) and needs room in the cache, which unreferenced entries give up least
recently used first. An image that fits neither ends the chunk just before its first placeholder
(the text before it still runs; a waiting request whose chunk starts inside it waits), unless
nothing else is spent or held: an image larger than a whole budget runs alone rather than never.

`whole_images` (a model whose image tokens attend to each other both ways, Gemma 3): a chunk never
ends inside an image, it stops before it; the scheduler refuses a token budget smaller than one
image, so an image always fits a step of its own.

The cache changes once, when the step is emitted (`commit`), for the requests the step kept: one
that fits images and is then left out (no KV room, preempted in the same step) claims nothing.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..request import Request
from .cache_manager import EncoderCacheManager
from .inputs import MultiModalInput

# Encoder rows the worker's cache keeps: ~117 MB at Qwen2.5-VL-7B's hidden size (3584) in bf16.
ENCODER_CACHE_ROWS = 16384


class EncoderBudget:
    """One step's: `compute` encoder rows it may start (`spent` so far), the cache's rows it holds."""

    def __init__(self, compute: int, cache: EncoderCacheManager, whole_images: bool = False):
        self.compute = compute
        self.cache = cache
        self.whole_images = whole_images
        self.spent = 0
        # Rows no image of this step may evict: referenced when the step began (taken at the first
        # image, so a preemption meanwhile only leaves it high), then idle entries hit and new images.
        self.held: int | None = None
        self._counted: set[str] = set()
        # Per request, the images its chunk overlaps: (hash, rows, end).
        self._claims: dict[str, list[tuple[str, int, int]]] = {}

    def fit(self, req: Request, num_computed: int, num_tokens: int) -> int:
        """How much of the request's chunk num_computed .. num_computed + num_tokens the budget has room for."""
        end = num_computed + num_tokens
        claims = self._claims[req.request_id] = []
        for item in req.mm_inputs:
            if item.end <= num_computed:
                continue
            if item.offset >= end:
                break
            split = item.offset >= num_computed and item.end > end
            if split and self.whole_images or not self._charge(item):
                return max(item.offset - num_computed, 0)
            claims.append((item.hash, item.length, item.end))
        return num_tokens

    def _charge(self, item: MultiModalInput) -> bool:
        """Whether the step may read the image: cached or already counted, or room to encode it."""
        key, rows = item.hash, item.length
        if self.held is None:
            self.held = self.cache.referenced_rows
        if key in self._counted or key in self.cache and not self.cache.is_idle(key):
            return True
        if key not in self.cache:
            no_room = self.held and self.held + rows > self.cache.capacity_rows
            if no_room or self.spent and self.spent + rows > self.compute:
                return False
            self.spent += rows
        self.held += rows
        self._counted.add(key)
        return True

    def commit(self, requests: Iterable[Request]) -> None:
        """Apply the step to the cache once the requests' `num_computed_tokens` include it: every
        image a chunk overlaps is referenced (those cached first, so no image the step reads is
        evicted for another), the new ones added; those a prefill moved past are released."""
        claims = [(req, self._claims[req.request_id]) for req in requests if self._claims.get(req.request_id)]
        for req, items in claims:
            for key, _, _ in items:
                if key in self.cache:
                    self.cache.reference(key, req.request_id)
        for req, items in claims:
            for key, rows, _ in items:
                if key not in self.cache:
                    self.cache.add(key, rows)
                self.cache.reference(key, req.request_id)
        for req, items in claims:
            kept = {key for key, _, end in items if end > req.num_computed_tokens}
            for key in dict.fromkeys(key for key, _, _ in items if key not in kept):
                self.cache.release(key, req.request_id)
