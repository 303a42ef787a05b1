"""A vLLM user's launch command and requests against a real server, with the official `openai` client.

The server starts from a YAML `--config` plus vLLM's flags (the API key from VLLM_API_KEY), so the
launch path is the one a vLLM script takes.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
import openai
import pytest
from support.server import SMALL_ENGINE, ServerProcess

KEY = "env-key-123"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 3


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dropin")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    config = folder / "serve.yaml"
    # Flags vLLM scripts carry that mean nothing here (swap space, graph lengths, stats logging, a
    # compilation level) beside ones honoured (uvicorn's level, no custom all-reduce).
    config.write_text("served-model-name: smol\nmax-num-seqs: 8\ntrust-remote-code: true\n"
                      "enable-chunked-prefill: true\nswap-space: 4\nmax-seq-len-to-capture: 8192\n"
                      "disable-log-stats: true\nuvicorn-log-level: warning\ndisable-custom-all-reduce: true\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_API_KEY", KEY)
        mp.delenv("CORECTL_API_KEY", raising=False)
        proc = ServerProcess(*SMALL_ENGINE, "--config", str(config), "--generation-config", str(folder),
                             "--max-logprobs", "5", "--disable-log-requests", "--seed", "0", "-O3",
                             "--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}',
                             "--enable-force-include-usage", "--enable-prompt-tokens-details",
                             "--response-role", "narrator", "--logprobs-mode", "processed_logprobs",
                             "--chat-template-content-format", "string", "--long-prefill-token-threshold", "32",
                             "--max-num-partial-prefills", "2", "--model-impl", "auto",
                             "--override-generation-config", '{"max_new_tokens": 4}').wait_ready(600)
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(vllm_server):
    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key=KEY, max_retries=0)


def test_usage_and_role_flags(vllm_server):
    """--enable-force-include-usage: a stream that did not ask ends with usage; --enable-prompt-tokens-details:
    usage names the cached prompt tokens even when none were; --response-role names the messages' role."""
    headers = {"Authorization": f"Bearer {KEY}"}
    # A salt of its own: nothing of the prompt is in the prefix cache.
    body = {"model": "smol", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
            "cache_salt": "usage-and-role"}
    answer = httpx.post(vllm_server.url + "/v1/chat/completions", headers=headers, json=body).json()
    assert answer["choices"][0]["message"]["role"] == "narrator"
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    with httpx.stream("POST", vllm_server.url + "/v1/chat/completions", headers=headers,
                      json={**body, "stream": True}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "narrator"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    completion = httpx.post(vllm_server.url + "/v1/completions", headers=headers,
                            json={"model": "smol", "prompt": "hello", "max_tokens": 2, "stream": True})
    last = [json.loads(line[6:]) for line in completion.text.splitlines() if line.startswith("data: {")][-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


def test_logprobs_name_tokens_by_id_when_asked(client):
    """return_tokens_as_token_ids: completions and chat logprobs name each token "token_id:<id>", the
    ids of the tokens generated; text offsets still count the text."""
    asked = client.completions.create(model="smol", prompt="The sky is", max_tokens=3, logprobs=2, temperature=0,
                                      extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True,
                                                  "ignore_eos": True})
    choice = asked.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    plain = client.completions.create(model="smol", prompt="The sky is", max_tokens=3, logprobs=2, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert "".join(plain.logprobs.tokens) == plain.text == choice.text
    assert plain.logprobs.text_offset == choice.logprobs.text_offset
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and entry.bytes == list(entry.token.encode())
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)


def test_chat_returns_token_ids_when_asked(client, vllm_server):
    """return_token_ids on chat (vLLM's): the prompt's ids on the response (streamed: the first chunk's)
    and each choice's generated ids (streamed: each chunk's delta), which decode to its text."""
    body = dict(model="smol", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4, temperature=0,
                n=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.chat.completions.create(**body)
    prompt_ids = whole.model_extra["prompt_token_ids"]
    def post(route: str, **fields) -> dict:
        return httpx.post(vllm_server.url + route, headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "smol", **fields}).json()

    assert prompt_ids == post("/tokenize", messages=body["messages"])["tokens"]
    for choice in whole.choices:
        ids = choice.model_extra["token_ids"]
        assert len(ids) == 4 and choice.message.content == post("/detokenize", tokens=ids)["prompt"]
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in chunk.model_extra for chunk in chunks[1:])
    for index in (0, 1):
        streamed = [t for chunk in chunks for c in chunk.choices if c.index == index
                    for t in c.model_extra.get("token_ids", [])]
        assert streamed == whole.choices[index].model_extra["token_ids"]
    plain = client.chat.completions.create(**{**body, "extra_body": {"ignore_eos": True}})
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra


def test_processed_logprobs_give_masked_tokens_vllms_floor(client):
    """--logprobs-mode processed_logprobs: the distribution drawn from (top_k 2) sums to one over its two
    tokens; a token it masks is -inf there, which JSON cannot carry: -9999.0, as vLLM sends."""
    # A prompt of its own (LONG_PROMPT's blocks must stay out of the prefix cache), over the 32-token threshold.
    prompt = "Rivers run down from the mountains to the sea, and the sea rises into clouds again. " * 3
    choice = client.completions.create(model="smol", prompt=prompt, max_tokens=3, logprobs=3, temperature=0.7,
                                       seed=3, extra_body={"top_k": 2, "ignore_eos": True}).choices[0]
    for top in choice.logprobs.top_logprobs:
        ranked = sorted(top.values(), reverse=True)
        assert sum(math.exp(v) for v in ranked[:2]) == pytest.approx(1.0, abs=1e-3)
        assert ranked[2:] == [-9999.0] * (len(ranked) - 2) and len(ranked) == 3


def test_uvicorn_logs_at_the_level_asked(vllm_server):
    # uvicorn's own INFO lines (its startup) are gone at --uvicorn-log-level warning; corectl's stay.
    log = vllm_server.log()
    assert "Application startup complete" not in log and '"logger": "uvicorn.error"' not in log
    assert '"logger": "corectl' in log


def test_api_key_comes_from_vllm_api_key(vllm_server, client):
    assert httpx.get(vllm_server.url + "/v1/models").status_code == 401
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_x_request_id_is_echoed_and_names_the_response(vllm_server, client):
    raw = client.chat.completions.with_raw_response.create(
        model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Request-Id": "trace-7"})
    assert raw.headers["x-request-id"] == "trace-7" and raw.parse().id == "chatcmpl-trace-7"
    generated = client.completions.with_raw_response.create(model="smol", prompt="hi", max_tokens=1)
    assert generated.parse().id == "cmpl-" + generated.headers["x-request-id"]
    refused = httpx.post(vllm_server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                                        "X-Request-Id": "bad-1"},
                         json={"model": "smol", "prompt": "hi", "vllm_xargs": {"a": 1}})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    assert refused.json()["error"]["param"] == "vllm_xargs"


def test_generation_config_sets_unset_max_tokens(client):
    # The folder's max_new_tokens (3) under --override-generation-config's (4).
    reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Tell a story"}],
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4
    assert client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Tell a story"}],
                                          max_tokens=5, extra_body={"ignore_eos": True}).usage.completion_tokens == 5


def test_max_logprobs_bounds_requests(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="smol", prompt="hi", max_tokens=1, logprobs=6)
    assert exc.value.body["param"] == "logprobs"


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    chunks = list(client.completions.create(model="smol", prompt="Once upon a time", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices]
    assert with_text and all(c.usage is not None for c in with_text)
    assert [c.usage.completion_tokens for c in with_text] == sorted(c.usage.completion_tokens for c in with_text)
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_echo_and_continue_final_message(client):
    messages = [{"role": "user", "content": "Write a story"}, {"role": "assistant", "content": "Once upon a"}]
    reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=3,
                                           extra_body={"echo": True, "continue_final_message": True,
                                                       "add_generation_prompt": False})
    assert reply.choices[0].message.content.startswith("Once upon a")
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=3, stream=True,
                                            extra_body={"echo": True, "continue_final_message": True,
                                                        "add_generation_prompt": False})
    assert next(iter(stream)).choices[0].delta.content == "Once upon a"


def test_bad_words_allowed_tokens_and_truncation(client):
    prompt = "The capital of France is"
    free = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0).choices[0].text
    word = free.split()[0]
    banned = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0,
                                       extra_body={"bad_words": [word]}).choices[0].text
    assert word not in banned.split()
    allowed = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0,
                                        extra_body={"allowed_token_ids": [11, 12], "return_token_ids": True})
    assert set(allowed.choices[0].model_extra["token_ids"]) <= {11, 12}
    truncated = client.completions.create(model="smol", prompt=LONG_PROMPT, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert truncated.usage.prompt_tokens == 5


def test_cache_salt_isolates_prefix_cache_hits(client):
    def cached(salt: str | None) -> int:
        usage = client.completions.create(model="smol", prompt=LONG_PROMPT + "?", max_tokens=1,
                                          extra_body={} if salt is None else {"cache_salt": salt}).usage
        details = usage.prompt_tokens_details
        return 0 if details is None else details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0


def test_metrics_have_vllm_names(vllm_server):
    text = httpx.get(vllm_server.url + "/metrics").text
    for name in ("vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:kv_cache_usage_perc{",
                 "vllm:time_to_first_token_seconds_bucket{", "vllm:request_prefill_time_seconds_count{",
                 "vllm:request_params_n_bucket{", "vllm:cache_config_info{", "vllm:prompt_tokens_total{",
                 'vllm:request_success_total{finished_reason="length",model_name="smol"}'):
        assert name in text, name
    assert "corectl:" not in text


def test_unknown_flag_shows_serve_usage_and_exits_2(capsys):
    from corectl.server.cli.main import main

    with pytest.raises(SystemExit) as exited:  # argparse's exit, as the `corectl` script ends with it
        main(["serve", "--no-such-flag"])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    assert "usage: corectl serve" in stderr and "--no-such-flag" in stderr


def test_use_beam_search_returns_n_beams_best_first(client):
    out = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, n=2,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 6
    greedy = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, n=1,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    plain = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert greedy.choices[0].text == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="smol", prompt="hi", max_tokens=3, stream=True,
                                  extra_body={"use_beam_search": True})
    assert exc.value.body["param"] == "stream"


def test_a_model_that_needs_remote_code_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_remote_arch", "architectures": ["MyLM"],
                                                      "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    # The engine in the server's process saves starting a second one; an engine process's start-up
    # error reaching stderr as the same one line is test_reliability_cli's serve case.
    out = subprocess.run([sys.executable, "-m", "corectl.server.cli", "serve", str(tmp_path), "--trust-remote-code", "--load-format", "dummy",
                          "--port", "0", "--engine-in-process"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr
    assert "ships its own model code" in out.stderr and "Traceback" not in out.stderr
