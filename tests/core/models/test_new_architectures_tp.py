"""Phi-3 (fused checkpoint tensors split per rank), gpt-oss (per-rank sinks, expert biases, the down
bias added once) and Llama 4 (shared expert, chunked layers) at tensor-parallel size 2 and in two
pipeline stages on CPU (two processes over gloo; each stage loads only its layers' tensors, fused
and stacked ones included): greedy fp32 tokens equal transformers'."""
from __future__ import annotations

import pytest
from corectl import LLM, SamplingParams
from support.arch_parity import NEW_TOKENS, parity_prompts, save_random_model
from support.models import hf_greedy
from support.new_arch_configs import VOCAB, gpt_oss_config, llama4_config, phi3_config, randomise_sinks
CONFIGS = {"phi3": lambda: phi3_config(True), "gpt-oss": gpt_oss_config, "llama4": llama4_config}


@pytest.mark.slow
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_two_ranks_match_transformers(arch, split, tmp_path, default_model_dir):
    hf_model = save_random_model(CONFIGS[arch](), tmp_path / arch, default_model_dir, seed=4)
    if arch == "gpt-oss":
        randomise_sinks(hf_model)
        hf_model.save_pretrained(tmp_path / arch)
    llm = LLM(str(tmp_path / arch), dtype="float32", kv_cache_memory_gib=0.01, block_size=8, max_model_len=64,
              **split)
    try:
        prompts, _ = parity_prompts(VOCAB)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for out, prompt in zip(llm.generate(prompts, params, use_tqdm=False), prompts):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)[0], arch
    finally:
        llm.engine.executor.shutdown()
