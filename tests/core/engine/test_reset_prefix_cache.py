"""`LLM.reset_prefix_cache()` (vLLM's): a prompt the cache held is computed again, to the same tokens."""
from corectl import SamplingParams

PROMPT = "Tell me about the rivers of Europe, from the Rhine to the Danube and on. " * 3


def test_a_reset_makes_the_next_prompt_compute_its_prefix(llm_int4):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = llm_int4.generate([PROMPT], params, use_tqdm=False)[0]
    cached = llm_int4.generate([PROMPT], params, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0
    llm_int4.reset_prefix_cache()
    fresh = llm_int4.generate([PROMPT], params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert first.outputs[0].token_ids == cached.outputs[0].token_ids == fresh.outputs[0].token_ids
