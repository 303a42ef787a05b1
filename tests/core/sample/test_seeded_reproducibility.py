"""A seeded request gives the same tokens alone, in a batch of 16 and after a prefix-cache hit
(temperature 1, through the engine on SmolLM2), and its draws come from (seed, output position) only."""
from __future__ import annotations

import torch
from corectl.sample.seeding import position_seed
from corectl.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
OTHERS = [f"Question {i}: what is the colour of the sky on planet {i}?" for i in range(15)]


def _params(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)


def test_seeded_request_is_the_same_alone_batched_and_after_a_cache_hit(llm_int4):
    cold = llm_int4.generate([PROMPT], _params(7))[0].outputs[0].token_ids  # a cache miss
    warm = llm_int4.generate([PROMPT], _params(7))[0].outputs[0].token_ids  # a prefix-cache hit
    mixed = [_params(None if i % 2 else 100 + i) for i in range(15)]
    batch = llm_int4.generate(OTHERS[:8] + [PROMPT] + OTHERS[8:], mixed[:8] + [_params(7)] + mixed[8:])
    batched = batch[8].outputs[0].token_ids
    assert cold == warm == batched
    # The seed matters: another seed gives another sample.
    assert llm_int4.generate([PROMPT], _params(8))[0].outputs[0].token_ids != cold


def test_position_seeds_are_distinct_and_stable():
    seeds = {position_seed(seed, position) for seed in range(8) for position in range(64)}
    assert len(seeds) == 8 * 64 and all(0 <= s < 2 ** 63 for s in seeds)
    assert position_seed(3, 5) == position_seed(3, 5)
    draws = [torch.rand(1, generator=torch.Generator().manual_seed(position_seed(1, p))).item() for p in range(3)]
    assert len(set(draws)) == 3
