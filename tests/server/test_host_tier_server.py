"""`corectl serve --kv-offload-bytes` through the OpenAI SDK: prompts whose shared prefixes outgrow the
device's KV cache come back from the host tier on their second round (cached prompt tokens in the
usage, the host tier's hits and bytes in /metrics, none from the device's own prefix cache), with
the same greedy text as the first round."""
from __future__ import annotations

import random
import re

import httpx
import pytest
from support.server import running_server

# 0.05 GiB holds about 1,100 tokens of the default model: four prompts of ~580 tokens do not fit together.
ENGINE = ["--max-model-len", "1024", "--kv-cache-memory", "0.05", "--kv-offload-bytes", "200MB"]


@pytest.fixture(scope="module")
def server():
    with running_server(*ENGINE) as proc:
        yield proc


def _metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(value) for value in re.findall(rf"^vllm:{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.M))


def test_evicted_prefixes_come_back_from_host_memory(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    words = random.Random(0)
    prompts = [" ".join(words.choice(["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma"])
                        for _ in range(500)) + f" Question {index}:" for index in range(4)]
    first = [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    assert all(r.usage.prompt_tokens_details is None for r in first)  # nothing cached yet
    hits_before, loaded_before = _metric(server, "kv_offload_hit_tokens_total"), _metric(
        server, "kv_transfer_bytes_total", 'direction="load"')
    second = [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    assert [r.choices[0].text for r in second] == [r.choices[0].text for r in first]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in second]
    # The device cache held the last prompt's blocks at most: the first prompts' came from the host.
    assert all(count >= 512 for count in cached[:3]), cached
    host_hits = _metric(server, "kv_offload_hit_tokens_total") - hits_before
    assert host_hits >= sum(cached[:3])
    assert _metric(server, "kv_transfer_bytes_total", 'direction="load"') > loaded_before
