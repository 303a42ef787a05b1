"""Prompt-lookup proposals against a plain reading of the rule (the longest recurring n-gram of
the context's last n tokens, n in [min, max], its latest occurrence), on random contexts over
small vocabularies where n-grams recur; and the per-request history that feeds it, which converts
only the tokens new since its last step."""
from __future__ import annotations

import gc
import random

import numpy as np
import pytest
from corectl.spec_decode.ngram import NgramProposer, TokenHistory, propose_ngram


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest first; an occurrence ends before the last token
            if tokens[end - n + 1: end + 1] == suffix:
                return tokens[end + 1: end + 1 + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 4), (2, 3), (5, 5)])
def test_proposals_follow_the_longest_then_latest_match(vocab, min_n, max_n):
    rng = random.Random(vocab * 100 + min_n * 10 + max_n)
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        got = propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, 4).tolist()
        assert got == _reference(tokens, min_n, max_n, 4), tokens


def test_a_history_appends_what_is_new_and_matches_the_list():
    history, tokens = TokenHistory(), list(range(5))
    for step in range(200):
        assert history.view(tokens).tolist() == tokens
        tokens += [step % 7] * (step % 3)
    assert history.view(tokens).tolist() == tokens


def test_the_proposer_keeps_a_history_a_request_and_drops_it_with_the_request():
    class Request:  # the scheduler's requests are plain objects the proposer keys by identity
        pass

    proposer = NgramProposer(3, 2, 2)
    request, tokens = Request(), [1, 2, 3, 1, 2]
    assert proposer.propose(request, tokens, 3) == [3, 1, 2]
    tokens += [3, 9]
    assert proposer.propose(request, tokens, 3) == []
    tokens += [1, 2]
    assert proposer.propose(request, tokens, 2) == [3, 9]
    assert len(proposer._histories) == 1
    del request
    gc.collect()
    assert len(proposer._histories) == 0
