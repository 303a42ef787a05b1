"""`corectl serve -tp 2`: the OpenAI API answers as one device does, and a rank's death ends the
server cleanly (the client gets an error, /health turns 503, the server exits 1, no process stays)."""
from __future__ import annotations

import time

import pytest
from support.models import build_random_checkpoint
from support.server import (
    SMALL_ENGINE_FP32,
    alive,
    assert_rank_death_ends_the_stream,
    assert_serves_like_one_device,
    descendants,
    rank_processes,
    running_server,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir):
    return build_random_checkpoint("qwen2", tmp_path_factory.mktemp("serve-tp") / "qwen2", default_model_dir)


@pytest.fixture(scope="module")
def server(checkpoint):
    """One server for the module: the parity test only reads from it, the rank-death test ends it
    (it runs last, in file order)."""
    with running_server(str(checkpoint), "-tp", "2", "--served-model-name", "tiny", *SMALL_ENGINE_FP32) as process:
        yield process


def test_serve_tp2_completes_like_one_device(server, checkpoint):
    assert_serves_like_one_device(server, checkpoint)


def test_a_rank_killed_mid_stream_ends_the_server_cleanly(server):
    assert len(rank_processes(server)) == 2
    started = descendants(server.proc.pid)
    assert_rank_death_ends_the_stream(server, 1, "rank")
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if alive(pid)] == []
