"""DeepSeek V2 and V3 against transformers: multi-head latent attention (latent cache), a dense
first layer, shared experts and V2's / V3's routing (grouped top-k, correction bias, routed scaling);
greedy fp32 through prefix hits, preemption and chunked prefill; two tensor-parallel ranks and two
pipeline stages over gloo; `corectl plan` sizes latent blocks."""
from __future__ import annotations

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.config import EngineConfig
from corectl.planning import plan_deployment
from support.arch_parity import BLOCK, MAX_MODEL_LEN, assert_engine_matches, parity_prompts, save_random_model
from support.models import hf_greedy_choices

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


@pytest.mark.slow
@pytest.mark.parametrize("version", ["v2-lite", "v3"])
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_two_ranks_match_transformers(version, split, tmp_path, default_model_dir):
    """Two tensor-parallel ranks: each expands, attends and projects two of the four heads from the
    latent both compute and cache whole (V2-Lite's q in one projection, V3's through its low rank),
    and holds half of each expert's rows. Or two pipeline stages (the dense layer and one MoE layer,
    then the last MoE layer with the head): each loads and absorbs only its layers' projections."""
    hf_model = save_random_model(deepseek_config(version), tmp_path, default_model_dir, seed=5)
    if version == "v3":
        _randomise_correction(hf_model)
        hf_model.save_pretrained(tmp_path)
    prompts, _ = parity_prompts(VOCAB)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gib=0.01, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
              **split)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for out, prompt in zip(llm.generate(prompts, params, use_tqdm=False), prompts):
            tokens = list(out.outputs[0].token_ids)
            assert hf_greedy_choices(hf_model, prompt, tokens)[0] == tokens
    finally:
        llm.engine.executor.shutdown()


def test_chunked_prefill_over_the_latent_cache_matches_transformers(tmp_path, default_model_dir):
    """A step budget of 8 tokens splits every prompt into chunks, each attending to the latent rows
    the chunks before it cached."""
    hf_model = save_random_model(deepseek_config("v2-lite"), tmp_path, default_model_dir, seed=7)
    prompts, _ = parity_prompts(VOCAB)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gib=0.01, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for out, prompt in zip(llm.generate(prompts, params, use_tqdm=False), prompts):
        tokens = list(out.outputs[0].token_ids)
        assert hf_greedy_choices(hf_model, prompt, tokens)[0] == tokens


def test_plan_sizes_latent_blocks_of_the_v2_lite_preset(isolated_env):
    """`corectl plan` of the deepseek-v2-lite preset: the published checkpoint's 15.7B parameters,
    and a token costs layers x (kv_lora_rank + rope) bf16 numbers, 27 x 576 x 2 bytes, not 2 x heads
    x (nope + rope) per layer; under tensor parallelism every rank caches the whole latent and holds
    about half the weights, and on a 24 GiB device two ranks are the remedy."""
    model = dict(model="deepseek-v2-lite", load_format="dummy", max_model_len=4096)
    plan = plan_deployment(EngineConfig(**model), device_memory=80 << 30, device_capability=(9, 0))
    assert 15.6e9 < plan.weight_bytes / 2 < 15.8e9
    assert plan.kv_bytes_per_token == 27 * (512 + 64) * 2
    # The absorbed up-projections are held beside kv_b_proj: W_UK and W_UV of every head and layer.
    assert plan.buffer_bytes >= 27 * 16 * (128 + 128) * 512 * 2
    assert plan.problem is None and plan.kv_tokens == plan.num_kv_blocks * plan.block_size > 1_000_000
    small = plan_deployment(EngineConfig(**model), device_memory=24 << 30, device_capability=(9, 0))
    assert small.problem and "--tensor-parallel-size 2" in small.remedies
    two = plan_deployment(EngineConfig(**model, tensor_parallel_size=2), device_memory=80 << 30)
    assert two.kv_bytes_per_token == plan.kv_bytes_per_token
    assert two.weight_bytes_per_rank < 0.55 * plan.weight_bytes


def test_triton_backend_under_the_interpreter(tmp_path, default_model_dir):
    """The real CPU worker and scheduler with the Triton backend: the latent-attention kernel over
    rows stored through `store_kvcache`, chunked prefills (16-token steps), mixed and decode steps."""
    from test_sliding_window_parity import _run_triton_engine

    hf_model = save_random_model(deepseek_config("v2-lite"), tmp_path, default_model_dir, seed=5)
    prompts = [[5 + 7 * i for i in range(n)] for n in (11, 19)]
    outputs, _, worker = _run_triton_engine(tmp_path, prompts, 6)
    assert worker.runner.kv_caches[0].shape[0] == 1
    for prompt, output in zip(prompts, outputs):
        tokens = [token for token, _ in output]
        assert hf_greedy_choices(hf_model, prompt, tokens)[0] == tokens
