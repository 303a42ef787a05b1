"""`corectl serve -dp 2`: two engine processes behind one server. Both serve, `/load` and `/metrics`
name each engine, a shared prefix returns to the engine that cached it, and one engine's death turns
`/health` 503 and ends the server with status 1 and no process left."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.models import build_random_checkpoint
from support.server import SMALL_ENGINE_FP32, ServerProcess, alive, descendants, running_server

pytestmark = pytest.mark.slow

DOCUMENT = " ".join(f"Clause {i}: the tenant keeps the garden tidy and pays on the first day." for i in range(12))


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    # Routing and the engines' lifetimes do not depend on the weights: a small random model starts fastest.
    checkpoint = build_random_checkpoint("qwen2", tmp_path_factory.mktemp("serve-dp") / "qwen2", default_model_dir)
    with running_server(str(checkpoint), "-dp", "2", "--served-model-name", "smol", *SMALL_ENGINE_FP32) as process:
        yield process


def engine_pids(server: ServerProcess) -> list[int]:
    children = descendants(server.proc.pid)
    return [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def engine_samples(server: ServerProcess, name: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {sample.labels["engine"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def complete(client: openai.OpenAI, prompt: str):
    return client.completions.create(model="smol", prompt=prompt, max_tokens=4, temperature=0.0,
                                     extra_body={"ignore_eos": True})


def test_both_engines_serve_and_a_prefix_returns_to_its_engine(server):
    assert len(engine_pids(server)) == 2
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    first = complete(client, DOCUMENT + " Question one: who keeps the garden?")
    second = complete(client, DOCUMENT + " Question two: when is rent due?")
    assert first.usage.prompt_tokens_details is None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 2
    # The engines were idle: without affinity the second request would have gone to the other one.
    hits = engine_samples(server, "vllm:prefix_cache_hits_total")
    assert sorted(hits) == ["0", "1"] and sorted(hits.values()) == [0, cached]
    # Idle engines alternate: an unrelated prompt goes to the engine that has not served yet.
    complete(client, "A short unrelated question about the weather?")
    queries = engine_samples(server, "vllm:prefix_cache_queries_total")
    assert all(value > 0 for value in queries.values())
    load = httpx.get(server.url + "/load", timeout=10).json()
    assert [engine["engine"] for engine in load["engines"]] == ["0", "1"]
    assert load["num_requests_running"] == sum(e["num_requests_running"] for e in load["engines"]) == 0


def test_an_engine_killed_turns_health_503_and_ends_the_server(server):
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    started = descendants(server.proc.pid)
    os.kill(engine_pids(server)[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "health stayed 200 after an engine died"
        time.sleep(0.05)
    assert server.proc.wait(30) == 1
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if alive(pid)] == []
