"""Models, engines, comparisons and engine checks shared by the GPU tests.

Models are small random-weight checkpoints of real architectures, written with a word-level
tokenizer covering their vocabulary: nothing is downloaded and no GGUF conversion is needed.
"""
from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

import torch

VOCAB_SIZE = 16384
# A few layers of real head sizes: Llama's 64-wide heads in groups of 4, Qwen3's 128-wide heads
# with q/k norms and tied embeddings.
ARCHITECTURES = {
    "llama": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True),
}
# Mixtures of experts, tested by their own module (test_gpu_moe.py) rather than by every test
# above: Qwen3-MoE with 16 experts, top 4, layer 0 dense; Mixtral with 8, top 2.
MOE_ARCHITECTURES = {
    "qwen3_moe": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                      mlp_only_layers=[0]),
    "mixtral": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, num_local_experts=8,
                    num_experts_per_tok=2),
}
# Requests finishing one after another: decode batches shrink from 13 to 1 through buckets 16, 8, 4, 2, 1.
PROMPT_LENGTHS = [3, 250, 17, 64, 9, 130, 33, 1, 90, 47, 5, 200, 12]
MAX_TOKENS = [6 + 3 * i for i in range(len(PROMPT_LENGTHS))]
# What torch's sync debug mode says at a synchronizing call. Switching the mode on also warns,
# once per process, that it is a prototype ("Synchronization debug mode ..."): that is no sync.
SYNC_WARNING = "called a synchronizing CUDA operation"
# Scores of a few units: attention neither uniform nor one-hot, so which keys it reads matters.
INIT_STD = 0.1


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose tokens are `t0`..`t{n-1}` (t1 = BOS, t2 = EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
              "unk_token": "t0", "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build_checkpoint(arch: str, folder: Path, seed: int = 0) -> Path:
    """Save a random-weight bf16 model of `arch` with its tokenizer as an HF directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    config_cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
                  "mixtral": MixtralConfig}[arch]
    config = config_cls(vocab_size=VOCAB_SIZE, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        max_position_embeddings=2048, initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2,
                        **{**ARCHITECTURES, **MOE_ARCHITECTURES}[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB_SIZE)
    return folder


def generate(folder: Path, prompts, params, prepare=None, **options):
    """Outputs of a fresh GPU `LLM` over `folder`, which is freed before returning so the next one can
    size its KV cache. `prepare(llm)` runs before generating (to watch the engine's steps)."""
    from corectl import LLM

    settings = dict(platform="cuda", dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
                    max_num_seqs=32)
    llm = LLM(str(folder), **{**settings, **options})
    if prepare is not None:
        prepare(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outputs


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def compare_greedy(expected: list[int], got: list[int], expected_logprob, got_logprobs: list[float],
                   tie_tolerance: float) -> tuple[int, float]:
    """Compare a greedy continuation with a reference; returns (positions matched, max |logprob error|).

    Token-exact, except where two implementations round differently at a near-tie: at the first
    differing position the reference must rate our token within `tie_tolerance` nats of its own
    (`expected_logprob(position, token)`, None when it did not keep that token). The sequences
    continue from different tokens after that, so the comparison stops there.
    """
    max_error = 0.0
    for pos, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            ours = expected_logprob(pos, have)
            gap = None if ours is None else expected_logprob(pos, want) - ours
            assert gap is not None and gap <= tie_tolerance, (
                f"position {pos}: got token {have}, reference {want} (reference logprob gap {gap}); "
                f"tokens so far {got[:pos + 1]} vs {expected[:pos + 1]}")
            return pos, max_error
        max_error = max(max_error, abs(expected_logprob(pos, want) - got_logprobs[pos]))
    return min(len(expected), len(got)), max_error


def compare_greedy_outputs(reference, candidate, tie_tolerance: float, exact: bool) -> float:
    """`compare_greedy` over two lists of `RequestOutput`s that asked for logprobs; with `exact` every
    token must match. Returns the largest logprob error over the matched positions."""
    worst = 0.0
    for ref, cand in zip(reference, candidate, strict=True):
        expected, got = ref.outputs[0], cand.outputs[0]

        def expected_logprob(pos, token, expected=expected):
            entry = expected.logprobs[pos].get(token)
            return None if entry is None else entry.logprob

        chosen = [next(iter(position.values())).logprob for position in got.logprobs]
        matched, error = compare_greedy(expected.token_ids, got.token_ids, expected_logprob, chosen, tie_tolerance)
        worst = max(worst, error)
        if exact:
            assert matched == len(expected.token_ids)
    return worst


def assert_launches_never_wait(checkpoint: Path, enforce_eager: bool) -> None:
    """With async scheduling the host reads a step's ids only in `InflightStep.result()`, after the
    next step is queued; `launch` itself must not synchronize (run on dense and MoE models)."""
    from corectl import SamplingParams

    syncs_per_launch: list[int] = []

    def count_syncs(llm):
        assert llm.engine.async_scheduling
        launch = llm.engine.executor.worker.launch

        def counted(sched):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = launch(sched)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs_per_launch.append(sum(SYNC_WARNING in str(w.message) for w in caught))
            return result

        llm.engine.executor.worker.launch = counted

    # A small token budget chunks the long prompt: steps that sample nothing, mixed steps, decodes.
    prompts = random_prompts([700, 40, 9, 300], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    generate(checkpoint, prompts, params, prepare=count_syncs, max_num_batched_tokens=256,
             enforce_eager=enforce_eager)
    assert len(syncs_per_launch) > 12 and max(syncs_per_launch) == 0, syncs_per_launch


def assert_async_gives_synchronous_tokens(checkpoint: Path) -> None:
    """Async scheduling gives the synchronous loop's tokens, greedy and seeded sampling alike."""
    from corectl import SamplingParams

    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS[:7]]
    params += [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=n)
               for i, n in enumerate(MAX_TOKENS[7:])]
    sync = generate(checkpoint, prompts, params, dtype="float32", async_scheduling=False)
    overlapped = generate(checkpoint, prompts, params, dtype="float32")
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in sync]
