"""Speculation on two pipeline stages (gloo, SmolLM2's real weights). n-gram: greedy output equal to
one device without speculation, drafts accepted on the way, a seeded sampled request with n = 2
equal to the same speculation on one device, the prefix cache hit on a second pass and every block
back in the pool; each stage places a verify step's accepted drafts from the scheduler's tokens,
which the last stage alone read (`RequestStates.apply`). A draft model on the first stage: its
drafts reach the last stage, which verifies them."""
from __future__ import annotations

import pytest
from corectl import LLM, SamplingParams
from support.spec_decode import tokens_and_stats

pytestmark = pytest.mark.slow
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
COPY = [{"role": "user", "content": "Repeat exactly: the river runs past the mill, the mill turns, and the river "
                                    "runs on past the mill."}]
ENGINE = dict(max_model_len=512, kv_cache_memory_gib=0.1, max_num_seqs=8)


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[list[int]]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, n=2, seed=7)
    outputs = []
    for _ in range(2):  # the second pass meets the prefixes the first cached
        done = llm.generate(prompts, [greedy] * (len(prompts) - 1) + [seeded], use_tqdm=False)
        outputs += [[list(c.token_ids) for c in out.outputs] for out in done]
    return outputs


def test_two_stages_speculate_as_one_device():
    one = LLM(**ENGINE)
    tok = one.get_tokenizer()
    prompts = [tok.encode_chat(COPY), tok.encode("List the days of the week: Monday, Tuesday, Wednesday, Monday,"),
               tok.encode("Hello, my name is"), tok.encode_chat(COPY)]
    plain = _run(one, prompts)
    del one
    spec_one = LLM(speculative_config=NGRAM, **ENGINE)
    spec_reference = _run(spec_one, prompts)
    del spec_one
    staged = LLM(speculative_config=NGRAM, pipeline_parallel_size=2, **ENGINE)
    try:
        outputs = _run(staged, prompts)
        stats = staged.engine.scheduler.make_stats()
    finally:
        staged.engine.executor.shutdown()
    greedy_rows = [i for i in range(len(outputs)) if i % len(prompts) != len(prompts) - 1]
    assert [outputs[i] for i in greedy_rows] == [plain[i] for i in greedy_rows]
    assert outputs == spec_reference
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_cache_usage == 0.0


def test_a_draft_model_on_the_first_stage_feeds_the_last(default_model_dir):
    """The target as its own draft (fp32) at PP = 2: the first stage drafts with the whole draft
    model, the drafts travel to the last stage ahead of the activations and are verified there.
    Every greedy draft of the target itself is accepted, which placeholders or misplaced drafts
    would not be; the tokens equal one device without speculation."""
    options = dict(dtype="float32", max_model_len=256, kv_cache_memory_gib=0.05)
    one = LLM(**options)
    tok = one.get_tokenizer()
    prompts = [tok.encode("The three primary colours are"), tok.encode("Once upon a time, in a small village,")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    spec = {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3}
    tokens, stats = tokens_and_stats(LLM(pipeline_parallel_size=2, speculative_config=spec, **options), prompts, params)
    assert tokens == expected
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
