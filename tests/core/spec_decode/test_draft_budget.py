"""A draft model's KV cache comes out of the engine's KV budget: a block counts as the target's and
the draft's together, so the two caches fill the budget between them (the draft's spare block per
sequence slot on top), instead of the draft's cache landing on top of a budget the target alone
filled (on a GPU, past `gpu_memory_utilization`)."""
from __future__ import annotations

from corectl import LLM

BUDGET_GIB = 0.05


def _bytes(caches) -> int:
    return sum(cache.numel() * cache.element_size() for cache in caches)


def test_the_draft_cache_comes_out_of_the_kv_budget(default_model_dir):
    spec = {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3}
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_gib=BUDGET_GIB, max_num_seqs=8,
              speculative_config=spec)
    runner = llm.engine.executor.worker.runner
    blocks = llm.engine.info.num_kv_blocks
    target_block = _bytes(runner.kv_caches) // blocks
    draft_block = _bytes(runner.drafter.runner.kv_caches) // (blocks + 8)  # its spare block per slot
    shared = blocks * (target_block + draft_block)
    budget = int(BUDGET_GIB * 2**30)
    assert draft_block > 0 and shared <= budget < shared + target_block + draft_block
