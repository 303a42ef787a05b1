"""Disaggregated prefill/decode inside one process: a producer engine prefills (max_tokens=1) and
saves each prompt's blocks, a consumer engine loads them and decodes. Both built-in connectors must
give the greedy tokens of one engine doing both, the consumer must compute only each prompt's last
token (its counters say so), a load that cannot happen (no producer, nothing saved) must fall back to
recomputing with the same tokens, and every block must return to both pools."""
from __future__ import annotations

import logging
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from corectl import LLM, SamplingParams
from corectl.engine.messages import EngineCoreRequest
from support.engines import TINY
from support.server import free_port

pytestmark = pytest.mark.usefixtures("isolated_env")

MAX_TOKENS = 6
_rng = random.Random(0)
# Lengths that end mid-block and on a block boundary (block size 16).
PROMPTS = [[_rng.randrange(512) for _ in range(n)] for n in (37, 48, 70)]


def _greedy(max_tokens: int, params: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, kv_transfer_params=params)


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _pair(connector: str, extra: dict) -> tuple[LLM, LLM]:
    def config(role: str) -> dict:
        return {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}

    return LLM(**TINY, kv_transfer_config=config("kv_producer")), LLM(**TINY, kv_transfer_config=config("kv_consumer"))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _tokens(LLM(**TINY), [_greedy(MAX_TOKENS)] * len(PROMPTS))


def _close(*engines: LLM) -> None:
    """Stop the connectors' background work (the producer first: it then stops serving)."""
    for llm in engines:
        llm.engine.executor.worker.kv_connector.close()


@pytest.fixture(scope="module")
def shm_pair(tmp_path_factory):
    pair = _pair("SharedMemoryConnector", {"path": str(tmp_path_factory.mktemp("kv")), "load_timeout_s": 0.3})
    yield pair
    _close(*pair)


@pytest.fixture(scope="module")
def torch_pair():
    pair = _pair("TorchDistributedConnector", {"rendezvous": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 20})
    yield pair
    _close(*pair)


def _disaggregate(producer: LLM, consumer: LLM, tag: str) -> list[list[int]]:
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    _tokens(producer, [_greedy(1, {"do_remote_decode": True, "transfer_id": i}) for i in ids])
    # Saves are published on a thread after the requests end: all of them must be in (and a cap
    # applied) before the consumer asks, or an early ask finds a save the cap would have dropped.
    assert producer.engine.executor.worker.kv_connector.saves_published(timeout=30)
    return _tokens(consumer, [_greedy(MAX_TOKENS, {"do_remote_prefill": True, "transfer_id": i}) for i in ids])


def _assert_all_blocks_free(*engines: LLM) -> None:
    for llm in engines:
        scheduler = llm.engine.scheduler
        assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
        assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("pair", ["shm_pair", "torch_pair"])
def test_consumer_decodes_the_transferred_prompt(pair, reference, request):
    producer, consumer = request.getfixturevalue(pair)
    before = consumer.engine.scheduler.make_stats()
    assert _disaggregate(producer, consumer, pair) == reference
    stats = consumer.engine.scheduler.make_stats()
    # Only each prompt's last token is computed on the decode side; the rest arrived.
    assert stats.prompt_tokens_computed - before.prompt_tokens_computed == len(PROMPTS)
    assert stats.prompt_tokens_transferred - before.prompt_tokens_transferred == sum(len(p) - 1 for p in PROMPTS)
    assert stats.kv_transfer_bytes_loaded > before.kv_transfer_bytes_loaded
    assert stats.kv_load_failures == before.kv_load_failures
    assert producer.engine.scheduler.make_stats().kv_transfer_bytes_saved > 0
    _assert_all_blocks_free(producer, consumer)


def test_connector_sees_the_platforms_backend(torch_pair):
    """The backend's name picks the blocks' transport (NCCL device to device on GPUs): the worker
    once passed the platform's method instead, and GPU transfers fell back to gloo through host memory."""
    assert all(llm.engine.executor.worker.kv_connector.access.distributed_backend == "gloo" for llm in torch_pair)


def test_transfers_log_where_their_time_goes(shm_pair, reference, monkeypatch, caplog):
    """Each direction sums up its transfers' phases at INFO (every SUMMARY_EVERY transfers)."""
    from corectl.kv_transfer import timing

    monkeypatch.setattr(timing, "SUMMARY_EVERY", len(PROMPTS))
    with caplog.at_level(logging.INFO, logger="corectl.kv_transfer"):
        assert _disaggregate(*shm_pair, "timed") == reference
    summaries = " ".join(r.getMessage() for r in caplog.records if "timing over" in r.getMessage())
    assert re.search(r"KV save timing over \d+ transfers \(ms median/p90\): queued [\d.]+/[\d.]+, gather", summaries)
    assert re.search(r"KV load timing over \d+ transfers .*fetch at [\d.]+ GB/s", summaries)


def test_saves_past_the_producers_cap_are_dropped_and_recomputed(torch_pair, reference, monkeypatch, caplog):
    """A producer holds at most `max_saved_bytes` of saves nobody fetched yet: past it the oldest
    go (only the newest save is kept under a 1-byte cap), and the decode instance recomputes those
    prompts with the same tokens. Asked for a dropped save, the producer says so at once (its one
    serving thread does not wait load_timeout_s for blocks that will not come)."""
    producer, consumer = torch_pair
    worker = producer.engine.executor.worker.kv_connector
    monkeypatch.setattr(worker, "max_saved_bytes", 1)
    monkeypatch.setattr(worker, "load_timeout_s", 600.0)
    before = consumer.engine.scheduler.make_stats()
    with caplog.at_level(logging.WARNING, logger="corectl.kv_transfer"):
        assert _disaggregate(producer, consumer, "capped") == reference
    assert sum("dropped the blocks of" in r.getMessage() for r in caplog.records) == len(PROMPTS) - 1
    stats = consumer.engine.scheduler.make_stats()
    assert stats.kv_load_failures - before.kv_load_failures == len(PROMPTS) - 1
    # The newest prompt arrived (past what an earlier test left in the consumer's prefix cache).
    assert stats.prompt_tokens_transferred > before.prompt_tokens_transferred
    _assert_all_blocks_free(producer, consumer)


def test_loads_start_while_computed_prompts_take_the_budget(shm_pair, monkeypatch):
    """A decode instance that also computes prompts (conditional disaggregation: `corectl proxy
    --max-prefill-queue`) starts the loads queued behind them in the same step, since a load needs
    blocks, not tokens: held back, they could find the producer's saves dropped."""
    producer, consumer = shm_pair
    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (40, 56)]
    ids = [f"ahead-{i}" for i in range(len(prompts))]
    producer.generate([{"prompt_token_ids": p} for p in prompts],
                      [_greedy(1, {"do_remote_decode": True, "transfer_id": i}) for i in ids], use_tqdm=False)
    assert producer.engine.executor.worker.kv_connector.saves_published(timeout=30)
    engine = consumer.engine
    # One step computes 32 prompt tokens: the local prompt (70 tokens) takes them all.
    monkeypatch.setattr(engine.scheduler.config, "max_num_batched_tokens", 32)
    now = time.monotonic()
    engine.add_requests([EngineCoreRequest("computed", PROMPTS[2][::-1], _greedy(MAX_TOKENS), now)]
                        + [EngineCoreRequest(i, p, _greedy(MAX_TOKENS, {"do_remote_prefill": True, "transfer_id": i}), now)
                           for i, p in zip(ids, prompts)])
    before = engine.scheduler.make_stats()
    steps = [engine.step()]
    assert not engine.scheduler.waiting
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        steps.append(engine.step())
    outputs: dict[str, list[int]] = {}
    for out in (out for step in steps for out in step.outputs):
        outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    stats = engine.scheduler.make_stats()
    assert stats.kv_load_failures == before.kv_load_failures
    assert stats.prompt_tokens_transferred - before.prompt_tokens_transferred == sum(len(p) - 1 for p in prompts)
    expected = producer.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(MAX_TOKENS)] * len(prompts),
                                 use_tqdm=False)
    assert [outputs[i] for i in ids] == [list(o.outputs[0].token_ids) for o in expected]
    _assert_all_blocks_free(producer, consumer)


def test_nothing_to_load_recomputes_the_prompt(shm_pair, reference):
    """The prefill instance died before saving: the decode instance's load times out and it
    recomputes the prompt itself, with the same tokens."""
    _, consumer = shm_pair
    before = consumer.engine.scheduler.make_stats()
    params = [_greedy(MAX_TOKENS, {"do_remote_prefill": True, "transfer_id": f"lost-{i}"}) for i in range(len(PROMPTS))]
    assert _tokens(consumer, params) == reference
    stats = consumer.engine.scheduler.make_stats()
    assert stats.kv_load_failures - before.kv_load_failures == len(PROMPTS)
    assert stats.prompt_tokens_transferred == before.prompt_tokens_transferred
    _assert_all_blocks_free(consumer)


def test_no_producer_recomputes_the_prompt(reference):
    """A consumer whose producer is gone (nobody at the rendezvous) falls back too."""
    extra = {"rendezvous": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 0.5}
    consumer = LLM(**TINY, kv_transfer_config={"kv_connector": "TorchDistributedConnector", "kv_role": "kv_consumer",
                                               "kv_connector_extra_config": extra})
    params = [_greedy(MAX_TOKENS, {"do_remote_prefill": True, "transfer_id": f"gone-{i}"}) for i in range(len(PROMPTS))]
    assert _tokens(consumer, params) == reference
    assert consumer.engine.scheduler.make_stats().kv_load_failures == len(PROMPTS)
    _assert_all_blocks_free(consumer)
    _close(consumer)


def test_abort_while_loading_returns_the_blocks(shm_pair):
    """A request aborted while its load waits gives its blocks back at once; the load's late
    report is ignored."""
    _, consumer = shm_pair
    engine = consumer.engine
    params = _greedy(MAX_TOKENS, {"do_remote_prefill": True, "transfer_id": "never-saved"})
    engine.add_requests([EngineCoreRequest("waits", PROMPTS[2], params, time.monotonic())])
    engine.step()
    assert engine.scheduler.kv.num_free_blocks < engine.scheduler.kv.num_usable_blocks
    engine.abort_requests(["waits"])
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_usable_blocks
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    _assert_all_blocks_free(consumer)


def test_vllms_own_kv_transfer_config_fields_parse():
    from corectl.kv_transfer.config import resolve_kv_transfer_config

    config = resolve_kv_transfer_config({
        "kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer", "kv_buffer_size": 5e9,
        "kv_buffer_device": "cuda", "kv_load_failure_policy": "recompute", "kv_rank": 0, "kv_parallel_size": 2,
        "engine_id": "e0", "enable_permute_local_kv": False})
    assert config.is_producer and config.kv_buffer_size == 5e9


def test_bad_kv_transfer_params_are_refused():
    from corectl.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="transfer_id"):
        SamplingParams(kv_transfer_params={"do_remote_prefill": True, "transfer_id": "../etc"})
    with pytest.raises(InvalidRequestError, match="both"):
        SamplingParams(kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": True, "transfer_id": "a"})


@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}, "SharedMemoryConnector"),
    ({"kv_connector": "TorchDistributedConnector", "kv_role": "kv_both"}, "kv_both"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_sideways"}, "kv_role"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"},
     "kv_load_failure_policy 'fail' is not served"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", "kv_connector_module_path": "my.mod"},
     "kv_connector_module_path is not read"),
    ({"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", "enable_permute_local_kv": True},
     "enable_permute_local_kv is not served"),
])
def test_bad_connector_configs_are_refused_before_loading(config, message):
    from corectl.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        LLM(**TINY, kv_transfer_config=config)


_PRODUCER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from corectl import LLM
from support.engines import TINY
LLM(**TINY, kv_transfer_config={"kv_connector": "TorchDistributedConnector", "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"rendezvous": sys.argv[2], "load_timeout_s": 120}})
print("ready", flush=True)
time.sleep(300)
"""


def test_producer_killed_mid_load_recomputes(reference):
    """The prefill instance dies while the decode instance waits for its blocks: the receive fails,
    the decode instance recomputes the prompt, and its tokens are the same."""
    url = f"tcp://127.0.0.1:{free_port()}"
    producer = subprocess.Popen([sys.executable, "-c", _PRODUCER, str(Path(__file__).parents[2]), url],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert producer.stdout.readline().strip() == "ready"
        consumer = LLM(**TINY, kv_transfer_config={"kv_connector": "TorchDistributedConnector",
                                                   "kv_role": "kv_consumer",
                                                   "kv_connector_extra_config": {"rendezvous": url}})
        engine = consumer.engine
        # The producer holds nothing under this id: it waits for it while the consumer waits for the answer.
        params = _greedy(MAX_TOKENS, {"do_remote_prefill": True, "transfer_id": "in-flight"})
        engine.add_requests([EngineCoreRequest("mid-load", PROMPTS[0], params, time.monotonic())])
        engine.step()
        connector = engine.executor.worker.kv_connector
        deadline = time.monotonic() + 60
        while connector._groups is None and time.monotonic() < deadline:
            engine.step()
        time.sleep(0.5)  # the request for the blocks is on its way
        producer.kill()
        tokens = []
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            tokens += [t for out in engine.step().outputs for t in out.new_token_ids]
    finally:
        producer.kill()
        producer.wait()
    assert tokens == reference[0]
    assert engine.scheduler.make_stats().kv_load_failures == 1
    _assert_all_blocks_free(consumer)
    _close(consumer)


def test_a_transfer_key_names_one_prompt_and_fits_the_wire():
    from corectl.kv_transfer.config import MAX_TRANSFER_ID
    from corectl.kv_transfer.disaggregated import transfer_key

    keys = {transfer_key("t", [1, 2, 3]), transfer_key("t", [1, 2, 4]), transfer_key("u", [1, 2, 3])}
    assert len(keys) == 3 and transfer_key("t", [1, 2, 3]) == transfer_key("t", [1, 2, 3])
    long_ids = ["a" * MAX_TRANSFER_ID, "a" * (MAX_TRANSFER_ID - 1) + "b"]
    long_keys = {transfer_key(tid, [5]) for tid in long_ids}
    assert len(long_keys) == 2 and all(len(key) <= MAX_TRANSFER_ID for key in long_keys)
