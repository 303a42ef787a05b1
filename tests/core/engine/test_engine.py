"""End-to-end engine behaviour on the real model (its default 4-bit CPU path: the engine compared with
itself; preemption on the random-weight preset): batch invariance, preemption, sampling, stops."""
from __future__ import annotations

import anyio
import pytest
from corectl import LLM, EngineConfig, SamplingParams
from corectl.errors import ConfigError, InvalidRequestError
from support.engines import TINY

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _mixed_batch(tok, target_ids):
    others = [tok.encode(f"Story number {i}: once upon a time" + " and then" * i) for i in range(15)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8 + i) for i in range(15)]
    return [target_ids] + others, [GREEDY] + params


def test_batch_invariance_alone_batched_and_prefix_hit(llm_int4):
    tok = llm_int4.get_tokenizer()
    target = tok.encode_chat([{"role": "user", "content": "Name a planet that has rings, and why."}])
    alone = llm_int4.generate([target], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    prompts, params = _mixed_batch(tok, target)
    batched = llm_int4.generate(prompts, params, use_tqdm=False)[0]
    hits_before = llm_int4.engine.scheduler.make_stats().prefix_cache_hits
    again = llm_int4.generate([target], GREEDY, use_tqdm=False)[0]
    assert batched.outputs[0].token_ids == alone
    assert again.outputs[0].token_ids == alone
    assert again.num_cached_tokens > 0
    assert llm_int4.engine.scheduler.make_stats().prefix_cache_hits > hits_before
    assert llm_int4.engine.scheduler.make_stats().kv_cache_usage == 0.0


def test_preemption_resumes_with_identical_output():
    """On the random-weight preset (512 bytes of KV a token): 8 requests of 60 tokens in a cache of
    ~400 tokens are preempted and recomputed, and give the tokens of a cache that holds them all."""
    prompts = [[(11 * i + j) % 500 + 10 for j in range(12)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    roomy = LLM(**TINY, dtype="float32", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    small = LLM(**{**TINY, "kv_cache_memory_gib": 0.0002}, dtype="float32", max_model_len=256,
                enable_prefix_caching=False)
    outputs = small.generate(prompts, params, use_tqdm=False)
    stats = small.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert stats.kv_cache_usage == 0.0


def test_seeded_sampling_is_reproducible_and_n_shares_prompt(llm_int4):
    tok = llm_int4.get_tokenizer()
    prompt = tok.encode("The three best things about autumn are" + " really" * 40)
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12)
    hits_before = llm_int4.engine.scheduler.make_stats().prefix_cache_hits
    first = llm_int4.generate([prompt], params, use_tqdm=False)[0]
    assert llm_int4.engine.scheduler.make_stats().prefix_cache_hits > hits_before
    second = llm_int4.generate([prompt, tok.encode("unrelated")], [params, GREEDY], use_tqdm=False)[0]
    texts = [o.token_ids for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert texts == [o.token_ids for o in second.outputs]
    assert len(set(map(tuple, texts))) > 1


def test_top_k_one_equals_greedy(llm_int4):
    prompt = llm_int4.get_tokenizer().encode("The best way to learn a language is")
    # One batch: the top-k = 1 row must pick the greedy row's tokens at every step.
    topk = SamplingParams(temperature=1.5, top_k=1, seed=7, max_tokens=24, ignore_eos=True)
    greedy, sampled = llm_int4.generate([prompt, prompt], [GREEDY, topk], use_tqdm=False)
    assert sampled.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_stop_strings_min_tokens_and_stop_token_ids(llm_int4):
    tok = llm_int4.get_tokenizer()
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    # The variants run as one batch (outputs are batch-invariant: test_batch_invariance_alone_batched_and_prefix_hit);
    # the stop token is the greedy answer's second token, which is the same in any batch.
    greedy = dict(temperature=0.0, max_tokens=16)
    full = llm_int4.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    second_token = full.token_ids[1]
    variants = [SamplingParams(**greedy, stop=["Paris"]),
                SamplingParams(**greedy, stop=["Paris"], include_stop_str_in_output=True),
                SamplingParams(**greedy, stop_token_ids=[second_token]),
                SamplingParams(**greedy, skip_special_tokens=False),
                SamplingParams(temperature=0.0, max_tokens=40, min_tokens=len(full.token_ids) + 3),
                SamplingParams(temperature=0.0, max_tokens=40, min_tokens=len(full.token_ids), stop=["Paris"])]
    cut, kept, by_id, special, longer, late = (o.outputs[0] for o in llm_int4.generate(
        [prompt] * len(variants), variants, use_tqdm=False))
    # A stop string completed within the first min_tokens tokens does not end the output (vLLM's rule).
    assert late.text.startswith(full.text) and len(late.token_ids) >= len(full.token_ids)
    assert "Paris" in full.text
    assert cut.text == full.text[: full.text.index("Paris")]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", "Paris")
    assert kept.text.endswith("Paris")
    eos = llm_int4.engine.eos_token_id
    assert full.finish_reason == "stop" and full.token_ids[-1] == eos
    assert len(longer.token_ids) >= len(full.token_ids) + 3
    assert eos not in longer.token_ids[: len(full.token_ids) + 2]
    assert by_id.token_ids == full.token_ids[:2] and by_id.stop_reason == second_token
    # A stop token's text is not output, special or not, unless include_stop_str_in_output.
    assert by_id.text == tok.decode(full.token_ids[:1])
    assert special.token_ids == full.token_ids and special.text == full.text


def test_prompt_logprobs_and_length_finish(llm_int4):
    prompt = llm_int4.get_tokenizer().encode("One two three four five")
    out = llm_int4.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, ignore_eos=True),
                            use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, token in zip(out.prompt_logprobs[1:], prompt[1:]):
        assert token in pos and len(pos) <= 3
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_bad_input_is_rejected_and_engine_keeps_working(llm_int4):
    with pytest.raises(InvalidRequestError) as err:
        llm_int4.generate([[5] * 2000], GREEDY, use_tqdm=False)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=7)
    assert llm_int4.engine.scheduler.make_stats().kv_cache_usage == 0.0
    assert llm_int4.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_async_client_streams_and_aborts_on_consumer_exit():
    from corectl.engine.client import EngineClient

    async def main():
        config = EngineConfig(max_model_len=512, kv_cache_memory_gib=0.05)
        async with EngineClient.in_process(config) as client:
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            seen = 0
            async for out in client.generate("Count from one to a hundred:", params, "abandoned"):
                seen += len(out.outputs[0].token_ids)
                if seen >= 5:
                    break
            full = [o async for o in client.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4,
                                                                           ignore_eos=True), "second")]
            assert full[-1].finished and sum(len(o.outputs[0].token_ids) for o in full) == 4
            with anyio.fail_after(10):
                while client.stats.num_running or client.stats.kv_cache_usage:
                    await anyio.sleep(0.05)

    anyio.run(main)
