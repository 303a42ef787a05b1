"""Sleep mode on the embedded SmolLM2: the offline LLM and the engine core sleep at levels 1 and 2
(KV cache freed, cached prefixes dropped, weights offloaded or dropped), refuse work while asleep,
wake up whole or one part at a time, and then generate exactly what they generated before."""
from __future__ import annotations

import pytest
from corectl import LLM, SamplingParams
from corectl.engine.messages import EngineCoreRequest
from corectl.errors import ConfigError

PROMPTS = ["The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
           "One, two, three, four, five, six, seven, eight, nine, ten, eleven,"]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=128, kv_cache_memory_gib=0.02, max_num_seqs=4, enable_sleep_mode=True)


def texts(llm):
    return [out.outputs[0].text for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_same_greedy_output_after_sleeping(llm, level):
    before = texts(llm)
    core = llm.engine
    assert core.scheduler.kv.pool._cached  # the prompts' blocks, which the freed KV cache no longer holds
    llm.sleep(level)
    assert core.sleep_level == level and not core.scheduler.kv.pool._cached
    worker = core.executor.worker
    assert worker.runner is None if level == 2 else worker.runner.kv_caches == []
    llm.wake_up()
    assert core.sleep_level == 0
    assert texts(llm) == before


def test_wake_up_by_tags_and_refusals(llm):
    before = texts(llm)
    llm.sleep(2)
    with pytest.raises(ConfigError, match="already asleep"):
        llm.sleep(1)
    with pytest.raises(ConfigError, match="wake them up before the KV cache"):
        llm.wake_up(["kv_cache"])
    core = llm.engine
    # A request that arrives while asleep ends alone, with a clear reason.
    core.add_requests([EngineCoreRequest("asleep", [1, 2, 3], GREEDY, arrival_time=0.0)])
    [refused] = core.step().outputs
    assert refused.finish_reason == "abort" and "asleep" in refused.error
    llm.wake_up(["weights"])
    assert core.sleep_level == 2
    llm.wake_up(["kv_cache"])
    assert core.sleep_level == 0 and texts(llm) == before
    llm.sleep(1)
    with pytest.raises(ConfigError, match="unknown wake-up tags"):
        llm.wake_up(["everything"])
    llm.wake_up()
    assert texts(llm) == before
