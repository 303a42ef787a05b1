"""LLM.beam_search on SmolLM2: width 1 is greedy decoding, each beam's cumulative logprob is the sum
its tokens get when the whole sequence is scored as a prompt, and beams come best first."""
from __future__ import annotations

import math

import pytest
from corectl import BeamSearchParams, SamplingParams
from corectl.beam_search import beam_search_score
from corectl.errors import InvalidRequestError

PROMPT = "The capital of France is"


def test_width_one_is_greedy(llm_int4):
    greedy = llm_int4.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    beam = llm_int4.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=3, ignore_eos=True))[0]
    (only,) = beam.sequences
    assert only.tokens == greedy.prompt_token_ids + greedy.outputs[0].token_ids
    assert only.text == llm_int4.tokenizer.decode(only.tokens)


def test_beams_are_scored_by_their_tokens_logprobs_best_first(llm_int4):
    out = llm_int4.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=3, ignore_eos=True))[0]
    prompt_len = len(llm_int4.tokenizer.encode(PROMPT))
    assert len(out.sequences) == 3 and len({tuple(s.tokens) for s in out.sequences}) == 3
    scores = [beam_search_score(s.tokens, s.cum_logprob, None, 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    for seq in out.sequences:
        scored = llm_int4.generate([seq.tokens], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        positions = scored.prompt_logprobs[prompt_len:]
        total = sum(p[t].logprob for p, t in zip(positions, seq.tokens[prompt_len:]))
        assert math.isclose(total, seq.cum_logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_bad_params_are_refused():
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
