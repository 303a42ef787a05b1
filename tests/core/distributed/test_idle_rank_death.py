"""A tensor-parallel rank that dies while the server is idle (issue 27, defect 5): the engine watches its
ranks between requests too, so /health turns 503 within 5 s and the server exits non-zero."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from support.models import build_random_checkpoint
from support.server import SMALL_ENGINE_FP32, rank_processes, running_server

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path, default_model_dir):
    checkpoint = build_random_checkpoint("qwen2", tmp_path / "qwen2", default_model_dir)
    with running_server(str(checkpoint), "-tp", "2", "--served-model-name", "tiny", *SMALL_ENGINE_FP32) as process:
        yield process


def test_a_rank_killed_while_idle_is_noticed_without_a_request(server):
    ranks = rank_processes(server)
    assert len(ranks) == 2, ranks
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = time.monotonic()
    while time.monotonic() - killed_at < 5:
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 503:
                break
        except httpx.TransportError:
            break  # already shut down: it noticed
        time.sleep(0.1)
    assert time.monotonic() - killed_at < 5
    assert server.proc.wait(30) != 0  # as after a death mid-stream: requests drain, then it exits
    assert "tensor-parallel rank 1" in server.log()
