"""Tensor parallelism gives the tokens of one device: TP = 2 against TP = 1, token for token.

Small random-weight models of real architectures (fp32, CPU, gloo). The workload exercises what
changes how a step is built: prefix-cache hits, chunked prefill, preemption (a KV cache of a few
blocks), n > 1 with seeded sampling, and async scheduling over the executor's pipes. Both sizes
get the same number of KV blocks, so they schedule identically.
"""
from __future__ import annotations

import json
import re
import time

import pytest
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from support.models import build_random_checkpoint
from support.ray_cluster import local_ray_cluster

pytestmark = pytest.mark.slow

NUM_BLOCKS = 20
BLOCK_SIZE = 16
ENGINE = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 32, "block_size": BLOCK_SIZE}


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


def generate(folder, tensor_parallel_size: int, **options) -> tuple[list, object]:
    llm = LLM(str(folder), tensor_parallel_size=tensor_parallel_size,
              kv_cache_memory_gib=kv_budget_gib(folder, tensor_parallel_size), **ENGINE, **options)
    try:
        assert llm.engine.info.num_kv_blocks == NUM_BLOCKS
        tokens = run_workload(llm)
        return tokens, llm.engine.scheduler.make_stats()
    finally:
        llm.engine.executor.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("tp-checkpoints")
    return {
        "llama": build_random_checkpoint("llama", root / "llama", default_model_dir),
        "qwen2": build_random_checkpoint("qwen2", root / "qwen2", default_model_dir),
        "qwen3": build_random_checkpoint("qwen3", root / "qwen3", default_model_dir),
        # One KV head for two ranks: both hold it.
        "llama-kv1": build_random_checkpoint("llama", root / "llama-kv1", default_model_dir, num_key_value_heads=1),
        # Experts split along their intermediate rows; layer 0 dense beside a sparse layer 1.
        "qwen3-moe": build_random_checkpoint("qwen3_moe", root / "qwen3-moe", default_model_dir,
                                             norm_topk_prob=True, mlp_only_layers=[0]),
        "mixtral": build_random_checkpoint("mixtral", root / "mixtral", default_model_dir),
    }


@pytest.fixture(scope="module")
def reference(checkpoints):
    cache = {}

    def tokens(arch: str):
        if arch not in cache:
            cache[arch] = generate(checkpoints[arch], 1)[0]
        return cache[arch]

    return tokens


@pytest.mark.parametrize(("arch", "options"), [
    ("llama", {}),
    ("qwen2", {"async_scheduling": True}),
    ("qwen3", {"async_scheduling": True}),
    ("llama-kv1", {}),
    ("qwen3-moe", {"async_scheduling": True}),
    ("mixtral", {}),
], ids=["llama", "qwen2-async", "qwen3-async", "llama-kv-head-replicated", "qwen3-moe-async", "mixtral"])
def test_tp2_over_processes_matches_tp1(arch, options, checkpoints, reference):
    tokens, stats = generate(checkpoints[arch], 2, distributed_executor_backend="mp", **options)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert tokens == reference(arch)


def constrained(folder, tensor_parallel_size: int, **options) -> list[str]:
    """Grammar-constrained samples (regex, choice, a JSON schema; greedy and seeded n = 2)."""
    from corectl import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    specs = [StructuredOutputsParams(regex=r"[a-z]{3,6}"), StructuredOutputsParams(choice=["red", "green", "blue"]),
             StructuredOutputsParams(json=schema, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec) for spec in specs]
    params.append(SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20, structured_outputs=specs[2]))
    llm = LLM(str(folder), tensor_parallel_size=tensor_parallel_size, **ENGINE, **options)
    try:
        outputs = llm.generate(["a", "b", "c", "d"], params, use_tqdm=False)
        return [c.text for out in outputs for c in out.outputs]
    finally:
        llm.engine.executor.shutdown()


def test_tp2_async_constrained_outputs_match_tp1_sync(checkpoints):
    """Under async scheduling each rank samples a step once its grammar masks arrive, after the
    forward pass (one more message on the ranks' pipes): the outputs are those of one device run
    synchronously, and they hold to their grammars."""
    expected = constrained(checkpoints["qwen3"], 1, async_scheduling=False)
    got = constrained(checkpoints["qwen3"], 2, distributed_executor_backend="mp", async_scheduling=True)
    assert got == expected
    assert re.fullmatch(r"[a-z]{3,6}", got[0]) and got[1] in {"red", "green", "blue"}
    assert all(0 <= json.loads(text)["n"] <= 99 for text in got[2:])


@pytest.fixture
def ray_cluster():
    with local_ray_cluster() as ray:
        yield ray


def test_tp2_over_ray_actors_matches_tp1(ray_cluster, checkpoints, reference):
    tokens, stats = generate(checkpoints["qwen3"], 2, distributed_executor_backend="ray", async_scheduling=True)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert tokens == reference("qwen3")
    # Shutting the executor down ends its actors and placement group: the cluster's CPUs are free again.
    deadline = time.monotonic() + 30
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0) == 2


def test_a_size_that_does_not_divide_the_heads_is_refused(checkpoints):
    with pytest.raises(ConfigError, match="tensor_parallel_size: 3 does not divide its 4 attention heads"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=3, **ENGINE)
