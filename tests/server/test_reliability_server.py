"""The whole server under hostile grammar, tool and template requests (issue 27's goal): while they run,
/health keeps answering fast and plain and small constrained requests succeed; every hostile request
ends with a 4xx in OpenAI's shape within 15 s. The one timing bound here is /health's, kept generous
(a 2-core machine shared with other work): the event loop never runs request-dependent work for long."""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from support.openai_errors import openai_error
from support.server import API_KEY

LOOPING_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
ASK = [{"role": "user", "content": "Hi"}]


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for level in range(levels):
        schema = {"type": "object", "properties": {f"k{level}": schema}, "required": [f"k{level}"]}
    return schema


def hostile(a: int) -> list[tuple[str, dict]]:
    loop_tool = {"type": "function", "function": {"name": "loop", "parameters": LOOPING_REF}}
    return [
        ("/v1/completions", {"prompt": "Hi", "guided_regex": r"[^\s\S]"}),
        ("/v1/completions", {"prompt": "Hi", "guided_json": LOOPING_REF}),
        ("/v1/completions", {"prompt": "Hi", "guided_json": deep_schema(300)}),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(a): 100}, "temperature": 0,
                             "guided_grammar": 'root ::= "b" | "a" x\nx ::= x'}),
        ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"tools": 1}}),
        ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"eos_token": "x"}}),
        ("/v1/chat/completions", {"messages": ASK, "tools": [loop_tool], "tool_choice": "required"}),
    ]


def test_health_stays_fast_and_hostile_requests_end_in_4xx(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        (a,) = http.post("/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"]
        # The first constrained request builds the grammar backend (seconds): not what is measured here.
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                                   "guided_choice": ["x"]}).status_code == 200

        def send(route: str, body: dict) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            response = http.post(route, json={"max_tokens": 4, **body})
            return response, time.monotonic() - started

        benign = [("/v1/completions", {"prompt": "Hi"}),
                  ("/v1/completions", {"prompt": "Hi", "guided_choice": ["yes", "no"]})]
        with ThreadPoolExecutor(8) as pool:
            hostile_futures = [pool.submit(send, route, body) for route, body in hostile(a)]
            benign_futures = [pool.submit(send, route, body) for route, body in benign]
            health = []
            while not all(f.done() for f in hostile_futures + benign_futures):
                started = time.monotonic()
                assert http.get("/health").status_code == 200
                health.append(time.monotonic() - started)
                time.sleep(0.05)
        assert [f.result()[0].status_code for f in benign_futures] == [200, 200]
        # 15 s, or on a machine so loaded that a plain 4-token request takes longer, twice that.
        bound = max(15.0, 2 * max(f.result()[1] for f in benign_futures))
        for future in hostile_futures:
            response, elapsed = future.result()
            assert 400 <= response.status_code < 500, response.text
            openai_error(response)
            assert elapsed < bound, (elapsed, bound, response.text)
    assert health and statistics.median(health) < 0.1 and max(health) < 1.0, health
