"""`--batch-invariant` on the GPU: a request's greedy tokens are the same alone, among 16 concurrent
requests (chunked prefills cut elsewhere, decode rows in mixed steps, graph buckets of other sizes)
and after a prefix-cache hit, with bf16 weights and decode CUDA graphs. The default mode runs the
same three passes and prints how many prompts differ there (it may be none on a given model: only
the invariant mode asserts anything)."""
import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import LLM, SamplingParams  # noqa: E402
from support.gpu import build_checkpoint, random_prompts  # noqa: E402

PREFIX = 200
SUFFIX_LENGTHS = [1, 7, 40, 130, 3, 260, 18, 77, 9, 300, 55, 2, 190, 24, 101, 12]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    prefix = random_prompts([PREFIX], seed=5)[0]
    return [prefix + suffix for suffix in random_prompts(SUFFIX_LENGTHS, seed=6)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _three_passes(folder, prompts, batch_invariant: bool) -> tuple[list, list, list]:
    """(alone, batched, after a prefix hit) greedy tokens of every prompt on one engine."""
    # A 512-token budget chunks the batched prompts elsewhere than alone and mixes decodes into prefills.
    llm = LLM(str(folder), platform="cuda", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
              max_num_seqs=16, max_num_batched_tokens=512, batch_invariant=batch_invariant)
    runner = llm.engine.executor.worker.runner
    assert runner.graphs and runner.backend.batch_invariant == batch_invariant

    def tokens(batch):
        return [list(out.outputs[0].token_ids) for out in llm.generate(batch, GREEDY, use_tqdm=False)]

    alone = []
    for prompt in prompts:
        llm.engine.scheduler.kv.reset_prefix_cache()
        alone += tokens([{"prompt_token_ids": prompt}])
    llm.engine.scheduler.kv.reset_prefix_cache()
    batched = tokens([{"prompt_token_ids": p} for p in prompts])
    hit_outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(out.num_cached_tokens >= PREFIX // 16 * 16 for out in hit_outputs)
    hit = [list(out.outputs[0].token_ids) for out in hit_outputs]
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return alone, batched, hit


def _differing(alone, batched, hit) -> list[int]:
    return [i for i, (a, b, h) in enumerate(zip(alone, batched, hit)) if not a == b == h]


def test_greedy_tokens_alone_equal_batched_and_after_a_prefix_hit(llama, prompts):
    default = _differing(*_three_passes(llama, prompts, batch_invariant=False))
    print(f"default mode: {len(default)} of {len(prompts)} prompts differ alone / batched / after a hit: {default}")
    alone, batched, hit = _three_passes(llama, prompts, batch_invariant=True)
    differ = _differing(alone, batched, hit)
    assert not differ, f"--batch-invariant: prompts {differ} gave other tokens alone, batched or after a prefix hit"
    assert all(len(tokens) == GREEDY.max_tokens for tokens in alone)
