"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the
request's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs.

The match is numpy over the whole context, no Python loop over tokens: one vectorised comparison
per n, kept only while some earlier position still matches, and the latest of the longest matches
taken from the last comparison. A request's tokens reach numpy through its `TokenHistory`, which
converts only the tokens new since its last step: converting a long context whole each step was
most of a step's drafting time (15 of 23 us a request at 1,100 tokens).
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
    earlier = tokens[:-1]
    # run[e]: the context's last n tokens also end at e, for the n reached so far.
    run = earlier == tokens[-1]
    if not run.any():
        return tokens[:0]
    n = 1
    while n < min(max_n, length - 1):
        longer = np.zeros_like(run)
        np.logical_and(run[n:], earlier[:length - 1 - n] == tokens[length - 1 - n], out=longer[n:])
        if not longer.any():
            break
        run, n = longer, n + 1
    if n < min_n:
        return tokens[:0]
    # The latest end among the longest matches.
    best = length - 2 - int(np.argmax(run[::-1]))
    return tokens[best + 1: best + 1 + k]


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
