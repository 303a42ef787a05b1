"""`stream_interval`: a stream's deltas gather that many tokens, the first token and the end at once."""
from __future__ import annotations

import anyio
import pytest
from corectl import EngineConfig, SamplingParams
from corectl.engine.client import EngineClient
from corectl.errors import ConfigError


def test_deltas_gather_the_interval_and_lose_nothing():
    async def main():
        config = EngineConfig(max_model_len=512, kv_cache_memory_gib=0.05, stream_interval=4)
        async with EngineClient.in_process(config) as client:
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            deltas = [out async for out in client.generate("Count from one to ten:", params, "held")]
            sizes = [len(out.outputs[0].token_ids) for out in deltas]
            # The consumer keeps up (it waits on each delta), so no two deltas merge on its side.
            assert sizes == [1, 4, 4, 1], sizes
            assert [out.finished for out in deltas] == [False, False, False, True]
            ids = [t for out in deltas for t in out.outputs[0].token_ids]
            assert "".join(out.outputs[0].text for out in deltas) == client.tokenizer.decode(ids)
            times = deltas[-1].metrics.token_times
            # One token time a step, each delta saying how many steps it brought.
            assert len(times) == 10 and deltas[-1].metrics.delta_token_times == 1
            assert deltas[-1].metrics.num_generation_tokens == 10
            await _stop_string_ends_a_held_stream(client, "".join(out.outputs[0].text for out in deltas))

    anyio.run(main)


async def _stop_string_ends_a_held_stream(client: EngineClient, full: str) -> None:
    """A stop string that completes while tokens are held ends the stream at once, cut before it."""
    stop = full.strip()[4:7]
    assert len(stop) == 3 and stop in full
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop])
    deltas = [out async for out in client.generate("Count from one to ten:", params, "stopped")]
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"
    assert "".join(out.outputs[0].text for out in deltas) == full[:full.index(stop)]


def test_interval_must_be_positive():
    with pytest.raises(ConfigError, match="stream_interval"):
        EngineConfig(stream_interval=0)
