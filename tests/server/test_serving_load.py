"""Concurrency, disconnects, metrics, the documented examples and `corectl bench serve`."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import subprocess
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from support.server import API_KEY

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def _metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample as 'name{label=value,...}' -> value (model_name and the one engine left out)."""
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine"))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _wait_idle(http: httpx.Client) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = _metrics(http)
        if metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0:
            return metrics
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {metrics}")


def test_the_shared_server_runs_the_async_scheduling_loop(server):
    assert "async scheduling" in server.log()


def test_metrics_move_with_a_request(http):
    before = _wait_idle(http)
    out = http.post("/v1/completions", json={"prompt": "Metrics are", "max_tokens": 5, "ignore_eos": True}).json()
    after = _metrics(http)
    usage = out["usage"]
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    key = "vllm:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                      "request_params_n", "request_params_max_tokens"):
        name = f"vllm:{histogram}_count"
        assert after[name] - before[name] == 1
    assert after["vllm:request_params_max_tokens_sum"] - before["vllm:request_params_max_tokens_sum"] == 5
    # A request the engine refuses never ran: it is in no request histogram.
    refused = http.post("/v1/completions", json={"prompt": "hi " * 600, "max_tokens": 4})
    assert refused.status_code == 400
    assert _metrics(http)["vllm:request_params_n_count"] == after["vllm:request_params_n_count"]
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 4
    assert after["vllm:request_generation_tokens_sum"] - before["vllm:request_generation_tokens_sum"] == 5
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


def test_disconnect_mid_stream_aborts_and_frees_blocks(http):
    _wait_idle(http)
    before = _metrics(http)
    body = {"prompt": "Count from one to a thousand:", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        # The iterator stays referenced: dropping it part-way closes the connection (httpcore closes
        # a stream whose iteration stops), which is the hang-up this test makes only below.
        lines = response.iter_lines()
        frames = 0
        for line in lines:
            frames += line.startswith("data: ")
            if frames == 3:
                break
        # The gauge is the engine's stats of its latest step the API process has read, which may
        # trail the frames by a step.
        deadline = time.monotonic() + 10
        while _metrics(http)["vllm:num_requests_running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert frames == 3 and _metrics(http)["vllm:num_requests_running"] == 1
        del lines
    after = _wait_idle(http)
    key = "vllm:request_success_total{finished_reason=abort}"
    assert after[key] - before.get(key, 0) == 1
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 3 <= generated < 480
    assert http.get("/load").json()["server_load"] == 0


def test_disconnect_before_the_first_token_aborts(http, server):
    """A non-streamed request whose client gives up is aborted too."""
    _wait_idle(http)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as impatient:
        try:
            impatient.post("/v1/completions", json={"prompt": "Write a long story:", "max_tokens": 400,
                                                    "ignore_eos": True}, timeout=0.5)
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("400 tokens on 2 CPU cores should take longer than the client waits")
    metrics = _wait_idle(http)
    assert metrics["vllm:num_requests_waiting"] == 0


def test_32_concurrent_streams_match_their_whole_responses(server):
    from openai import AsyncOpenAI

    prompts = [f"Fact number {i} about the ocean:" for i in range(32)]

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

        async def streamed(prompt):
            stream = await client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=6,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def whole(prompt):
            out = await client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text

        streams = await asyncio.gather(*(streamed(p) for p in prompts))
        wholes = await asyncio.gather(*(whole(p) for p in prompts))
        await client.close()
        return streams, wholes

    streams, wholes = asyncio.run(run())
    assert streams == wholes and all(streams)


def _doc_block(language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.S)
    return next(b for b in blocks if containing in b)


def test_documented_curl_example(server):
    command = _doc_block("bash", "curl http://localhost:8000/v1/chat/completions")
    command = command.replace("localhost:8000", f"127.0.0.1:{server.port}")
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True, timeout=60)
    answer = json.loads(out.stdout)
    assert "Paris" in answer["choices"][0]["message"]["content"]


def test_documented_openai_example(server):
    code = _doc_block("python", "from openai import OpenAI").replace("localhost:8000", f"127.0.0.1:{server.port}")
    printed = io.StringIO()  # run here, as test_readme runs the README's: no interpreter to start
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/serving.md", "exec"), {})
    answer, _, story = printed.getvalue().partition("\n")
    assert "Paris" in answer and story.strip()


def test_bench_serve_reports_against_our_server(server, tmp_path, capsys):
    from corectl.server.cli.main import main

    result = tmp_path / "bench.json"
    # `main` is what the `corectl` script runs; here it saves an interpreter's start and imports.
    code = main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--input-len", "24",
                 "--output-len", "6", "--num-prompts", "6", "--max-concurrency", "3", "--ignore-eos",
                 "--endpoint", "/v1/chat/completions", "--num-clients", "2", "--save-result", str(result)])
    out = capsys.readouterr()
    assert code == 0, out.err
    for label in ("Successful requests:", "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):",
                  "Output token throughput (tok/s):", "client CPU, share of one core:"):
        assert label in out.out
    saved = json.loads(result.read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0 and saved["errors"] == {}
    assert saved["num_clients"] == 2 and len(saved["client_cpu_share"]) == 2
    assert saved["output_lens"] == [6] * 6 and saved["total_output_tokens"] == 36
    assert saved["input_lens"] == [24] * 6
    assert saved["ttft_ms"]["mean"] > 0 and saved["e2el_ms"]["p99"] >= saved["e2el_ms"]["median"]
    assert all(1 <= len(itl) <= 5 for itl in saved["itls"])  # tokens a slow reader missed arrive merged
