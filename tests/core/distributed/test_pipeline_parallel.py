"""Pipeline parallelism gives the tokens of one device: PP = 2 (mp and Ray), PP = 2 x TP = 2 and
TP = 2 over Ray actors (the Ray tests share one local cluster) against PP = 1, token for token, on a
4-layer random-weight Llama (fp32, CPU, gloo); uneven partitions from the config and from vLLM's
environment variable; the scheduler's micro-batches; n-gram speculation at PP = 2 x TP = 2; a stage
that dies ends the server; sizes a model cannot be split into, and speculation by an EAGLE head on
stages, are refused before any rank starts."""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import pytest
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from corectl.models.pipeline import layer_partition
from corectl.server.cli.engine_args import add_engine_args, config_from_args
from corectl.step_messages import ModelRunnerOutput
from support.grammars import constrained_texts
from support.models import build_random_checkpoint
from support.ray_cluster import local_ray_cluster
from support.scheduling import make_req, make_scheduler
from support.server import (
    SMALL_ENGINE_FP32,
    assert_rank_death_ends_the_stream,
    assert_serves_like_one_device,
    rank_processes,
    running_server,
)
from support.spec_decode import tokens_and_stats

pytestmark = pytest.mark.slow

NUM_LAYERS = 4
NUM_BLOCKS = 10
BLOCK_SIZE = 16
ENGINE = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 32, "block_size": BLOCK_SIZE}


def kv_budget_gib(most_layers_per_stage: int, tensor_parallel_size: int = 1) -> float:
    """The budget that gives the stage with the most layers NUM_BLOCKS blocks (hidden 64, 4 heads,
    2 KV heads: head_dim 16; a rank holds its share of the KV heads), so every size schedules
    from the same number of blocks."""
    kv_heads = 2 // tensor_parallel_size
    block_bytes = 2 * most_layers_per_stage * BLOCK_SIZE * kv_heads * 16 * 4
    return (NUM_BLOCKS + 0.5) * block_bytes / 2**30


def prompts() -> list[list[int]]:
    shared = [(7 * j) % 40000 + 100 for j in range(40)]
    return [shared + [(13 * i + 3 * j) % 40000 + 100 for j in range(5 + 9 * i)] for i in range(4)]


class MicroBatches:
    """Watches the executor's launches: the requests of the steps launched and not yet read, and
    the most such steps (with requests) at once."""

    def __init__(self, executor):
        self.unread: list[set[str]] = []
        self.most_in_flight = 0
        self.overlaps = 0  # launches that shared a request with a step in flight
        self.latest_overlaps = 0  # ... with the step launched just before, still in flight
        launch = executor.launch

        def watched(sched):
            requests = set(sched.num_scheduled_tokens)
            self.overlaps += any(requests & earlier for earlier in self.unread)
            self.latest_overlaps += bool(self.unread and requests & self.unread[-1])
            self.unread.append(requests)
            self.most_in_flight = max(self.most_in_flight, sum(1 for unread in self.unread if unread))
            handle = launch(sched)
            read = handle.result

            def result():
                if requests in self.unread:
                    self.unread.remove(requests)
                return read()

            handle.result = result
            return handle

        executor.launch = watched


def generate(folder: Path, most_layers_per_stage: int, tensor_parallel_size: int = 1, **options):
    """Greedy and seeded n = 2 samples of a batch, twice (the second pass hits the prefix cache);
    chunked prefill (32-token steps) and preemption (10 blocks) on the way; then texts sampled under
    grammars (the outputs' last entry). Returns the outputs, the scheduler's stats and what the
    launches looked like."""
    llm = LLM(str(folder), tensor_parallel_size=tensor_parallel_size,
              kv_cache_memory_gib=kv_budget_gib(most_layers_per_stage, tensor_parallel_size), **ENGINE, **options)
    batches = MicroBatches(llm.engine.executor)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, ignore_eos=True, n=2, seed=11)
    try:
        assert llm.engine.info.num_kv_blocks == NUM_BLOCKS
        tokens = []
        for _ in range(2):
            outputs = llm.generate(prompts(), [greedy] * 3 + [seeded], use_tqdm=False)
            tokens += [[list(c.token_ids) for c in out.outputs] for out in outputs]
        stats = llm.engine.scheduler.make_stats()
        return [*tokens, constrained_texts(llm)], stats, batches
    finally:
        llm.engine.executor.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir):
    return build_random_checkpoint("llama", tmp_path_factory.mktemp("pp") / "llama", default_model_dir,
                                   num_hidden_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return generate(checkpoint, NUM_LAYERS)[0]


def test_pp2_by_tp2_with_an_uneven_partition_matches_one_device(checkpoint, reference):
    """4 processes: stage 0 holds layers 0-2 on two tensor-parallel ranks, stage 1 layer 3 and the head.
    Three steps are in flight at once, the two latest of different requests: a micro-batch's next
    step goes out before the host has read its last one, and takes its ids from the last stage."""
    tokens, stats, batches = generate(checkpoint, 3, tensor_parallel_size=2, pipeline_parallel_size=2,
                                      pipeline_layer_partition="3,1")
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert batches.most_in_flight == 3 and batches.overlaps > 0 and batches.latest_overlaps == 0
    assert tokens == reference
    texts = tokens[-1]  # a grammar's request waits for its token in flight: its next mask needs it
    assert re.fullmatch(r"[a-z]{3,6}", texts[0]) and texts[1] in {"red", "green", "blue"}
    assert all(0 <= json.loads(text)["n"] <= 99 for text in texts[2:])


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster, started once for the module's two Ray executors."""
    with local_ray_cluster() as ray:
        yield ray


def test_tp2_over_ray_actors_matches_one_device(ray_cluster, checkpoint, reference):
    tokens, stats, _ = generate(checkpoint, NUM_LAYERS, tensor_parallel_size=2, distributed_executor_backend="ray",
                                async_scheduling=True)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert tokens == reference
    # Shutting the executor down ends its actors and placement group: the cluster's CPUs are free again.
    deadline = time.monotonic() + 30
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0) == 2


def test_pp2_over_ray_actors_with_the_vllm_partition_variable_matches_one_device(ray_cluster, checkpoint, reference,
                                                                                  monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")  # read by the driver, which hands the ranks their layers
    tokens, _, _ = generate(checkpoint, 3, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert tokens == reference


def test_the_scheduler_fills_one_micro_batch_per_stage():
    """Each step takes its share of the requests and never one the step before it, in flight, holds;
    a micro-batch goes on before its last step is read (its ids come on the device), and the stages
    before the last get the tokens the host knows with the request's next step."""
    sched = make_scheduler(pipeline_parallel_size=2)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", range(10 * i + 1, 10 * i + 6), max_tokens=4))
    first, second, third = sched.schedule(), sched.schedule(), sched.schedule()
    assert len(first.new_requests) == len(second.new_requests) == 2
    assert set(first.num_scheduled_tokens).isdisjoint(second.num_scheduled_tokens)
    assert third.num_scheduled_tokens == {"r0": 1, "r1": 1}  # the first step's, its ids still in flight
    assert third.cached_requests.new_token_ids == [[], []]
    sched.update(first, ModelRunnerOutput(req_ids=["r0", "r1"], sampled_token_ids=[500, 501]))
    fourth = sched.schedule()  # the engine reads the first step first, as here
    assert fourth.num_scheduled_tokens == {"r2": 1, "r3": 1}  # never the third's requests
    for step, tokens in ((second, [502, 503]), (third, [600, 601]), (fourth, [602, 603])):
        sched.update(step, ModelRunnerOutput(req_ids=list(step.num_scheduled_tokens), sampled_token_ids=tokens))
    fifth = sched.schedule()
    assert fifth.cached_requests.req_ids == ["r0", "r1"]
    assert fifth.cached_requests.new_token_ids == [[600], [601]]


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(str(checkpoint), "-pp", "2", "--served-model-name", "tiny", *SMALL_ENGINE_FP32) as process:
        yield process


def test_serve_pp2_completes_like_one_device(server, checkpoint):
    assert_serves_like_one_device(server, checkpoint)


def test_a_first_stage_killed_mid_stream_ends_the_server(server):
    """Stage 1 would wait forever for stage 0's activations; the engine watches every rank's
    process, so the death is reported at once and the server exits 1."""
    assert len(rank_processes(server)) == 2
    assert_rank_death_ends_the_stream(server, 0, "pipeline stage 0")


@pytest.mark.parametrize(("num_layers", "stages", "partition", "counts"), [
    (4, 2, None, [2, 2]),
    (30, 4, None, [7, 8, 8, 7]),  # vLLM's split: the extra layers before the last stage
    (32, 3, None, [11, 11, 10]),
    (4, 2, (3, 1), [3, 1]),
])
def test_stages_split_the_layers_as_vllm_does(num_layers, stages, partition, counts):
    ranges = layer_partition(num_layers, stages, partition)
    assert [len(r) for r in ranges] == counts
    assert [i for r in ranges for i in r] == list(range(num_layers))


def test_the_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    config = config_from_args(parser.parse_args(["m", "-pp", "2", "-tp", "2", "--pipeline-layer-partition", "3,1"]))
    assert (config.pipeline_parallel_size, config.tensor_parallel_size, config.world_size) == (2, 2, 4)
    assert config.pipeline_layer_partition == "3,1"


@pytest.mark.parametrize(("options", "env", "message"), [
    ({"pipeline_parallel_size": 5}, None, "pipeline_parallel_size: 5 stages need at least one layer each; the model has 4"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_partition": "2,1"}, None,
     "pipeline_layer_partition: 2,1 sums to 3 layers; the model has 4"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_partition": "4"}, None,
     "pipeline_layer_partition: must list one positive layer count per pipeline stage"),
    ({"pipeline_parallel_size": 2}, "2,x", "VLLM_PP_LAYER_PARTITION: must list one positive layer count"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "eagle", "model": "head",
                                                         "num_speculative_tokens": 2}}, None,
     "pipeline_parallel_size: eagle speculation runs without pipeline stages"),
], ids=["more-stages-than-layers", "partition-sum", "partition-count", "partition-env", "speculative"])
def test_sizes_the_model_cannot_take_are_refused_before_any_rank_starts(checkpoint, monkeypatch, options, env, message):
    if env is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", env)
    with pytest.raises(ConfigError, match=message):
        LLM(str(checkpoint), **ENGINE, **options)


def test_pp2_by_tp2_speculates_as_one_device(checkpoint):
    """n-gram speculation over two stages of two tensor-parallel ranks: greedy tokens equal to one
    device without it. Each request is held to three ids its prompt repeats (logit_bias), so lookup
    finds drafts in nearly every step and the model's choice among the three decides acceptance."""
    words = [[100 + 3 * i, 101 + 3 * i, 102 + 3 * i] for i in range(4)]
    batch = [prompt + ids * 4 for prompt, ids in zip(prompts(), words)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={t: 100.0 for t in ids})
              for ids in words]
    one = LLM(str(checkpoint), kv_cache_memory_gib=kv_budget_gib(NUM_LAYERS), **ENGINE)
    expected = [list(o.outputs[0].token_ids) for o in one.generate(batch, params, use_tqdm=False)]
    del one
    staged = LLM(str(checkpoint), tensor_parallel_size=2, pipeline_parallel_size=2,
                 kv_cache_memory_gib=kv_budget_gib(2, 2), **ENGINE,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    tokens, stats = tokens_and_stats(staged, batch, params)
    assert tokens == expected
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
