"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the
request's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs.

The match is numpy over the whole context: for each earlier position e, `run` says whether the
last j + 1 tokens end at e as they end the context, one vectorised comparison per j (at most
`prompt_lookup_max` of them), so no Python loop visits tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def match_lengths(tokens: np.ndarray, max_n: int) -> np.ndarray:
    """For each position e < L - 1: how many of the context's last tokens (up to `max_n`) also
    end at e, i.e. the largest n with tokens[e - n + 1 : e + 1] == tokens[L - n :]."""
    length = tokens.shape[0]
    earlier = tokens[:-1]
    run = earlier == tokens[-1]
    lengths = run.astype(np.int32)
    for j in range(1, min(max_n, length - 1)):
        run[:j] = False
        run[j:] &= earlier[:length - 1 - j] == tokens[length - 1 - j]
        if not run.any():
            break
        lengths += run
    return lengths


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` draft tokens continuing `tokens` (int array), empty when no n-gram of length
    >= min_n recurs. Longest match first, the latest occurrence among equals."""
    if tokens.shape[0] < min_n + 1:
        return tokens[:0]
    lengths = match_lengths(tokens, max_n)
    # Longest first, then latest: the score orders by length, then position.
    best = int(np.argmax(lengths.astype(np.int64) * tokens.shape[0] + np.arange(lengths.shape[0])))
    if lengths[best] < min_n:
        return tokens[:0]
    return tokens[best + 1: best + 1 + k]


class NgramProposer:
    """Proposes from each request's own tokens (prompt and output); runs on the host."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """Drafts continuing a request whose tokens are `token_ids`, at most `limit` (<= k) of
        them (fewer near max_tokens or the context's end)."""
        if limit <= 0:
            return []
        context = np.asarray(token_ids, dtype=np.int64)
        return propose_ngram(context, self.min_n, self.max_n, min(limit, self.k)).tolist()
