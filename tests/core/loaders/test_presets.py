"""Shape presets and tokenizer-free engines: benchmarks on random weights with no hub and no tokenizer."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from corectl import LLM, EngineConfig, SamplingParams
from corectl.engine.client import EngineClient
from corectl.errors import ConfigError, InvalidRequestError
from corectl.loaders import resolve_model_source
from corectl.loaders.presets import PRESETS
from corectl.server.cli.main import main
from support.engines import TINY
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig



def _peer_extra_shapes() -> dict:
    path = Path(__file__).parents[3] / "benchmarks" / "hf_peer_shapes.py"
    spec = importlib.util.spec_from_file_location("hf_peer_shapes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.extra_shapes()


# The peer benchmark's model configs (hf_baseline.py SHAPES), which the presets must equal.
PEER_SHAPES = {
    "llama3-8b": lambda: LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                     rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-70b": lambda: LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                      num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                      rope_theta=500000.0, max_position_embeddings=8192),
    "qwen3-0.6b": lambda: Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      vocab_size=151936, tie_word_embeddings=True,
                                      max_position_embeddings=8192),
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                            head_dim=128, num_experts=128, num_experts_per_tok=8,
                                            norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0,
                                            max_position_embeddings=40960),
    "mixtral-8x7b": lambda: MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                          num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                          num_experts_per_tok=2, vocab_size=32000, rope_theta=1000000.0,
                                          rms_norm_eps=1e-5, max_position_embeddings=32768),
}
# The shapes benchmarks/hf_peer_shapes.py adds to the peer (gpt-oss, DeepSeek), for the presets that exist.
PEER_SHAPES.update({name: shape for name, shape in _peer_extra_shapes().items() if name in PRESETS})
# What the peer's constructor calls leave unset: it passes dtype to from_config and needs no architecture;
# its gpt-oss experts are bf16 (transformers' MXFP4 kernels come from the hub), ours the preset's MXFP4.
NOT_COMPARED = {"architectures", "dtype", "transformers_version", "_name_or_path", "quantization_config"}


pytestmark = pytest.mark.usefixtures("isolated_env")


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(**TINY)


@pytest.mark.parametrize("name", sorted(PEER_SHAPES))
def test_presets_equal_the_peer_shapes_field_by_field(name):
    source = resolve_model_source(EngineConfig(model=name, load_format="dummy"))
    ours, peer = source.hf_config.to_dict(), PEER_SHAPES[name]().to_dict()
    assert {k: v for k, v in ours.items() if k not in NOT_COMPARED} == \
        {k: v for k, v in peer.items() if k not in NOT_COMPARED}
    assert ours["architectures"] == PRESETS[name]["architectures"]
    assert source.model_dtype == "bfloat16" and source.tokenizer_dir is None and source.weight_files == ()


@pytest.mark.parametrize(("name", "config_class"), [("qwen3-8b", "Qwen3Config"), ("qwen3-14b", "Qwen3Config"),
                                                   ("gemma-2-9b", "Gemma2Config"), ("llama-3.2-3b", "LlamaConfig"),
                                                   ("qwen2.5-7b", "Qwen2Config"),
                                                   ("mistral-nemo-12b", "MistralConfig")])
def test_dense_presets_load_in_their_config_classes_with_every_field(name, config_class):
    """The presets of issue 26's untuned dense shapes load as their transformers config classes, each
    field as written (Gemma 2's soft caps and alternating windows, Llama 3.2's llama3 rope scaling), and
    resolve to a model class."""
    from corectl.models.registry import resolve_model_class

    config = resolve_model_source(EngineConfig(model=name, load_format="dummy")).hf_config
    assert type(config).__name__ == config_class
    resolve_model_class(config)
    for field, value in PRESETS[name].items():
        if field == "rope_parameters":
            assert {k: config.rope_parameters[k] for k in value} == value
        elif field == "rope_theta":
            assert config.rope_parameters["rope_theta"] == value
        elif field != "dtype":
            assert getattr(config, field) == value, field
    if name == "gemma-2-9b":
        assert config.layer_types[:2] == ["sliding_attention", "full_attention"] and config.tie_word_embeddings


def test_a_mixture_of_experts_preset_generates_from_dummy_weights():
    llm = LLM(**{**TINY, "model": "qwen3-moe-tiny"})
    assert llm.engine.info.architecture == "Qwen3MoeForCausalLM"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bench_throughput_runs_on_a_preset_without_tokenizer_or_hub(tmp_path, capsys):
    result_file = tmp_path / "result.json"
    code = main(["bench", "throughput", "--model", "llama-tiny", "--load-format", "dummy", "--platform", "cpu",
                 "--kv-cache-memory", "0.01", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                 "--save-result", str(result_file)])
    assert code == 0
    assert "requests/s" in capsys.readouterr().out
    result = json.loads(result_file.read_text())
    assert (result["num_prompts"], result["input_tokens"], result["output_tokens"]) == (4, 64, 16)
    assert result["output_tokens_per_s"] > 0 and result["requests_per_s"] > 0
    assert result["config"]["model"] == "llama-tiny" and result["config"]["skip_tokenizer_init"] is True
    assert result["engine"]["device"] and result["engine"]["tokenizer"] is False
    assert result["versions"]["torch"] and "triton" in result["versions"]


@pytest.mark.parametrize("scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_bench_latency_reports_step_and_end_to_end_percentiles(scheduling, tmp_path, capsys):
    result_file = tmp_path / "result.json"
    code = main(["bench", "latency", "--model", "llama-tiny", "--load-format", "dummy", "--platform", "cpu",
                 "--kv-cache-memory", "0.01", "--input-len", "8", "--output-len", "3", "--num-iters", "2",
                 scheduling, "--save-result", str(result_file)])
    assert code == 0
    assert "Avg latency" in capsys.readouterr().out
    result = json.loads(result_file.read_text())
    assert len(result["latencies_s"]) == 2
    # Each batch: the prefill yields token 1, then two decode steps; async scheduling's extra
    # launch that yields nothing is not a step.
    assert result["num_decode_steps"] == 2 * 2
    assert 0 < result["decode_step_s"]["p50"] <= result["e2e_s"]["p50"]
    assert 0 < result["prefill_step_s"]["p50"] <= result["e2e_s"]["p50"]


def test_presets_load_where_the_gguf_package_is_missing(tmp_path):
    # GPU images may lack gguf: only GGUF checkpoints may need it.
    script = ("import sys; sys.modules['gguf'] = None\n"
              "from corectl.server.cli import main\nfrom corectl.server.bench import offline\n"
              "from corectl.loaders import resolve_model_source\nfrom corectl import EngineConfig\n"
              "print(resolve_model_source(EngineConfig(model='llama3-8b', load_format='dummy')).description)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CORECTL_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "preset llama3-8b" in done.stdout


def test_a_preset_needs_dummy_weights(capsys):
    with pytest.raises(ConfigError, match="shape preset") as err:
        resolve_model_source(EngineConfig(model="llama3-8b"))
    assert err.value.field == "load_format"
    assert main(["bench", "throughput", "--model", "qwen3-0.6b", "--num-prompts", "1"]) == 2
    assert "--load-format dummy" in capsys.readouterr().err


def test_tokenizer_free_llm_takes_ids_and_returns_ids(tiny_llm):
    assert tiny_llm.tokenizer is None and tiny_llm.config.skip_tokenizer_init
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(InvalidRequestError, match="token ids") as err:
        tiny_llm.generate("Hello", use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        tiny_llm.generate([[5]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert err.value.param == "stop"
    with pytest.raises(InvalidRequestError):
        tiny_llm.get_tokenizer()


def test_eos_comes_from_the_model_config(tiny_llm):
    eos = LlamaConfig().eos_token_id
    assert tiny_llm.engine.eos_token_id == eos
    forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={eos: 100.0})
    out = tiny_llm.generate([[5, 6, 7]], forced, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([eos], "stop")


def test_dummy_config_file_without_tokenizer_generates(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(PRESETS["llama-tiny"]))
    llm = LLM(**{**TINY, "model": str(config_file)})
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_tokenizer_files_beside_a_dummy_config_are_used_unless_skipped(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(PRESETS["llama-tiny"]))
    assert resolve_model_source(EngineConfig(model=str(model_dir), load_format="dummy")).tokenizer_dir is None
    (model_dir / "tokenizer.json").write_text("{}")
    beside = resolve_model_source(EngineConfig(model=str(model_dir), load_format="dummy"))
    assert beside.tokenizer_dir == model_dir
    skipped = resolve_model_source(EngineConfig(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True))
    assert skipped.tokenizer_dir is None
    named = resolve_model_source(EngineConfig(model="llama-tiny", load_format="dummy", tokenizer=str(model_dir)))
    assert named.tokenizer_dir == model_dir


def test_tokenizer_free_client_streams_ids():
    async def run():
        async with EngineClient.in_process(EngineConfig(**TINY)) as client:
            assert client.tokenizer is None and client.info.tokenizer_dir is None
            with pytest.raises(InvalidRequestError, match="token ids"):
                await anext(client.generate("Hello", SamplingParams(max_tokens=2)))
            outs = [o async for o in client.generate([3, 4], SamplingParams(max_tokens=3, ignore_eos=True))]
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 3
            assert "".join(o.outputs[0].text for o in outs) == ""

    anyio.run(run)


def _hub_cached_tokenizer(cache: Path, repo: str) -> Path:
    """A word-level tokenizer ("w0".."w99") as the hub cache holds it, so it resolves offline."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    rust = RustTokenizer(models.WordLevel({**{f"w{i}": i for i in range(100)}, "[UNK]": 100}, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rust.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    rust.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    return snapshot


def test_llm_and_client_use_the_tokenizer_the_engine_resolved(tmp_path):
    snapshot = _hub_cached_tokenizer(tmp_path, "org/words")
    config = EngineConfig(**TINY, tokenizer="org/words", download_dir=str(tmp_path))
    llm = LLM(**{f: getattr(config, f) for f in config.__struct_fields__})
    assert Path(llm.tokenizer.path) == snapshot and not llm.config.skip_tokenizer_init
    out = llm.generate("w1 w2", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 2]

    async def run():
        async with EngineClient.in_process(config) as client:
            assert client.info.tokenizer_dir == str(snapshot)
            assert Path(client.tokenizer.path) == snapshot
            outs = [o async for o in client.generate("w3 w4", SamplingParams(max_tokens=2, ignore_eos=True))]
            assert outs[0].prompt_token_ids == [3, 4]

    anyio.run(run)
