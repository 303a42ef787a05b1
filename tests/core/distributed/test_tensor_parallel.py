"""Tensor parallelism gives the tokens of one device: TP = 2 against TP = 1, token for token.

Small random-weight models of real architectures (fp32, CPU, gloo). The workload exercises what
changes how a step is built: prefix-cache hits, chunked prefill, preemption (a KV cache of a few
blocks), n > 1 with seeded sampling, grammar-constrained sampling, and async scheduling over the
executor's pipes. Both sizes get the same number of KV blocks, so they schedule identically.
"""
from __future__ import annotations

import json
import re

import pytest
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from support.grammars import constrained_texts
from support.models import build_random_checkpoint

pytestmark = pytest.mark.slow

NUM_BLOCKS = 20
BLOCK_SIZE = 16
# A grammar compile past its limit ends the request with empty text; on a loaded 2-core host the
# first compile (the backend's vocabulary tables) can take longer than the default 10 s.
ENGINE = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 32, "block_size": BLOCK_SIZE,
          "structured_outputs_compile_timeout": 300.0}


def kv_budget_gib(folder, tensor_parallel_size: int) -> float:
    """The KV budget that gives each rank NUM_BLOCKS blocks (a rank holds its share of KV heads)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = max(1, config.num_key_value_heads // tensor_parallel_size)
    block_bytes = 2 * config.num_hidden_layers * BLOCK_SIZE * kv_heads * head_dim * 4
    return (NUM_BLOCKS + 0.5) * block_bytes / 2**30


def prompts(seed: int) -> list[list[int]]:
    shared = [(seed * 31 + 7 * j) % 40000 + 100 for j in range(40)]
    return [shared + [(seed + 13 * i + 3 * j) % 40000 + 100 for j in range(5 + 9 * i)] for i in range(5)]


def run_workload(llm: LLM) -> list[list[list[int]]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True, n=2, seed=11)
    tokens = []
    # The second batch repeats the first's 40-token prefix: its blocks come from the prefix cache.
    for batch in (prompts(1), prompts(1)[::-1] + prompts(2)):
        outputs = llm.generate(batch, [greedy] * (len(batch) - 1) + [seeded], use_tqdm=False)
        tokens += [[list(c.token_ids) for c in out.outputs] for out in outputs]
    return tokens


def generate(folder, tensor_parallel_size: int, grammars: bool = False, **options) -> tuple[list, object, list[str]]:
    """The workload's tokens, the scheduler's stats after it, then (`grammars`) the grammar-constrained
    texts: one engine for both, as an engine start with its rank processes costs more than the runs."""
    llm = LLM(str(folder), tensor_parallel_size=tensor_parallel_size,
              kv_cache_memory_gib=kv_budget_gib(folder, tensor_parallel_size), **ENGINE, **options)
    try:
        assert llm.engine.info.num_kv_blocks == NUM_BLOCKS
        tokens = run_workload(llm)
        stats = llm.engine.scheduler.make_stats()
        return tokens, stats, constrained_texts(llm) if grammars else []
    finally:
        llm.engine.executor.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("tp-checkpoints")
    # Qwen2 and Qwen3 are Llama with q/k/v biases and per-head q/k norms (tied embeddings): with
    # the PP x TP test's Llama they cover the dense family. Qwen2 has one KV head for two ranks
    # (both hold it, its bias too); the others split two KV heads evenly.
    return {
        "qwen2-kv1": build_random_checkpoint("qwen2", root / "qwen2-kv1", default_model_dir, num_key_value_heads=1),
        "qwen3": build_random_checkpoint("qwen3", root / "qwen3", default_model_dir),
        # Experts split along their intermediate rows; layer 0 dense beside a sparse layer 1.
        "qwen3-moe": build_random_checkpoint("qwen3_moe", root / "qwen3-moe", default_model_dir,
                                             norm_topk_prob=True, mlp_only_layers=[0]),
        "mixtral": build_random_checkpoint("mixtral", root / "mixtral", default_model_dir),
    }


GRAMMARS = "qwen3"  # the grammar-constrained samples run on this model's engines


@pytest.fixture(scope="module")
def reference(checkpoints):
    cache = {}

    def outputs(arch: str):
        if arch not in cache:
            # One device, synchronous: the async TP runs are held to synchronous outputs.
            tokens, _, texts = generate(checkpoints[arch], 1, arch == GRAMMARS, async_scheduling=False)
            cache[arch] = tokens, texts
        return cache[arch]

    return outputs


# Each model family once, dense and mixture of experts each under synchronous and async scheduling.
@pytest.mark.parametrize(("arch", "options"), [
    ("qwen2-kv1", {}),
    ("qwen3", {"async_scheduling": True}),
    ("qwen3-moe", {"async_scheduling": True}),
    ("mixtral", {}),
], ids=["qwen2-kv-head-replicated", "qwen3-async", "qwen3-moe-async", "mixtral"])
def test_tp2_over_processes_matches_tp1(arch, options, checkpoints, reference):
    """On Qwen3 the engine also samples under grammars: under async scheduling each rank samples a
    step once its grammar masks arrive, after the forward pass (one more message on the ranks'
    pipes); the outputs are those of one device run synchronously, and they hold to their grammars."""
    tokens, stats, texts = generate(checkpoints[arch], 2, arch == GRAMMARS, distributed_executor_backend="mp",
                                    **options)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert (tokens, texts) == reference(arch)
    if arch == GRAMMARS:
        assert re.fullmatch(r"[a-z]{3,6}", texts[0]) and texts[1] in {"red", "green", "blue"}
        assert all(0 <= json.loads(text)["n"] <= 99 for text in texts[2:])


def test_a_size_that_does_not_divide_the_heads_is_refused(checkpoints):
    with pytest.raises(ConfigError, match="tensor_parallel_size: 3 does not divide its 4 attention heads"):
        LLM(str(checkpoints["qwen3"]), tensor_parallel_size=3, **ENGINE)
