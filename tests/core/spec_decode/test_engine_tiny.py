"""Both proposers on a tiny random Llama (`llama-tiny`, dummy weights): greedy output token-exact
against the engine without speculation at batch 1, in a mixed batch, and through preemption in a
small KV cache, under synchronous and async scheduling (a stop token and max_tokens inside a
draft); a draft model with another vocabulary is refused naming both sides."""
from __future__ import annotations

import json
import random

import pytest
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from support.models import build_random_checkpoint

# fp32: bf16 sums depend on the batch's shape, and a random model's logits are near ties.
TINY = dict(model="llama-tiny", load_format="dummy", platform="cpu", dtype="float32")
METHODS = {
    # The same preset and seed: the draft is the target itself, so every greedy draft is accepted.
    "draft_model": {"method": "draft_model", "model": "llama-tiny", "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
}


def _requests(seed: int, count: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(5, 40))] for _ in range(count)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 50), ignore_eos=True) for _ in range(count)]
    return prompts, params


def _small_cache(method: str) -> float:
    """A KV budget of 12 target blocks of 16 tokens (fp32): a draft model, the target itself,
    takes as much again out of the budget."""
    return 0.0001 * (2 if method == "draft_model" else 1)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(isolated_env):
    return LLM(**TINY, kv_cache_memory_gib=0.01)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_is_token_exact_alone_batched_and_preempted(reference, method):
    prompts, params = _requests(0, 8)
    expected = _tokens(reference, prompts, params)
    llm = LLM(**TINY, kv_cache_memory_gib=0.01, speculative_config=METHODS[method])
    assert _tokens(llm, prompts[:1], params[:1]) == expected[:1]
    assert _tokens(llm, prompts, params) == expected
    stats = llm.engine.scheduler.make_stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.kv_cache_usage == 0.0
    # 12 blocks of 16 tokens (fp32) for 8 requests of up to 90 tokens: requests are preempted and resumed.
    small = LLM(**TINY, kv_cache_memory_gib=_small_cache(method), max_model_len=128,
                speculative_config=METHODS[method])
    assert _tokens(small, prompts, params) == expected
    stats = small.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_async_scheduling_is_token_exact_with_stops_and_preemption(reference, method):
    prompts, params = _requests(2, 8)
    expected = _tokens(reference, prompts, params)
    # A stop token a few tokens in: with the draft model (every draft accepted) it ends a draft.
    stop = expected[0][5]
    params[0] = params[0].clone(stop_token_ids=[stop])
    expected[0] = expected[0][: expected[0].index(stop) + 1]
    llm = LLM(**TINY, kv_cache_memory_gib=_small_cache(method), max_model_len=128, async_scheduling=True,
              speculative_config=METHODS[method])
    assert llm.engine.async_scheduling
    assert _tokens(llm, prompts[:1], params[:1]) == expected[:1]
    # max_tokens 8..49 against k = 3: most requests end inside a draft; 12 blocks preempt some.
    assert _tokens(llm, prompts, params) == expected
    stats = llm.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0 and stats.kv_cache_usage == 0.0


def test_a_draft_with_another_vocabulary_is_refused_naming_both(isolated_env):
    # Checked from the draft's config, before its weights are built.
    spec = {"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match=r"'qwen3-0.6b' has a 151936-token vocabulary but the target 'llama-tiny' has 512"):
        LLM(**TINY, kv_cache_memory_gib=0.01, speculative_config=spec)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_draft_path_that_does_not_exist_is_the_speculative_configs_error(tmp_path, method):
    missing = str(tmp_path / "no-such-draft")
    spec = {"method": method, "model": missing, "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match=rf"speculative_config: the draft model or head: model path '{missing}' "
                                          "does not exist"):
        LLM(**TINY, kv_cache_memory_gib=0.01, speculative_config=spec)


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused_naming_a_token(tmp_path, default_model_dir):
    """Same vocabulary size, other tokens at two ids: every draft would be rejected, so start-up says so;
    a draft with the target's tokenizer in a folder of its own starts."""
    target = build_random_checkpoint("llama", tmp_path / "target", default_model_dir)
    same = build_random_checkpoint("llama", tmp_path / "same", default_model_dir, seed=1)
    other = build_random_checkpoint("llama", tmp_path / "other", default_model_dir, seed=2)
    tokenizer_file = other / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (token for token, token_id in vocab.items() if token_id in (300, 301))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    tokenizer_file.write_text(json.dumps(tokenizer))
    settings = dict(model=str(target), dtype="float32", max_model_len=128, kv_cache_memory_gib=0.01, num_threads=1)

    def spec(draft):
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}

    with pytest.raises(ConfigError, match=r"another tokenizer than the target .*: token 300 is '.*' in the "
                                          r"draft's and '.*' in the target's"):
        LLM(**settings, speculative_config=spec(other))
    out = LLM(**settings, speculative_config=spec(same)).generate(
        [[5, 77, 300]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
