"""vLLM's num_gpu_blocks_override: the KV cache gets that many blocks whatever the memory budget says,
on the CPU too, and a count too small for one sequence is refused before the engine serves."""
from __future__ import annotations

import pytest
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from support.models import build_random_checkpoint

ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_gib=0.02, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir):
    return build_random_checkpoint("llama", tmp_path_factory.mktemp("blocks-override"), default_model_dir)


def test_the_cache_holds_the_blocks_asked_and_preempts_past_them(checkpoint):
    llm = LLM(str(checkpoint), num_gpu_blocks_override=9, **ENGINE)
    pool = llm.engine.scheduler.kv.pool
    assert len(pool.blocks) == 9
    # Four sequences of 40 tokens need 12 blocks of 16 (block 0 is the null block): some wait or are
    # preempted, and every one still finishes with its tokens.
    prompts = [[5 + i, 17, 23, 42] * 5 for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [20] * 4
    alone = LLM(str(checkpoint), **ENGINE).generate(prompts, SamplingParams(temperature=0, max_tokens=20,
                                                                              ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in alone]


def test_too_few_blocks_for_one_sequence_are_refused(checkpoint):
    with pytest.raises(ConfigError, match="num_gpu_blocks_override") as caught:
        LLM(str(checkpoint), num_gpu_blocks_override=3, **ENGINE)
    assert "max_model_len=64 (4 blocks)" in str(caught.value)
    with pytest.raises(ConfigError, match="num_gpu_blocks_override: must be a positive integer"):
        LLM(str(checkpoint), num_gpu_blocks_override=0, **ENGINE)
