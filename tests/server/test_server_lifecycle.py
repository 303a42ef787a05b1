"""Process behaviour: queue bound, SIGTERM drain, dead and hung engines, startup errors."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time

import httpx
import pytest
from support.server import SMALL_ENGINE, ServerProcess, free_port
from support.server_a_cli import cli_runs


def _health_until_down(url: str) -> list[int | str]:
    """/health statuses on fresh connections until the server stops answering."""
    seen: list[int | str] = []
    deadline = time.monotonic() + 60
    # One client that keeps no connection open: each poll still connects afresh, but `httpx.get`
    # would build an SSL context per call (~50 ms of CPU), which at this rate took a core from the
    # server being watched.
    with httpx.Client(timeout=5, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while time.monotonic() < deadline:
            try:
                seen.append(client.get(url + "/health").status_code)
            except httpx.TransportError:
                seen.append("down")
                return seen
            time.sleep(0.02)
    raise AssertionError(f"the server kept answering: {seen[-5:]}")


def test_queue_full_is_429_and_sigterm_drains_running_requests():
    # A generous drain window: the running stream must finish however loaded the machine is.
    server = ServerProcess(*SMALL_ENGINE, "--max-num-seqs", "1", "--max-queued-requests", "1",
                           "--shutdown-timeout", "300").wait_ready()
    try:
        asyncio.run(_queue_then_drain(server))
        assert server.proc.wait(60) == 0
        assert "request finished" in server.log()
    finally:
        server.stop()


async def _queue_then_drain(server: ServerProcess) -> None:
    long = {"prompt": "Count from one to a hundred:", "max_tokens": 32, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=long) as running:
            lines = running.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            queued = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}))
            while (await client.get("/load")).json()["num_requests_waiting"] < 1:
                await asyncio.sleep(0.02)
            refused = await client.post("/v1/completions", json={"prompt": "One more", "max_tokens": 4})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            server.proc.send_signal(signal.SIGTERM)
            statuses = await asyncio.to_thread(_health_until_down, server.url)
            assert set(statuses) <= {200, 503, "down"} and statuses[-1] == "down"
            rest = [line async for line in lines if line]
        frames = [json.loads(line[6:]) for line in rest[:-1]]
        assert rest[-1] == "data: [DONE]" and frames[-1]["choices"][0]["finish_reason"] == "length"
        done = await queued
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4


def test_requests_running_when_the_drain_time_runs_out_end_with_a_503():
    """--shutdown-timeout 1: a stream and a whole request that cannot finish get the server's 503 (an
    error event and [DONE] on the stream) before it stops, not a bare 500 or a cut connection."""
    server = ServerProcess(*SMALL_ENGINE, "--shutdown-timeout", "1").wait_ready()
    try:
        asyncio.run(_cut_at_the_deadline(server))
        assert server.proc.wait(60) == 0
        assert "ended with a 503" in server.log() and "Exception in ASGI application" not in server.log()
    finally:
        server.stop()


async def _cut_at_the_deadline(server: ServerProcess) -> None:
    body = {"prompt": "Count from one to a thousand:", "max_tokens": 500, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        whole = asyncio.create_task(client.post("/v1/completions", json=body))
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            lines = streamed.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "service_unavailable" and "--shutdown-timeout" in error["message"]
        answer = await whole
        assert answer.status_code == 503 and "--shutdown-timeout" in answer.json()["error"]["message"]


def _finished(metrics: str) -> dict[str, float]:
    return {reason: float(value) for reason, value in re.findall(
        r'^vllm:request_success_total\{[^}]*finished_reason="(\w+)"[^}]*\} (\S+)$', metrics, re.MULTILINE)}


def test_a_request_cancelled_while_queued_counts_as_aborted():
    """It never had an output to time, but it ended: request_success_total counts it."""
    server = ServerProcess(*SMALL_ENGINE, "--max-num-seqs", "1").wait_ready()
    try:
        long = {"prompt": "Count from one to a hundred:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=0.5)
                assert [line for line in lines if line][-1] == "data: [DONE]"
            deadline = time.monotonic() + 30
            while (ended := _finished(client.get("/metrics").text)).get("abort") != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert {reason: n for reason, n in ended.items() if n} == {"abort": 1, "length": 1}
    finally:
        server.stop()


def test_dead_engine_fails_health_and_exits_nonzero():
    server = ServerProcess(*SMALL_ENGINE).wait_ready()
    try:
        body = {"prompt": "Count from one to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(server.engine_pid(), signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "service_unavailable" and "engine" in error["message"]
        statuses = _health_until_down(server.url)
        assert 503 in statuses and statuses[-1] == "down"
        assert server.proc.wait(60) == 1
        assert "killed by SIGKILL" in server.log()
    finally:
        server.stop()


def test_hung_engine_is_detected_and_killed():
    server = ServerProcess(*SMALL_ENGINE, "--engine-hang-timeout", "2").wait_ready()
    try:
        engine = server.engine_pid()
        os.kill(engine, signal.SIGSTOP)
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert response.status_code == 503
        assert "while requests were pending" in response.json()["error"]["message"]
        assert server.proc.wait(60) == 1
        with pytest.raises(ProcessLookupError):
            os.kill(engine, 0)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def failed_starts():
    """Two servers that must not start (a context above the model's, a taken port), run in one
    interpreter (one import of torch and corectl for both); the port's number with its run."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        port_taken, too_long = cli_runs(
            ["serve", "--log-format", "json", "--port", str(port)],
            ["serve", "--log-format", "json", "--port", str(free_port()), "--max-model-len", "99999",
             "--kv-cache-memory", "0.05"])
    return too_long, (port, port_taken)


def test_startup_error_is_one_clear_line(failed_starts):
    out = failed_starts[0]
    assert out.returncode == 2
    assert "corectl: error: max_model_len: 99999 exceeds the model's limit" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_taken_port_fails_before_the_engine_starts(failed_starts):
    port, out = failed_starts[1]
    assert out.returncode == 2
    assert f"corectl: error: port: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "engine" not in out.stdout + out.stderr.replace("corectl: error", "")

