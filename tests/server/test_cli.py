"""The console script as a user runs it: `corectl generate --chat` answers from the default model and
`corectl plugins` lists the built-in plugins with their package and availability."""
from __future__ import annotations

import json

import pytest
from support.server_a_cli import cli_runs


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The module's command lines, run in one interpreter (one import of torch and corectl, not four)."""
    grammar_result = tmp_path_factory.mktemp("bench-grammar") / "grammar.json"
    runs = {
        "chat": ["generate", "--chat", "What is the capital of France?", "--temperature", "0", "--max-tokens", "16",
                 "--max-model-len", "512", "--kv-cache-memory", "0.05"],
        "bad-input": ["generate", "--temperature", "-1", "Hello"],
        "plugins": ["plugins"],
        "bench-grammar": ["bench", "grammar", "--batch-sizes", "1,9", "--fill-threads", "1,2", "--repeats", "1",
                          "--save-result", str(grammar_result)],
    }
    return {**dict(zip(runs, cli_runs(*runs.values()))), "grammar_result": grammar_result}


def test_generate_chat_answers_from_the_default_model(cli):
    done = cli["chat"]
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_generate_reports_bad_input_in_one_line(cli):
    done = cli["bad-input"]
    assert done.returncode != 0
    assert "temperature" in done.stderr and "Traceback" not in done.stderr


def test_plugins_lists_builtins_with_package_and_availability(cli):
    done = cli["plugins"]
    assert done.returncode == 0, done.stderr
    rows = {tuple(line.split()[:2]): line.split() for line in done.stdout.splitlines()[1:]}
    assert rows[("platform", "cpu")][3:] == ["corectl", "0", "yes"]
    assert rows[("platform", "cuda")][-1] in ("yes", "no")
    assert ("model", "Qwen3ForCausalLM") in rows and ("attention", "triton") in rows
    assert {("tool_parser", "hermes"), ("tool_parser", "llama3_json"), ("tool_parser", "mistral"),
            ("reasoning", "qwen3"), ("reasoning", "deepseek_r1"), ("structured", "xgrammar")} <= set(rows)


def test_serve_checks_the_tool_and_reasoning_flags():
    from corectl.errors import ConfigError
    from corectl.server.cli.main import build_parser
    from corectl.server.cli.serve import settings_from_args
    from corectl.server.http.state import ServerState

    parser = build_parser()
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        settings_from_args(parser.parse_args(["serve", "--enable-auto-tool-choice"]))
    for flag, message in [("--tool-call-parser", "unknown tool parser 'nope'"),
                          ("--reasoning-parser", "unknown reasoning parser 'nope'")]:
        with pytest.raises(ConfigError, match=message):
            ServerState(settings_from_args(parser.parse_args(["serve", flag, "nope"])))


def test_serve_takes_the_online_token_budget_and_offline_keeps_its_own():
    from corectl.config import EngineConfig
    from corectl.server.cli.main import build_parser
    from corectl.server.cli.serve import settings_from_args

    parser = build_parser()
    served = settings_from_args(parser.parse_args(["serve"]))
    assert served.engine.max_num_batched_tokens == 1024
    explicit = settings_from_args(parser.parse_args(["serve", "--max-num-batched-tokens", "8192"]))
    assert explicit.engine.max_num_batched_tokens == 8192
    generate = parser.parse_args(["generate", "hi"])
    assert generate.max_num_batched_tokens == EngineConfig().max_num_batched_tokens == 2048


def test_serve_sockets_accept_connections_without_nagle():
    """asyncio (uvicorn's loop) accepts on the sockets `serve` binds with Nagle off, as on a socket it binds
    itself: a keep-alive response written in two parts must not wait for the client's delayed ACK."""
    import asyncio
    import socket

    from corectl.server.cli.main import build_parser
    from corectl.server.cli.serve import _bind, _bind_port, settings_from_args

    def settings():
        return settings_from_args(build_parser().parse_args(["serve", "--port", "0"]))

    # One API process's socket, and one as each of --api-server-count's (the port shared, SO_REUSEPORT).
    socks = [_bind_port(settings()), _bind(settings(), reuse_port=True)]

    async def nodelay_of_accepted(sock: socket.socket) -> int:
        accepted = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    assert all(asyncio.run(nodelay_of_accepted(sock)) for sock in socks)



def test_api_server_freezes_its_startup_heap():
    """Once uvicorn has started (lifespan done, sockets bound) the API process's objects so far are
    frozen out of the garbage collector's passes, which then walk only what requests make."""
    import asyncio
    import gc
    import socket

    import uvicorn
    from corectl.server.cli.api_process import _Server

    async def app(scope, receive, send):
        return None

    async def frozen_once_started(server: _Server, sock: socket.socket) -> int:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        frozen = gc.get_freeze_count()
        server.should_exit = True
        await serving
        return frozen

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        try:
            server = _Server(uvicorn.Config(app, lifespan="off", log_config=None), state=None)
            assert asyncio.run(frozen_once_started(server, sock)) > 0
        finally:
            gc.unfreeze()  # this test process is no API process: give the collector its objects back

def test_bench_grammar_times_each_part_of_a_constrained_step(cli):
    done = cli["bench-grammar"]
    assert done.returncode == 0, done.stderr
    result = json.loads(cli["grammar_result"].read_text())
    assert set(result["per_step_ms"]) == {"1/1", "9/1", "1/2", "9/2"} and result["answer_tokens"] > 10
    for times in result["per_step_ms"].values():
        assert set(times) == {"fill", "apply", "accept", "total"} and all(t > 0 for t in times.values())


def test_serve_takes_more_of_vllm_launch_flags():
    """Flags vLLM scripts pass: the ones with a meaning here reach the settings, the others are taken."""
    from corectl.server.cli.main import build_parser
    from corectl.server.cli.serve import settings_from_args

    parser = build_parser()
    settings = settings_from_args(parser.parse_args([
        "serve", "--swap-space", "4", "--disable-log-stats", "--max-seq-len-to-capture", "8192",
        "--enable-log-requests", "--uvicorn-log-level", "error", "--disable-custom-all-reduce",
        "--max-cudagraph-capture-size", "64", "--return-tokens-as-token-ids"]))
    assert settings.uvicorn_log_level == "error" and settings.log_requests and settings.return_tokens_as_token_ids
    assert settings.engine.disable_custom_all_reduce
    assert settings.engine.compilation_config.max_cudagraph_capture_size == 64
    plain = settings_from_args(parser.parse_args(["serve"]))
    assert plain.uvicorn_log_level is None and not plain.engine.disable_custom_all_reduce
    assert not plain.return_tokens_as_token_ids


def test_serve_takes_vllm_scheduling_sampling_and_loading_flags(monkeypatch):
    from corectl.server.cli.main import build_parser
    from corectl.server.cli.serve import settings_from_args

    monkeypatch.delenv("HF_TOKEN", raising=False)
    settings = settings_from_args(build_parser().parse_args([
        "serve", "--max-model-len", "2k", "--max-num-batched-tokens", "8K", "--long-prefill-token-threshold", "1k",
        "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2", "--kv-cache-memory-bytes", "2G",
        "--logprobs-mode", "processed_logits", "--chat-template-content-format", "openai", "--model-impl", "vllm",
        "--hf-token", "hf_abc", "--rope-theta", "500000", "--rope-scaling", '{"rope_type": "dynamic", "factor": 2.0}',
        "--hf-overrides", '{"rope_theta": 250000}', "--pooler-config", '{"pooling_type": "mean", "normalize": false}',
        "--exclude-tools-when-tool-choice-none", "--trust-request-chat-template"]))
    engine = settings.engine
    assert (engine.max_model_len, engine.max_num_batched_tokens, engine.long_prefill_token_threshold) == (2000, 8192, 1000)
    assert (engine.max_num_partial_prefills, engine.max_long_partial_prefills) == (4, 2)
    assert engine.kv_cache_budget_bytes == 2 * 2**30 and engine.logprobs_mode == "processed_logits"
    assert settings.chat_template_content_format == "openai"
    assert engine.hf_overrides == {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_theta": 250000}
    assert (engine.pooling_type, engine.normalize) == ("MEAN", False)
    import os

    assert os.environ["HF_TOKEN"] == "hf_abc"


def test_vllm_spellings_of_engine_options():
    """The structured-outputs backend by either of vLLM's spellings ('auto' is the built-in one), the
    frontend in the engine's process, and the tokenizer modes corectl has."""
    from corectl.server.cli.main import build_parser
    from corectl.server.cli.serve import settings_from_args

    parser = build_parser()

    def engine(*flags):
        return settings_from_args(parser.parse_args(["serve", *flags]))

    assert engine("--guided-decoding-backend", "auto").engine.structured_outputs_backend == "xgrammar"
    assert engine("--structured-outputs-config", '{"backend": "my-plugin", "disable_any_whitespace": true}'
                  ).engine.structured_outputs_backend == "my-plugin"
    assert engine("--structured-outputs-backend", "auto").engine.structured_outputs_backend == "xgrammar"
    assert engine("--disable-frontend-multiprocessing").engine_in_process
    assert engine("--tokenizer-mode", "hf", "--cpu-offload-gb", "0").engine.tokenizer is None
    assert engine("--kv-offloading-size", "2", "--kv-offloading-backend", "native").engine.kv_offload_bytes == 2 << 30


@pytest.mark.parametrize(("flags", "message"), [
    (["--enable-log-requests", "--disable-log-requests"], "contradict"),
    (["--swap-space", "-1"], "swap_space: must not be negative"),
    (["--max-cudagraph-capture-size", "0"], "max_cudagraph_capture_size must hold positive integers"),
    (["--tokenizer-mode", "mistral"], "tokenizer_mode: corectl loads Hugging Face tokenizers"),
    (["--cpu-offload-gb", "4"], "cpu_offload_gb: weights are not offloaded"),
    (["--kv-offloading-backend", "lmcache"], "kv_offloading_backend: the host tier is corectl's own"),
    (["--guided-decoding-backend", "xgrammar", "--structured-outputs-config", '{"backend": "guidance"}'],
     "two structured-outputs backends"),
    (["--structured-outputs-config", "[1]"], "structured_outputs_config: must be a JSON object"),
    (["--disable-frontend-multiprocessing", "--api-server-count", "2"], "API processes share an engine process"),
    (["--model-impl", "transformers"], "model_impl: corectl runs its own implementation"),
    (["--kv-cache-memory-bytes", "1G", "--kv-cache-memory", "1"], "kv_cache_memory_bytes: give the KV cache's size once"),
    (["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "3"], "max_long_partial_prefills: 3 is more"),
    (["--hf-token", " "], "hf_token: must not be empty"),
    (["--enable-expert-parallel"], "enable_expert_parallel: expert parallelism is not built"),
    (["--calculate-kv-scales"], "calculate_kv_scales: FP8 KV caches use scales of 1.0"),
    (["--preemption-mode", "swap"], "preemption_mode: only 'recompute' here, got 'swap'"),
    (["--num-scheduler-steps", "8"], "num_scheduler_steps: only 1 here, got 8"),
    (["--allowed-methods", '"GET"'], "allowed_methods: must be a JSON list of strings"),
    (["--ssl-cert-reqs", "2"], "ssl_cert_reqs: verifying client certificates needs the CAs"),
    (["--ssl-ca-certs", "/etc/hostname"], "ssl_ca_certs: client certificates need HTTPS"),
    (["--allow-credentials", "--allowed-origins", '["*"]'], "allow_credentials: credentialed CORS requests"),
    (["--allowed-origins", "[1]"], "allowed_origins: must be a JSON list of origins"),
    (["--pooler-config", '{"pooling_type": "CLS"}', "--pooling-type", "MEAN"], "pooler_config: sets pooling_type"),
    (["--pooler-config", '{"softmax": true}'], "pooler_config: takes pooling_type and normalize"),
    (["--rope-scaling", "2"], "rope_scaling: must be a JSON object"),
])
def test_bad_or_unbuilt_vllm_flags_are_one_line_each(flags, message, capsys):
    from corectl.server.cli.main import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_serve_takes_vllm_generation_config_overrides(capsys):
    from corectl.server.cli.main import build_parser, main
    from corectl.server.cli.serve import settings_from_args

    args = build_parser().parse_args(["serve", "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 9}'])
    assert settings_from_args(args).generation_overrides == {"temperature": 0.5, "max_tokens": 9}
    assert main(["serve", "--override-generation-config", '{"temp": 1}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "override_generation_config: 'temp' is not a sampling default" in err[0]
