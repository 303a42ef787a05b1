"""Embeddings through every path of the engine on a small preset (random weights, token-id prompts):
offline, the async client in process and over the engine process's socket, refusals and aborts."""
from __future__ import annotations

import anyio
import numpy as np
import pytest
from corectl import LLM, EngineConfig, PoolingParams
from corectl.engine.client import EngineClient
from corectl.engine.remote import RemoteEngine
from support.engines import TINY

POOLING = {**TINY, "runner": "pooling", "pooling_type": "MEAN", "max_num_batched_tokens": 32, "dtype": "float32"}
PROMPTS = [[5, 6, 7], list(range(10, 80)), [9] * 40]


# Presets write their config to a cache folder of the module's own; no test may reach the hub.
pytestmark = pytest.mark.usefixtures("isolated_env")


@pytest.fixture(scope="module")
def offline():
    llm = LLM(**POOLING)
    return [np.array(out.outputs.embedding) for out in llm.embed(PROMPTS, use_tqdm=False)]


async def _embed_all(client: EngineClient) -> list[np.ndarray]:
    vectors = []
    for prompt in PROMPTS:
        outs = [out async for out in client.encode(prompt, PoolingParams())]
        assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "stop"
        vectors.append(np.array(outs[0].outputs.embedding))
    return vectors


def test_the_async_client_embeds_as_offline_in_process_and_over_the_socket(offline):
    config = EngineConfig(**POOLING)

    async def main():
        async with EngineClient.in_process(config) as client:
            in_process = await _embed_all(client)
        async with anyio.create_task_group() as tg:
            transport = await RemoteEngine.start(config, tg, hang_timeout=120.0)
            async with EngineClient.serving(transport, config, tg) as client:
                assert client.info.pooling.pooling_type == "MEAN"  # EngineInfo crossed the socket
                remote = await _embed_all(client)
        return in_process, remote

    in_process, remote = anyio.run(main)
    for a, b, c in zip(offline, in_process, remote):
        assert abs(np.linalg.norm(a) - 1) < 1e-5
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(a, c, atol=1e-5)


def test_a_consumer_that_stops_aborts_its_request_and_frees_its_blocks():
    config = EngineConfig(**POOLING)

    async def main():
        async with EngineClient.in_process(config) as client:
            async def consume():
                async for _ in client.encode([7] * 512, PoolingParams()):  # 16 chunks of 32 tokens
                    raise AssertionError("the embedding finished before its consumer stopped")

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                with anyio.fail_after(30):
                    while not client.stats.num_running:
                        await anyio.sleep(0.001)
                tg.cancel_scope.cancel()
            assert client.num_live_requests == 0
            with anyio.fail_after(30):
                while client.stats.num_running or client.stats.kv_cache_usage:
                    await anyio.sleep(0.01)
            outs = [out async for out in client.encode([1, 2, 3], PoolingParams())]
            assert outs[0].finish_reason == "stop"

    anyio.run(main)


def test_past_the_queue_bound_an_embedding_finishes_as_abort():
    llm = LLM(**POOLING, max_queued_requests=1)
    outs = llm.embed([[1, 2, 3], [4, 5]], use_tqdm=False)
    assert [(o.finish_reason, len(o.outputs.embedding) > 0) for o in outs] == [("stop", True), ("abort", False)]
