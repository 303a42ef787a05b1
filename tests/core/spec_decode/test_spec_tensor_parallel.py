"""A draft model at tensor-parallel size 2 (gloo, two rank processes), split as the target is or
whole on every rank (`draft_tensor_parallel_size` 1), and whole on the first of two stages of two
ranks each: greedy output token-exact against the two ranks without speculation through
preemption, every draft of a draft equal to the target accepted, and the whole draft's larger
share of each KV block taken out of the budget. EAGLE heads at TP = 2 are in test_eagle.py."""
from __future__ import annotations

import random

import pytest
from corectl import LLM, SamplingParams
from support.spec_decode import tokens_and_stats

# fp32; the draft is the target's own checkpoint, so every greedy draft is accepted.
ENGINE = dict(platform="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=2, skip_tokenizer_init=True)
# 35 target blocks of 16 tokens a rank (4 KiB each): with a draft 17 or 11, so that the eight
# requests (up to 80 tokens each) are preempted and resumed.
BUDGET_GIB = 0.000135


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random transformers Llama (4 heads, 2 KV heads) saved as a checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tp_draft")
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 initializer_range=0.3)).save_pretrained(folder)
    return folder


def _requests():
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(5, 20))] for _ in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(40, 60), ignore_eos=True) for _ in range(8)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(isolated_env, checkpoint):
    prompts, params = _requests()
    llm = LLM(str(checkpoint), **ENGINE, kv_cache_memory_gib=BUDGET_GIB)
    tokens, _ = tokens_and_stats(llm, prompts, params)
    return tokens, llm.engine.info.num_kv_blocks


@pytest.mark.parametrize("draft_tp", [1, 2])
def test_a_draft_model_at_two_ranks_is_token_exact(reference, checkpoint, draft_tp):
    expected, target_blocks = reference
    prompts, params = _requests()
    spec = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": draft_tp}
    llm = LLM(str(checkpoint), **ENGINE, kv_cache_memory_gib=BUDGET_GIB, speculative_config=spec)
    blocks = llm.engine.info.num_kv_blocks
    tokens, stats = tokens_and_stats(llm, prompts, params)
    assert tokens == expected
    assert stats.spec_decode_num_draft_tokens > 0 and stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    # A rank's target block holds 1 of the 2 KV heads; the draft's holds 1 split, 2 whole: the
    # budget's blocks shrink to a half or a third.
    assert blocks == target_blocks // (2 if draft_tp == 2 else 3)


def test_a_whole_draft_on_the_first_of_two_stages_of_two_ranks(reference, checkpoint):
    """PP = 2 x TP = 2: the first stage's two ranks each draft with the whole draft model and send
    their drafts to their peers on the last stage, which verify them: the same tokens as the two
    ranks alone, every draft accepted."""
    expected, _ = reference
    prompts, params = _requests()
    spec = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": 1}
    llm = LLM(str(checkpoint), **ENGINE, pipeline_parallel_size=2, kv_cache_memory_gib=BUDGET_GIB,
              speculative_config=spec)
    tokens, stats = tokens_and_stats(llm, prompts, params)
    assert tokens == expected
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_a_draft_that_does_not_split_over_the_ranks_is_refused_before_they_start(isolated_env, checkpoint, tmp_path):
    from corectl.errors import ConfigError
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=3,
                num_key_value_heads=3, max_position_embeddings=512).save_pretrained(tmp_path)
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match=r"^speculative_config: the draft .* is split as the target is, and 2 does "
                                          r"not divide its 3 attention heads.*draft_tensor_parallel_size 1"):
        LLM(str(checkpoint), **ENGINE, kv_cache_memory_gib=BUDGET_GIB, speculative_config=spec)
