"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the
request's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs.

The match is numpy over the whole context, no Python loop over tokens: one vectorised comparison
finds where the context's last token occurred before, and each longer n is checked at those
candidates only. A request's tokens reach numpy through its `TokenHistory`, which converts only
the tokens new since its last step: converting a long context whole each step was most of a
step's drafting time (15 of 23 us a request at 1,100 tokens).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` draft tokens continuing `tokens` (int array), empty when no n-gram of length
    >= min_n recurs. Longest match first, the latest occurrence among equals."""
    length = tokens.shape[0]
    if length < min_n + 1:
        return tokens[:0]
    # Earlier positions where the context's last token occurred: candidates for every n.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.shape[0] == 0:
        return tokens[:0]
    matched = np.ones(ends.shape[0], dtype=np.int64)
    for j in range(1, min(max_n, length - 1)):
        # Those that matched j tokens extend to j + 1 if the token j before them agrees.
        live = (matched == j) & (ends >= j)
        live[live] = tokens[ends[live] - j] == tokens[length - 1 - j]
        if not live.any():
            break
        matched += live
    # Longest first, then latest: the score orders by length, then position.
    best = int(np.argmax(matched * length + ends))
    if matched[best] < min_n:
        return tokens[:0]
    return tokens[ends[best] + 1: ends[best] + 1 + k]


class TokenHistory:
    """A request's tokens as a numpy array, brought up to date by appending: the scheduler's token
    list of a request only grows (its prompt, then each token emitted), so a step converts only
    what is new since the last."""

    def __init__(self):
        self._buffer = np.empty(0, dtype=np.int64)
        self._length = 0

    def view(self, token_ids: Sequence[int]) -> np.ndarray:
        """`token_ids` as an int64 array (a view of the buffer, valid until the next call)."""
        total = len(token_ids)
        start = self._length if total >= self._length else 0
        if total > self._buffer.shape[0]:
            grown = np.empty(max(total, 2 * self._buffer.shape[0]), dtype=np.int64)
            grown[:start] = self._buffer[:start]
            self._buffer = grown
        self._buffer[start:total] = token_ids[start:total]
        self._length = total
        return self._buffer[:total]


class NgramProposer:
    """Proposes from each request's own tokens (prompt and output); runs on the host."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # One history per request, gone with the request.
        self._histories: weakref.WeakKeyDictionary[object, TokenHistory] = weakref.WeakKeyDictionary()

    def propose(self, request: object, token_ids: Sequence[int], limit: int) -> list[int]:
        """Drafts continuing `request`, whose tokens are `token_ids` (the same growing list each
        step), at most `limit` (<= k) of them (fewer near max_tokens or the context's end)."""
        if limit <= 0:
            return []
        history = self._histories.get(request)
        if history is None:
            history = self._histories[request] = TokenHistory()
        return propose_ngram(history.view(token_ids), self.min_n, self.max_n, min(limit, self.k)).tolist()
