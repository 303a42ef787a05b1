"""Fixtures: shared real servers (the default model with an API key, without one, as a pooling model)
and clients for them, started once per session (per pytest-xdist worker)."""
from __future__ import annotations

import httpx
import pytest
from support.server import API_KEY, SMALL_ENGINE, SMALL_ENGINE_FP32, ServerProcess


@pytest.fixture(scope="session")
def server():
    """One server for the read-mostly API tests: the default model, an API key, 32 sequences,
    async scheduling, as on GPUs (the lifecycle tests' servers keep the CPU's synchronous loop), and a
    Responses store of two entries (test_responses_api shows eviction after a third; no other test
    stores responses here)."""
    proc = ServerProcess(*SMALL_ENGINE, "--api-key", API_KEY, "--max-num-seqs", "32", "--async-scheduling",
                         "--responses-store-max-entries", "2").wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def model_id(openai_client) -> str:
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="session")
def keyless_server():
    """A server without an API key (what a web page could reach, and what the README's examples call),
    a small bound on waiting requests, and sleep mode allowed (test_sleep_routes puts it to sleep and
    wakes it again; nothing else reads the flag, so one server start serves both)."""
    proc = ServerProcess(*SMALL_ENGINE, "--max-queued-requests", "8", "--enable-sleep-mode").wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="session")
def pooling_server():
    """The default model served as a pooling model (LAST pooling, normalised; Matryoshka truncation
    allowed through --hf-overrides), for /v1/embeddings. In fp32: test_embeddings compares its vectors
    with transformers' fp32 model."""
    proc = ServerProcess(*SMALL_ENGINE_FP32, "--api-key", API_KEY, "--runner", "pooling",
                         "--hf-overrides", '{"is_matryoshka": true}').wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="session")
def pooling_http(pooling_server):
    with httpx.Client(base_url=pooling_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120) as client:
        yield client
