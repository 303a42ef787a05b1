"""Data parallelism through the client (`corectl.engine.dp`): two engine cores behind one
`EngineClient` spread the requests, answer as one engine does, and keep a prefix on the engine that
cached it. Random-weight Llama preset, token-id prompts, in-process engines."""
from __future__ import annotations

import anyio
import pytest
from corectl import LLM, EngineConfig, SamplingParams
from corectl.engine.client import EngineClient
from corectl.engine.dp import DataParallelEngines, engine_config, engine_devices
from corectl.errors import ConfigError
from support.engines import TINY

ENGINE = {**TINY, "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(20 + 9 * i)] for i in range(6)]


pytestmark = pytest.mark.usefixtures("isolated_env")


async def _generate(client: EngineClient, prompt: list[int], params: SamplingParams = GREEDY):
    token_ids, cached = [], 0
    async for out in client.generate(prompt, params):
        token_ids += out.outputs[0].token_ids
        cached = out.num_cached_tokens
    return token_ids, cached


def _run_dp2(body):
    async def main():
        async with EngineClient.in_process(EngineConfig(**ENGINE, data_parallel_size=2)) as client:
            assert isinstance(client.transport, DataParallelEngines)
            return await body(client)

    return anyio.run(main)


def test_two_engines_share_the_load_and_answer_as_one_engine():
    async def body(client):
        results = [None] * len(PROMPTS)

        async def one(i):
            results[i] = (await _generate(client, PROMPTS[i]))[0]

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        return results, client.engine_stats, client.stats

    served, per_engine, total = _run_dp2(body)
    single = LLM(**ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert served == [out.outputs[0].token_ids for out in single]
    # Both engines looked up prompts (each served some), and the client's stats add them up.
    assert all(stats.prefix_cache_queries > 0 for stats in per_engine)
    assert total.prefix_cache_queries == sum(stats.prefix_cache_queries for stats in per_engine)
    assert sum(stats.prefix_cache_queries for stats in per_engine) == sum(map(len, PROMPTS))


def test_a_shared_prefix_goes_back_to_the_engine_that_cached_it():
    document = [(11 * j) % 500 + 1 for j in range(160)]  # ten full blocks

    async def body(client):
        _, first_cached = await _generate(client, document + [3, 4])
        before = [stats.prefix_cache_hits for stats in client.engine_stats]
        # The engines are idle again: without affinity the next request would go to the other one.
        _, second_cached = await _generate(client, document + [9, 9, 9])
        hits = [after.prefix_cache_hits - b for after, b in zip(client.engine_stats, before)]
        unrelated = await _generate(client, [(13 * j) % 500 + 1 for j in range(40)])
        return first_cached, second_cached, hits, client.engine_stats, unrelated[1]

    first_cached, second_cached, hits, per_engine, unrelated_cached = _run_dp2(body)
    assert first_cached == 0 and second_cached == 160
    assert sorted(hits) == [0, 160]
    # A prompt sharing nothing went to the other engine, so both served.
    assert unrelated_cached == 0 and all(stats.prefix_cache_queries > 0 for stats in per_engine)


def test_n_samples_stay_on_one_engine_and_aborts_reach_it():
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def body(client):
        outs = [out async for out in client.generate(PROMPTS[0], params)]
        queries = [stats.prefix_cache_queries for stats in client.engine_stats]
        stream = client.generate(PROMPTS[1], long)
        await stream.__anext__()
        await stream.aclose()  # the consumer leaves: the client aborts the request in its engine
        while client.stats.num_running:
            await anyio.sleep(0.01)
        return outs, queries, client.engine_stats

    outs, queries, per_engine = _run_dp2(body)
    assert sum(len(o.outputs) for o in outs[:1]) == 3
    # One engine looked up the three samples' prompt blocks; the other saw none of them.
    assert sorted(queries) == [0, 3 * len(PROMPTS[0])]
    assert all(stats.num_running == 0 and stats.kv_cache_usage == 0 for stats in per_engine)


def test_each_engine_gets_its_own_devices_and_share_of_cores():
    assert [engine_devices(i, 2, None) for i in range(3)] == ["0,1", "2,3", "4,5"]
    assert engine_devices(1, 2, "4,5,6,7") == "6,7"
    with pytest.raises(ConfigError, match="data_parallel_size"):
        engine_devices(2, 2, "4,5,6,7")
    config = engine_config(EngineConfig(data_parallel_size=2, tensor_parallel_size=2), 1)
    assert config.data_parallel_size == 1 and config.num_threads >= 1
    assert engine_config(EngineConfig(data_parallel_size=2, num_threads=3), 0).num_threads == 3


def test_a_failed_start_raises_the_engines_error_once():
    async def main():
        async with EngineClient.in_process(EngineConfig(**ENGINE, data_parallel_size=2, max_model_len=4096)):
            pass

    # The client's task group wraps what its body raises; inside is the one error, not one per engine.
    with pytest.raises(ExceptionGroup) as group:
        anyio.run(main)
    [error] = group.value.exceptions
    assert isinstance(error, ConfigError) and error.field == "max_model_len"


def test_the_offline_llm_refuses_data_parallelism():
    with pytest.raises(ConfigError, match="data_parallel_size"):
        LLM(**ENGINE, data_parallel_size=2)
