"""`logprobs_mode` (vLLM's --logprobs-mode) through the engine on SmolLM2 (real weights): processed
logprobs are those of the distribution sampled from (a repetition penalty moves them off the raw
ones, top-k's cut shows as -inf), the same with n-gram speculation (verify steps) as without."""
from __future__ import annotations

import math

import pytest
from corectl import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
COPY = [{"role": "user", "content": "Copy this sentence word for word: The quick brown fox jumps over the lazy "
                                    "dog near the old river bank, and the dog sleeps on."}]


@pytest.fixture(scope="module")
def processed():
    return LLM(max_model_len=1024, kv_cache_memory_gib=0.25, logprobs_mode="processed_logprobs")


@pytest.fixture(scope="module")
def processed_spec():
    return LLM(max_model_len=1024, kv_cache_memory_gib=0.25, logprobs_mode="processed_logprobs",
               speculative_config=NGRAM)


def _one(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_processed_logprobs_follow_the_penalty_and_match_under_speculation(llm_int4, processed, processed_spec):
    copy = processed.get_tokenizer().encode_chat(COPY)
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, logprobs=3)
    raw, ours, spec = (_one(llm, copy, params) for llm in (llm_int4, processed, processed_spec))
    assert ours.token_ids == raw.token_ids == spec.token_ids
    moved = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(ours.logprobs, raw.logprobs, ours.token_ids)]
    assert max(moved) > 1e-2, "a repetition penalty must move some processed logprob off the raw one"
    for mine, theirs in zip(spec.logprobs, ours.logprobs):
        assert mine.keys() == theirs.keys()
        for token, entry in mine.items():
            assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-3)


def test_top_k_cut_shows_as_minus_infinity(processed):
    prompt = processed.get_tokenizer().encode("Once upon a time")
    out = _one(processed, prompt, SamplingParams(temperature=0.8, top_k=3, seed=1, max_tokens=6, logprobs=5))
    for position in out.logprobs:
        ranked = sorted(position.values(), key=lambda e: e.rank)
        assert sum(math.exp(e.logprob) for e in ranked[:3]) == pytest.approx(1.0, abs=1e-4)
        assert all(e.logprob == -math.inf for e in ranked[3:5])


def test_logits_modes_refuse_what_ranks_samples_by_logprob():
    from corectl.beam_search import BeamSearchParams
    from corectl.errors import InvalidRequestError
    from corectl.server.http.errors import APIError
    from corectl.server.http.vllm_fields import check_ranking

    llm = LLM(max_model_len=256, kv_cache_memory_gib=0.05, logprobs_mode="raw_logits")
    with pytest.raises(InvalidRequestError, match="reports logits"):
        llm.beam_search(["Once upon a time"], BeamSearchParams(beam_width=2, max_tokens=2))
    out = _one(llm, llm.get_tokenizer().encode("Once"), SamplingParams(temperature=0.0, max_tokens=2, logprobs=1))
    assert out.logprobs[0][out.token_ids[0]].logprob > 0  # a raw logit, which no logprob can be
    with pytest.raises(APIError, match="best_of ranks samples by their logprobs"):
        check_ranking("best_of", "processed_logits")
    check_ranking("best_of", "processed_logprobs")
