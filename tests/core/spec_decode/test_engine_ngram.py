"""Speculation through the whole engine on SmolLM2 (real weights): n-gram greedy output token-exact
against the engine without it (alone, in a mixed batch, from the prefix cache, through
preemption), stops and max_tokens inside a draft, penalties / min_tokens / logprobs, seeded
sampling with n > 1, constrained requests (JSON schema, regex) that speculate, token-exact and
valid; and a draft model (the target itself). Both sides run the default 4-bit path (plumbing, corectl
against corectl), except the draft model test: its draft is the dense HF folder, the same weights as an
fp32 target only."""
from __future__ import annotations

import json
import re

import pytest
from corectl import LLM, SamplingParams
from corectl.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
COPY = [{"role": "user", "content": "Copy this sentence word for word: The quick brown fox jumps over the lazy "
                                    "dog near the old river bank, and the dog sleeps on."}]


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(max_model_len=1024, kv_cache_memory_gib=0.25, max_num_seqs=32, speculative_config=NGRAM)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _accepted(llm) -> int:
    return llm.engine.scheduler.make_stats().spec_decode_num_accepted_tokens


def test_greedy_is_token_exact_alone_batched_and_from_the_prefix_cache(llm_int4, spec_llm):
    tok = spec_llm.get_tokenizer()
    copy = tok.encode_chat(COPY)
    others = [tok.encode(f"Story number {i}: once upon a time" + " and then" * i) for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=28)] + [
        SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(5)]
    reference = _tokens(llm_int4, [copy] + others, params)
    accepted_before = _accepted(spec_llm)
    assert _tokens(spec_llm, [copy], params[0]) == reference[:1]
    assert _accepted(spec_llm) > accepted_before, "the copy prompt must have been sped up by accepted drafts"
    assert _tokens(spec_llm, [copy] + others, params) == reference
    again = spec_llm.generate([copy], params[0], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference[0]
    stats = spec_llm.engine.scheduler.make_stats()
    assert stats.kv_cache_usage == 0.0
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens


def test_max_tokens_and_stop_tokens_inside_a_draft(llm_int4, spec_llm):
    copy = spec_llm.get_tokenizer().encode_chat(COPY)
    full = _tokens(llm_int4, [copy], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    # One batch (each request drafts on its own; batched greedy output is token-exact, see above).
    lengths, stop = (1, 2, 7, 13), full[9]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop]))
    *cut, stopped = (o.outputs[0] for o in spec_llm.generate([copy] * len(params), params, use_tqdm=False))
    for max_tokens, out in zip(lengths, cut):
        assert out.token_ids == full[:max_tokens] and out.finish_reason == "length"
    assert stopped.token_ids == full[: full.index(stop) + 1] and stopped.finish_reason == "stop"


def test_stop_strings_inside_a_draft_cut_tokens_and_logprobs_where_plain_decoding_does(llm_int4, spec_llm):
    """A verify step brings several tokens; the one that completes a stop string ends the output there:
    the tokens after it leave the token ids and logprobs (usage counts them) as without speculation."""
    copy = spec_llm.get_tokenizer().encode_chat(COPY)
    words = ["quick", "fox", "jumps", "over", "lazy dog"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[word], logprobs=1) for word in words]
    accepted_before = _accepted(spec_llm)
    plain = [o.outputs[0] for o in llm_int4.generate([copy] * len(words), params, use_tqdm=False)]
    spec = [o.outputs[0] for o in spec_llm.generate([copy] * len(words), params, use_tqdm=False)]
    assert _accepted(spec_llm) > accepted_before
    for word, ours, theirs in zip(words, spec, plain):
        assert theirs.finish_reason == "stop" and theirs.stop_reason == word, theirs
        assert (ours.text, ours.token_ids, ours.finish_reason, ours.stop_reason) == (
            theirs.text, theirs.token_ids, theirs.finish_reason, theirs.stop_reason), word
        assert len(ours.logprobs) == len(ours.token_ids)
        assert ours.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-2)


def test_vllms_draft_limits_stop_drafting_past_a_batch_size_and_a_length(llm_int4):
    """disable_by_batch_size: no drafts while that many requests run; max_model_len: none for a request
    that long. The output stays token-exact either way."""
    copy = llm_int4.get_tokenizer().encode_chat(COPY)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    reference = _tokens(llm_int4, [copy], params)
    by_batch = LLM(max_model_len=1024, kv_cache_memory_gib=0.25,
                   speculative_config={**NGRAM, "disable_by_batch_size": 2})
    assert _tokens(by_batch, [copy] * 3, params) == reference * 3
    assert by_batch.engine.scheduler.make_stats().spec_decode_num_draft_tokens == 0
    assert _tokens(by_batch, [copy], params) == reference and _accepted(by_batch) > 0
    by_length = LLM(max_model_len=1024, kv_cache_memory_gib=0.25,
                    speculative_config={**NGRAM, "max_model_len": len(copy)})
    assert _tokens(by_length, [copy], params) == reference
    assert by_length.engine.scheduler.make_stats().spec_decode_num_draft_tokens == 0


def test_penalties_min_tokens_and_logprobs_match_plain_decoding(llm_int4, spec_llm):
    copy = spec_llm.get_tokenizer().encode_chat(COPY)
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.05, frequency_penalty=0.2,
                            min_tokens=20, logprobs=2)
    plain = llm_int4.generate([copy], params, use_tqdm=False)[0].outputs[0]
    spec = spec_llm.generate([copy], params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    assert len(spec.logprobs) == len(spec.token_ids)
    for ours, theirs in zip(spec.logprobs, plain.logprobs):
        assert ours.keys() == theirs.keys()
        for token, entry in ours.items():
            assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-3)
            assert entry.rank == theirs[token].rank


def test_seeded_sampling_with_n_is_reproducible(spec_llm):
    copy = spec_llm.get_tokenizer().encode_chat(COPY)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=7, max_tokens=16)
    first = [o.token_ids for o in spec_llm.generate([copy], params, use_tqdm=False)[0].outputs]
    second = [o.token_ids for o in spec_llm.generate([copy], params, use_tqdm=False)[0].outputs]
    assert first == second and all(len(t) > 0 for t in first)
    assert len(set(map(tuple, first))) > 1


def test_constrained_requests_speculate_and_stay_token_exact(llm_int4, spec_llm):
    tok = spec_llm.get_tokenizer()
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    json_params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    phone_params = SamplingParams(temperature=0.0, max_tokens=20,
                                  structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{3}-[0-9]{4}"))
    # Prompts that hold the answer, so n-gram drafts are proposed, and partly refused by the grammars.
    person = tok.encode_chat([{"role": "user", "content": 'Repeat this JSON exactly: {"name":"Ada Lovelace",'
                                                          '"age":36} and {"name":"Alan Turing","age":41}'}])
    phone = tok.encode_chat([{"role": "user", "content": "Write the number 555-867-5309 back, digits only: "
                                                         "555-867-5309"}])
    prompts, params = [person, phone, tok.encode_chat(COPY)], [json_params, phone_params,
                                                                SamplingParams(temperature=0.0, max_tokens=24)]
    reference = _tokens(llm_int4, prompts, params)
    accepted_before = _accepted(spec_llm)
    alone = _tokens(spec_llm, prompts[:2], params[:2])
    assert alone == reference[:2]
    assert _accepted(spec_llm) > accepted_before, "the constrained requests must have accepted drafts"
    outputs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    value = json.loads(outputs[0].outputs[0].text)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{3}-[0-9]{4}", outputs[1].outputs[0].text)
    assert spec_llm.engine.scheduler.make_stats().kv_cache_usage == 0.0
    # Async scheduling: the masks of a step are filled after the step before is read, with drafts.
    overlapped = LLM(max_model_len=512, kv_cache_memory_gib=0.05, async_scheduling=True,
                     speculative_config=NGRAM)
    assert overlapped.engine.async_scheduling and _tokens(overlapped, prompts, params) == reference
    assert _accepted(overlapped) > 0


def test_preemption_resumes_with_identical_output(llm_int4):
    tok = llm_int4.get_tokenizer()
    # 8 requests of 48 tokens (3 blocks each) in a cache of 18 blocks: some must be preempted and resumed.
    prompts = [tok.encode(f"Count from 1 to 30, number {i}: 1, 2, 3, 4, 5,") for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = _tokens(llm_int4, prompts, params)
    small = LLM(max_model_len=64, kv_cache_memory_gib=0.0125, enable_prefix_caching=False,
                speculative_config=NGRAM)
    assert small.engine.info.num_kv_blocks < 8 * 3
    assert _tokens(small, prompts, params) == reference
    stats = small.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.kv_cache_usage == 0.0


def test_draft_model_speculation_is_token_exact(llm_fp32, default_model_dir):
    # The target as its own draft: every greedy draft is accepted, k + 1 tokens a step.
    tok = llm_fp32.get_tokenizer()
    prompts = [tok.encode("The three primary colours are")]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = _tokens(llm_fp32, prompts, params)
    spec = {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3}
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_gib=0.05, speculative_config=spec)
    assert _tokens(llm, prompts, params) == reference
    stats = llm.engine.scheduler.make_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
