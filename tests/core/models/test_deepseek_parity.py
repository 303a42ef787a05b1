"""DeepSeek V2 and V3 against transformers: multi-head latent attention (latent cache), a dense
first layer, shared experts and V2's / V3's routing (grouped top-k, correction bias, routed scaling);
greedy fp32 through prefix hits and preemption."""
from __future__ import annotations

import pytest
import torch
from support.arch_parity import BLOCK, assert_engine_matches, save_random_model

VOCAB = 49152
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
              num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=512, initializer_range=0.5, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_config(version: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    if version == "v2-lite":
        return DeepseekV2Config(**COMMON, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)
    if version == "v2-grouped":
        return DeepseekV2Config(**COMMON, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                routed_scaling_factor=1.5)
    return DeepseekV3Config(**COMMON, q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=True, rope_parameters=YARN, rope_interleave=version == "v3")


def _randomise_correction(model) -> None:
    """transformers starts V3's correction bias at zero; a random one makes it matter."""
    generator = torch.Generator().manual_seed(3)
    for layer in model.model.layers[1:]:
        bias = layer.mlp.gate.e_score_correction_bias
        bias.copy_(torch.rand(bias.shape, generator=generator))


@pytest.mark.parametrize("version", ["v2-lite", "v2-grouped", "v3", "v3-halves"])
def test_deepseek_greedy_matches_transformers(version, tmp_path, default_model_dir):
    hf_model = save_random_model(deepseek_config(version), tmp_path / version, default_model_dir, seed=5)
    if version.startswith("v3"):
        _randomise_correction(hf_model)
        hf_model.save_pretrained(tmp_path / version)
    llm = assert_engine_matches(tmp_path / version, hf_model, VOCAB, variant=version in ("v2-grouped", "v3-halves"))
    worker = llm.engine.executor.worker
    # The latent cache: one row of kv_lora_rank + qk_rope_head_dim per token and layer, no values.
    cache = worker.runner.kv_caches[0]
    assert (cache.shape[0], *cache.shape[2:]) == (1, BLOCK, 1, 32 + 8)
    assert worker.model_info.kv_bytes_per_block(BLOCK) == 3 * BLOCK * (32 + 8) * 4
