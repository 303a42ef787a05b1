"""A step's model inputs where prompts hold images: the token embeddings with each image's encoder
rows merged in at its placeholders, and M-RoPE's three position rows.

Each scheduled chunk takes the rows of the images it overlaps, so a chunked prefill that stops
inside an image takes the rest of its rows in a later step (the encoder cache keeps them: the
scheduler's `EncoderCacheManager` evicts no image a running request still needs). The images a
step needs and the cache lacks are encoded as one batch and stored.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .encoder_cache import EncoderCache
from .inputs import MultiModalInput, overlapping

if TYPE_CHECKING:
    from ..worker.request_states import HostStep, RequestStates


class MultiModalStep:
    """Owned by the model runner of a model with `encode_images` (a vision-language model)."""

    def __init__(self, model: Any, to_device: Callable[[list[np.ndarray]], list[torch.Tensor]]):
        self.model = model
        self.to_device = to_device
        self.cache = EncoderCache()
        self.uses_mrope = hasattr(model, "mrope_positions")
        # Gemma 3: an image's tokens attend to each other both ways (the scheduler keeps each whole).
        self.bidirectional = getattr(model, "bidirectional_image_tokens", None) is not None
        # M-RoPE: each image request's prompt positions [3, P] and the offset of later positions.
        self._mrope: dict[str, tuple[np.ndarray, int]] = {}

    def forget(self, req_ids: list[str], evicted: list[str]) -> None:
        """Requests the worker forgets, and images the scheduler evicted from the encoder cache."""
        for req_id in req_ids:
            self._mrope.pop(req_id, None)
        self.cache.drop(evicted)

    def prepare(self, host: HostStep, input_ids: torch.Tensor, positions: torch.Tensor, states: RequestStates,
                embeds: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(embeddings or None for a step without image rows, positions as the model takes them).
        Not `embeds`: the positions alone (a pipeline stage after the first, which embeds nothing)."""
        spans = self._spans(host, states)
        if any(states[r].mm_inputs for r in host.req_ids) and self.uses_mrope:
            positions = self.to_device([self._mrope_positions(host, states)])[0]
        if not spans or not embeds:
            return None, positions
        rows = self._encoder_rows([item for _, item, _, _ in spans])
        embeds = self.model.embed_input_ids(input_ids)
        for row, item, lo, hi in spans:
            embeds[row:row + hi - lo] = rows[item.hash][lo:hi]
        for key, value in rows.items():
            if key not in self.cache:
                self.cache.put(key, value)
        return embeds, positions

    def graph_positions(self, host: HostStep, states: RequestStates) -> np.ndarray | None:
        """The step's positions as one row, as a replayed decode graph takes them, or None when the
        step needs what a graph cannot give: image rows merged into its embeddings, or M-RoPE rows
        that differ. Outside an image the three rows agree (a text token's, and every position
        past the prompt, at index + offset), and M-RoPE over three equal rows is plain RoPE."""
        if self._spans(host, states):
            return None
        if not (self.uses_mrope and any(states[r].mm_inputs for r in host.req_ids)):
            return host.positions
        rows = self._mrope_positions(host, states)
        return rows[0] if (rows == rows[0]).all() else None

    def bidirectional_spans(self, host: HostStep, states: RequestStates) -> list[list[tuple[int, int]]] | None:
        """Per step sequence, the image spans its chunk holds (`AttentionBatch.bidirectional_spans`);
        None for a model whose images attend causally or a step without image tokens."""
        if not self.bidirectional:
            return None
        spans = []
        for req_id, n in zip(host.req_ids, host.query_lens):
            start = states[req_id].num_computed_tokens
            spans.append([(item.offset, item.end) for item in overlapping(states[req_id].mm_inputs, start, start + n)])
        return spans if any(spans) else None

    @staticmethod
    def _spans(host: HostStep, states: RequestStates) -> list[tuple[int, MultiModalInput, int, int]]:
        """(first step row, image, first and end row of the image's output) of each image part this
        step's chunks cover."""
        spans = []
        for req_id, q_start, n in zip(host.req_ids, host.query_starts, host.query_lens):
            state = states[req_id]
            start = state.num_computed_tokens
            for item in overlapping(state.mm_inputs, start, start + n):
                lo, hi = max(item.offset, start), min(item.end, start + n)
                spans.append((q_start + lo - start, item, lo - item.offset, hi - item.offset))
        return spans

    def _encoder_rows(self, items: list[MultiModalInput]) -> dict[str, torch.Tensor]:
        """Each image's encoder output: from the cache, or encoded now with the others it lacks."""
        rows: dict[str, torch.Tensor] = {}
        missing: dict[str, MultiModalInput] = {}
        for item in items:
            if item.hash in rows or item.hash in missing:
                continue
            cached = self.cache.get(item.hash)
            if cached is None:
                missing[item.hash] = item
            else:
                rows[item.hash] = cached
        if missing:
            rows.update(zip(missing, self.model.encode_images(list(missing.values()))))
        return rows

    def _mrope_positions(self, host: HostStep, states: RequestStates) -> np.ndarray:
        """[3, T]: text-only requests repeat their positions; an image request's prompt positions
        come from its table, later ones sit at index + offset."""
        out = np.repeat(host.positions[None], 3, axis=0)
        for req_id, q_start, n in zip(host.req_ids, host.query_starts, host.query_lens):
            state = states[req_id]
            if not state.mm_inputs:
                continue
            if req_id not in self._mrope:
                self._mrope[req_id] = self.model.mrope_positions(state.num_prompt_tokens, state.mm_inputs)
            table, offset = self._mrope[req_id]
            index = host.positions[q_start:q_start + n]
            inside = index < table.shape[1]
            out[:, q_start:q_start + n] = np.where(inside, table[:, np.minimum(index, table.shape[1] - 1)],
                                                   index + offset)
        return out
