"""`corectl serve -tp 2`: the OpenAI API answers as one device does, and a rank's death ends the
server cleanly (the client gets an error, /health turns 503, the server exits 1, no process stays)."""
from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest
from support.models import build_random_checkpoint
from support.server import (
    PARITY_PROMPTS,
    SMALL_ENGINE,
    alive,
    assert_serves_like_one_device,
    descendants,
    rank_processes,
    running_server,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir):
    return build_random_checkpoint("qwen2", tmp_path_factory.mktemp("serve-tp") / "qwen2", default_model_dir)


@pytest.fixture
def server(checkpoint):
    with running_server(str(checkpoint), "-tp", "2", "--served-model-name", "tiny", *SMALL_ENGINE) as process:
        yield process


def test_serve_tp2_completes_like_one_device(server, checkpoint):
    assert_serves_like_one_device(server, checkpoint)


def test_a_rank_killed_mid_stream_ends_the_server_cleanly(server):
    ranks = rank_processes(server)
    assert len(ranks) == 2, ranks
    started = descendants(server.proc.pid)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt=PARITY_PROMPTS[0], max_tokens=400, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = [next(iter(stream))]
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError, match="rank"):
        received.extend(stream)
    assert time.monotonic() - killed_at < 10 and len(received) < 400
    assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    assert server.proc.wait(30) == 1
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if alive(pid)] == []
