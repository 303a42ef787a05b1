"""`--kv-cache-dtype float16` on the CPU: fp16 cache tensors holding twice the tokens of fp32 ones in the
same memory, as `corectl plan` counts them, and the embedded SmolLM2 served the default way (4-bit
layers) with them giving the fp32 cache's greedy tokens or diverging only at near-ties."""
from __future__ import annotations

import torch
from corectl import LLM
from corectl.config import EngineConfig
from corectl.planning import plan_deployment
from support.models import CHAT_PROMPTS
from support.quant_checkpoints import greedy_divergences

TINY = {"model": "llama-tiny", "load_format": "dummy", "max_model_len": 256, "kv_cache_memory_gib": 0.01}


def test_an_fp16_cache_holds_twice_the_tokens_and_the_plan_counts_them():
    full, half = LLM(**TINY).engine, LLM(kv_cache_dtype="float16", **TINY).engine
    caches = half.executor.worker.runner.kv_caches
    assert caches and all(cache.dtype == torch.float16 for cache in caches)
    per_block = half.executor.worker.model_info.kv_bytes_per_block(16)
    assert 2 * per_block == full.executor.worker.model_info.kv_bytes_per_block(16)
    assert half.info.num_kv_blocks == int(0.01 * (1 << 30)) // per_block >= 2 * full.info.num_kv_blocks
    assert plan_deployment(EngineConfig(kv_cache_dtype="float16", **TINY), device="cpu").num_kv_blocks == \
        half.info.num_kv_blocks


def test_the_default_model_with_an_fp16_cache_keeps_its_greedy_tokens(llm_int4):
    llm = LLM(kv_cache_dtype="float16", max_model_len=1024, kv_cache_memory_gib=0.25, max_num_seqs=32)
    tok = llm.get_tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    divergences = greedy_divergences(llm, llm_int4, prompts)
    print(f"SmolLM2 4-bit, fp16 KV cache vs fp32: {len(divergences)} of {len(prompts)} prompts diverge: {divergences}")
