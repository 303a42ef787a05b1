"""`corectl proxy` in front of a prefill and a decode `corectl serve` (SharedMemoryConnector), end to
end with the `openai` client: completions and streamed chat answer as one instance does, the decode
instance's metrics show the prompt tokens it received instead of computing, its KV blocks all come
back, and with the prefill instance killed the answers stay the same (the decode instance computes
the prompts itself)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.models import build_random_checkpoint
from support.server import SMALL_ENGINE_FP32, ServerProcess, await_health, free_port

PROMPT = "The capital of France is a city where"
MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow, please."}]


def _kv_config(role: str, folder) -> str:
    return json.dumps({"kv_connector": "SharedMemoryConnector", "kv_role": role,
                       "kv_connector_extra_config": {"path": str(folder), "load_timeout_s": 5}})


class ProxyProcess:
    def __init__(self, prefill: str, decode: str, *flags: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen([sys.executable, "-m", "corectl.server.cli", "proxy", "--prefill", prefill,
                                      "--decode", decode, "--port", self.url.rsplit(":", 1)[1], *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        problem = await_health(self.url, self.proc, 60)
        if problem:
            raise RuntimeError(f"the proxy {problem}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    model = build_random_checkpoint("llama", tmp_path_factory.mktemp("pd-model"), default_model_dir)
    shm = tmp_path_factory.mktemp("pd-kv")
    # The engine in each server's own process: two fewer processes to start on a busy machine.
    common = [str(model), *SMALL_ENGINE_FP32, "--served-model-name", "m", "--engine-in-process", "--kv-transfer-config"]
    prefill = ServerProcess(*common, _kv_config("kv_producer", shm))
    decode = ServerProcess(*common, _kv_config("kv_consumer", shm))
    prefill.wait_ready(), decode.wait_ready()
    proxy = ProxyProcess(prefill.url, decode.url)
    yield prefill, decode, proxy
    proxy.stop()
    for server in (prefill, decode):
        server.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _completion(url: str) -> str:
    return _client(url).completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text


def _streamed_chat(url: str) -> str:
    stream = _client(url).chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=0,
                                                  stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^vllm:{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"vllm:{name} {labels} not in /metrics"
    return float(match.group(1))


def test_proxy_answers_as_one_instance(cluster):
    prefill, decode, proxy = cluster
    # The prefill instance serves plain requests itself: its answers are the one-instance reference.
    want_text = _completion(prefill.url)
    want_chat = _client(prefill.url).chat.completions.create(model="m", messages=MESSAGES, max_tokens=12,
                                                             temperature=0).choices[0].message.content
    assert _completion(proxy.url) == want_text
    assert _streamed_chat(proxy.url) == want_chat
    # The decode instance received both prompts but for their last tokens, and holds no block now.
    assert _metric(decode.url, "prompt_tokens_by_source_total", 'source="external_kv_transfer"') > 10
    assert _metric(decode.url, "prompt_tokens_by_source_total", 'source="local_compute"') == 2
    assert _metric(decode.url, "kv_load_failures_total") == 0
    assert _metric(decode.url, "kv_cache_usage_perc") == 0
    assert _metric(prefill.url, "kv_transfer_bytes_total", 'direction="save"') > 0


def test_a_batch_of_prompts_and_the_prompts_logprobs_answer_as_one_instance(cluster):
    """Each prompt of a batch loads its own blocks (they travel under the transfer id and a digest of
    the prompt), and requests for the prompt's logprobs come back whole."""
    prefill, decode, proxy = cluster
    bodies = [
        # Prompts of their own: the decode instance's prefix cache must not hold PROMPT for later tests.
        {"prompt": ["A long time ago, in a galaxy", "1 2 3 4 5 6 7 8 9", "Once upon a time"], "max_tokens": 8},
        {"prompt": "Count: 1, 2, 3,", "max_tokens": 5, "echo": True, "logprobs": 1},
        {"prompt": "Count: 1, 2, 3,", "max_tokens": 5, "prompt_logprobs": 1},
    ]
    failures = _metric(decode.url, "kv_load_failures_total")
    for body in bodies:
        body = {"model": "m", "temperature": 0, **body}
        want = httpx.post(prefill.url + "/v1/completions", json=body, timeout=120).json()["choices"]
        got = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120).json()["choices"]
        assert [c["text"] for c in got] == [c["text"] for c in want]
        assert [c["logprobs"] for c in got] == [c["logprobs"] for c in want]
        assert [c.get("prompt_logprobs") for c in got] == [c.get("prompt_logprobs") for c in want]
    assert _metric(decode.url, "kv_load_failures_total") == failures
    assert _metric(decode.url, "kv_cache_usage_perc") == 0


def test_a_refused_request_gets_the_answer_one_instance_gives(cluster):
    """The prefill half asks for one token; a refusal must still name what the client sent."""
    prefill, _, proxy = cluster
    body = {"model": "m", "prompt": "hi " * 5000, "max_tokens": 3}
    want = httpx.post(prefill.url + "/v1/completions", json=body, timeout=120)
    got = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
    assert want.status_code == got.status_code == 400 and got.json() == want.json()
    assert "plus 3 completion tokens" in got.json()["error"]["message"]


def test_a_busy_prefill_instance_leaves_prompts_to_the_decode_instance(cluster):
    """--max-prefill-queue 1: of requests arriving together, the first takes the prefill instance and
    the others find it full, so the decode instance computes their prompts; every answer is the same."""
    prefill, decode, _ = cluster
    want_text = _completion(prefill.url)
    computed = _metric(decode.url, "prompt_tokens_by_source_total", 'source="local_compute"')
    proxy = ProxyProcess(prefill.url, decode.url, "--max-prefill-queue", "1")
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _completion(proxy.url), range(4)))
    finally:
        proxy.stop()
    assert answers == [want_text] * 4
    # A transferred prompt adds one computed token (its last); a prompt computed here adds all of its own.
    assert _metric(decode.url, "prompt_tokens_by_source_total", 'source="local_compute"') - computed > 4 + 2
    assert _metric(decode.url, "kv_load_failures_total") == 0
    assert _metric(decode.url, "kv_cache_usage_perc") == 0


def test_a_local_prefill_bound_queues_the_overflow_at_the_prefill_instance(cluster):
    """--max-prefill-queue 1 --max-local-prefills 1: of four requests arriving together one takes the
    prefill instance, one the decode instance (held until its answer, unstreamed), and the other two
    queue for the prefill instance instead of piling onto the decode instance; then a streamed chat
    request finds both free again. Every answer is the same."""
    prefill, decode, _ = cluster
    want_text = _completion(prefill.url)
    prompt_tokens = _client(prefill.url).completions.create(model="m", prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    computed = _metric(decode.url, "prompt_tokens_by_source_total", 'source="local_compute"')
    proxy = ProxyProcess(prefill.url, decode.url, "--max-prefill-queue", "1", "--max-local-prefills", "1")
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _completion(proxy.url), range(4)))
        assert _streamed_chat(proxy.url) == _streamed_chat(prefill.url)
    finally:
        proxy.stop()
    assert answers == [want_text] * 4
    # A transferred prompt adds one computed token (its last), one computed here all of its own.
    local = (_metric(decode.url, "prompt_tokens_by_source_total", 'source="local_compute"') - computed - 5)
    assert 1 <= local / (prompt_tokens - 1) <= 2, local  # without the bound three of the four come here
    assert _metric(decode.url, "kv_load_failures_total") == 0
    assert _metric(decode.url, "kv_cache_usage_perc") == 0


def test_dead_prefill_instance_costs_time_not_answers(cluster):
    prefill, decode, proxy = cluster
    want_text = _completion(prefill.url)
    os.kill(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(30)
    assert _completion(proxy.url) == want_text
    assert _metric(decode.url, "kv_cache_usage_perc") == 0
