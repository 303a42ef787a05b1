"""`corectl serve --api-server-count 2`: two API processes on one port and one engine process answer
like one server, report the whole server's metrics, and go down together (non-zero) when one dies."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.server import API_KEY, SMALL_ENGINE, ServerProcess, alive, descendants

PROMPTS = [f"Name {i} colours." for i in range(6)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def two_api_servers():
    proc = ServerProcess(*SMALL_ENGINE, "--api-key", API_KEY, "--max-num-seqs", "32", "--api-server-count", "2")
    try:
        proc.wait_ready(600)  # three processes to start: allow for a busy machine
        yield proc
    finally:
        proc.stop()


def _answers(url: str) -> list[str]:
    """Every prompt at once, from a client of its own (a connection each), streamed and not by turns."""
    from openai import OpenAI

    def ask(i: int) -> str:
        client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": PROMPTS[i]}]
        if i % 2:
            return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0).choices[0].message.content
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


def _logged(proc: ServerProcess, event: str) -> list[dict]:
    records = (json.loads(line) for line in proc.log().splitlines() if line.startswith("{"))
    return [r for r in records if r.get("event") == event]


def test_two_api_processes_answer_as_one_and_count_every_request(two_api_servers, server):
    assert _answers(two_api_servers.url) == _answers(server.url)
    # A connection each request (the client keeps none open), so the kernel spreads them over both
    # processes' sockets; one client, as `httpx.get` builds an SSL context per call (~50 ms of CPU).
    with httpx.Client(base_url=two_api_servers.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                      limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for _ in range(16):
            body = {"model": "x", "prompt": "Hi", "max_tokens": 1}
            body["model"] = http.get("/v1/models").json()["data"][0]["id"]
            assert http.post("/v1/completions", json=body).status_code == 200
        finished = _logged(two_api_servers, "request finished")
        assert {r["api_server"] for r in finished} == {0, 1}  # both processes served requests
        for _ in range(4):  # whichever process answers the scrape reports the whole server
            text = http.get("/metrics").text
            counts = re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.]+)$', text, re.MULTILINE)
            assert sum(float(c) for c in counts) == len(PROMPTS) + 16 == len(finished)
            generated = re.search(r'^vllm:generation_tokens_total\{[^}]*\} ([0-9.]+)$', text, re.MULTILINE)
            assert float(generated.group(1)) == sum(r["generation_tokens"] for r in finished)
            assert 'vllm:num_requests_running{engine="0"' in text


def test_a_dead_api_process_takes_the_server_down(two_api_servers):
    api_pids = [int(m) for m in re.findall(r"Started server process \[(\d+)\]", two_api_servers.log())]
    assert len(api_pids) == 2
    below = descendants(two_api_servers.proc.pid)
    os.kill(api_pids[0], signal.SIGKILL)
    status = two_api_servers.proc.wait(120)
    assert status != 0
    assert "corectl-api-0 ended" in two_api_servers.log() or "corectl-api-1 ended" in two_api_servers.log()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in below)  # the other API process and the engine went with it
