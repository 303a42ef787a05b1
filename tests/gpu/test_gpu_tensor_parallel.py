"""Tensor and pipeline parallelism on real GPUs through NCCL: TP = 2 and PP = 2 against one GPU in
bf16, CUDA graphs on and off.

The ranks add their partial sums in another order than one GPU's GEMM (TP), and pipeline stages run
their micro-batches at other batch sizes (PP), so bf16 logits move by a few units in the last place:
both must give one GPU's greedy tokens, except where one GPU itself rates the two tokens within a
near-tie (judged by its own top logprobs).
"""
import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA or ROCm GPUs", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from support.gpu import compare_greedy, generate, random_prompts  # noqa: E402

NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 17, 40, 64, 100, 130, 257, 600)
TOP_LOGPROBS = 5
TIE_TOLERANCE = 0.5
LOGPROB_TOLERANCE = 0.3


def _logprob_lookup(completion):
    """`(position, token) -> logprob` from a completion's top logprobs (None when not kept)."""
    def lookup(pos: int, token: int):
        entry = completion.logprobs[pos].get(token)
        return None if entry is None else entry.logprob
    return lookup


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_two_gpus_give_the_tokens_of_one(checkpoint, enforce_eager, split):
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True)
    one = generate(checkpoint, prompts, params, enforce_eager=enforce_eager)
    two = generate(checkpoint, prompts, params, enforce_eager=enforce_eager, **split)
    worst, parted = 0.0, 0
    for reference, out in zip(one, two):
        expected, got = reference.outputs[0], out.outputs[0]
        got_logprobs = [position[token].logprob for position, token in zip(got.logprobs, got.token_ids)]
        matched, error = compare_greedy(expected.token_ids, got.token_ids, _logprob_lookup(expected),
                                        got_logprobs, TIE_TOLERANCE)
        worst, parted = max(worst, error), parted + (matched < NEW_TOKENS)
    print(f"{checkpoint.name} {'eager' if enforce_eager else 'graphs'} {split}: against one GPU, max chosen-token "
          f"logprob difference {worst:.4f} nat; {parted} of {len(prompts)} prompts parted at a near-tie")
    assert worst < LOGPROB_TOLERANCE


def test_the_ray_executor_gives_the_tokens_of_rank_processes(checkpoint, tmp_path_factory, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    prompts = random_prompts(PROMPT_LENGTHS, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ray.init(num_gpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        over_ray = generate(checkpoint, prompts, params, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    over_processes = generate(checkpoint, prompts, params, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in over_ray] == [o.outputs[0].token_ids for o in over_processes]


@pytest.mark.parametrize(("method", "split"), [
    ("ngram", {"pipeline_parallel_size": 2}), ("draft_model", {"pipeline_parallel_size": 2}),
    ("draft_model", {"tensor_parallel_size": 2}), ("draft_model", {"tensor_parallel_size": 2, "draft_tp": 1}),
], ids=["pp2-ngram", "pp2-draft", "tp2-draft-split", "tp2-draft-whole"])
def test_speculation_on_two_gpus_gives_the_tokens_of_one(checkpoint, method, split):
    """n-gram drafts, or the checkpoint as its own draft model: on the first of two stages (its
    drafts sent to the last over NCCL ahead of the activations), or at TP = 2 split over the ranks
    or whole on each; against one GPU without speculation."""
    import gc

    from corectl import LLM

    split = dict(split)
    draft_tp = split.pop("draft_tp", None)

    prompts = random_prompts((12, 20, 33), seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True)
    if method == "ngram":
        # Each output drawn from three ids its prompt repeats: n-gram lookup drafts nearly every step
        # (a random model's free output repeats nothing). Not for a draft model, which drafts
        # without the request's logit bias; nor at TP = 2, whose bf16 sums part the three ids'
        # near-ties, which raw logprobs (before the bias) cannot judge.
        words = [[100 + 3 * i, 101 + 3 * i, 102 + 3 * i] for i in range(3)]
        prompts = [p + w * 4 for p, w in zip(prompts, words)]
        params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True,
                                 logit_bias={t: 100.0 for t in w}) for w in words]
    one = generate(checkpoint, prompts, params)
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"model": str(checkpoint)} if method == "draft_model" else {"prompt_lookup_max": 3})
    if draft_tp is not None:
        spec["draft_tensor_parallel_size"] = draft_tp
    llm = LLM(str(checkpoint), platform="cuda", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
              max_num_seqs=32, speculative_config=spec, **split)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.scheduler.make_stats()
    finally:
        llm.engine.executor.shutdown()
        del llm
        gc.collect()
    for reference, out in zip(one, two):
        got = out.outputs[0]
        got_logprobs = [position[token].logprob for position, token in zip(got.logprobs, got.token_ids)]
        _, error = compare_greedy(reference.outputs[0].token_ids, got.token_ids,
                                  _logprob_lookup(reference.outputs[0]), got_logprobs, TIE_TOLERANCE)
        assert error < LOGPROB_TOLERANCE
    assert stats.spec_decode_num_draft_tokens > 0
    if method == "draft_model":  # the target drafting for itself: nearly every draft is accepted
        assert stats.spec_decode_num_accepted_tokens > 0.8 * stats.spec_decode_num_draft_tokens
