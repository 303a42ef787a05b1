"""The host-memory tier under the prefix cache: with a device cache too small for the shared
prefixes of a workload, the prefix blocks the device evicts come back from host memory on a later
request (host-tier hits, nothing recomputed for them) and the tokens equal an engine whose device
cache holds everything."""
from __future__ import annotations

import random

import pytest
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from support.engines import TINY

pytestmark = pytest.mark.usefixtures("isolated_env")

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, fp32 (llama-tiny)
_rng = random.Random(1)
# Five shared prefixes of 8 blocks (40 blocks together) against a device cache of 31 usable blocks.
PREFIXES = [[_rng.randrange(512) for _ in range(128)] for _ in range(5)]


def _prompts(suffix_seed: int) -> list[list[int]]:
    rng = random.Random(suffix_seed)
    return [prefix + [rng.randrange(512) for _ in range(9)] for prefix in PREFIXES]


def _run(llm: LLM) -> list[list[int]]:
    """Two rounds over the prefixes, one request at a time, so the first round's prefixes are
    evicted from the device before the second round asks for them again."""
    tokens = []
    for seed in (10, 11):
        for prompt in _prompts(seed):
            out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=3),
                               use_tqdm=False)
            tokens.append(list(out[0].outputs[0].token_ids))
    return tokens


def test_evicted_prefixes_come_back_from_host_memory():
    small = {**TINY, "kv_cache_memory_gib": 32 * BLOCK_BYTES / 2**30, "max_model_len": 256}
    tiered = LLM(**small, kv_offload_bytes=64 * BLOCK_BYTES)
    got = _run(tiered)
    assert got == _run(LLM(**TINY))
    stats = tiered.engine.scheduler.make_stats()
    assert stats.kv_offload_hit_tokens >= 2 * 128  # the second round found its prefixes in host memory
    assert stats.prompt_tokens_transferred == stats.kv_offload_hit_tokens
    assert stats.kv_transfer_bytes_saved > 0 and stats.kv_transfer_bytes_loaded > 0
    scheduler = tiered.engine.scheduler
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_the_host_tier_needs_prefix_caching():
    with pytest.raises(ConfigError, match="prefix caching"):
        LLM(**TINY, kv_offload_bytes=64 * BLOCK_BYTES, enable_prefix_caching=False)
