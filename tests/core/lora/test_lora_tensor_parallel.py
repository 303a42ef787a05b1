"""LoRA under tensor parallelism: two ranks (processes over gloo), each holding its slices of A and B
as its base layers are split, give the tokens of one rank, adapters and base mixed in one batch; and
in two pipeline stages, each loading only its layers' A and B."""
from __future__ import annotations

import pytest
from corectl import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 77, 300, 1234, 999, 42, 17], [11, 2024, 380, 7, 7, 901, 3000, 44, 12], [600, 601, 602]]


def run(folder, adapters, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> list[list[int]]:
    loras = [LoRARequest("r8", 1, str(adapters["r8"][0])), None, LoRARequest("r64", 2, str(adapters["r64"][0]))]
    llm = LLM(str(folder), tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
              enable_lora=True, max_loras=2, max_lora_rank=64, dtype="float32", max_model_len=128,
              kv_cache_memory_gib=0.02)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, lora_request=loras,
                                                                   use_tqdm=False)]
    finally:
        llm.engine.executor.shutdown()


@pytest.fixture(scope="module")
def one_rank(lora_base, adapters) -> list[list[int]]:
    tokens = run(lora_base, adapters)
    assert tokens[0] != tokens[1] != tokens[2]
    return tokens


def test_tp2_matches_tp1(lora_base, adapters, one_rank):
    assert run(lora_base, adapters, tensor_parallel_size=2) == one_rank


def test_pp2_matches_one_rank(lora_base, adapters, one_rank):
    assert run(lora_base, adapters, pipeline_parallel_size=2) == one_rank
