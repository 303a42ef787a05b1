"""Sleep mode over HTTP on the embedded SmolLM2 (the shared keyless server, engine in its own process):
POST /sleep, GET /is_sleeping, a 503 for generation while asleep, POST /wake_up (whole or by tags), and
the same greedy completion afterwards; without --enable-sleep-mode the routes answer 400."""
from __future__ import annotations

import httpx
import pytest

BODY = {"prompt": "The capital of France is Paris. The capital of Italy is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def sleepy(keyless_server):
    """The shared keyless server (started with --enable-sleep-mode); awake again afterwards, whatever
    a test left, for the other tests of this worker."""
    with httpx.Client(base_url=keyless_server.url, timeout=300) as client:
        yield client
        assert client.post("/wake_up").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}


def complete(client: httpx.Client) -> str:
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("level,wake", [(1, [None]), (2, [["weights"], ["kv_cache"]])])
def test_sleep_and_wake_keep_the_output(sleepy, level, wake):
    before = complete(sleepy)
    assert sleepy.post("/sleep", params={"level": level}).status_code == 200
    assert sleepy.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = sleepy.post("/v1/completions", json=BODY)
    assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
    for tags in wake:
        assert sleepy.post("/wake_up", params={} if tags is None else {"tags": tags}).status_code == 200
    assert sleepy.get("/is_sleeping").json() == {"is_sleeping": False}
    assert complete(sleepy) == before


def test_bad_sleep_requests_are_400s(sleepy):
    r = sleepy.post("/sleep", params={"level": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert sleepy.post("/sleep", params={"level": 1}).status_code == 200
    r = sleepy.post("/wake_up", params={"tags": ["everything"]})
    assert r.status_code == 400 and "unknown wake-up tags" in r.json()["error"]["message"]
    assert sleepy.post("/wake_up").status_code == 200 and complete(sleepy)


def test_routes_need_the_flag(http):
    r = http.post("/sleep", params={"level": 1})
    assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_reset_prefix_cache_makes_the_next_pass_compute_its_prompt(sleepy):
    """vLLM's POST /reset_prefix_cache: a prompt cached by the previous request is computed again."""
    body = {**BODY, "prompt": "Tell me about the rivers of Europe, from the Rhine to the Danube and on. " * 3}

    def cached() -> int:
        usage = sleepy.post("/v1/completions", json=body).json()["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    cached()
    assert cached() > 0
    assert sleepy.post("/reset_prefix_cache").status_code == 200
    assert cached() == 0
