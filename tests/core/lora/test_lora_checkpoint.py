"""Bad adapters and bad LoRA options: each one clear error naming the problem."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from corectl import LLM, LoRARequest, SamplingParams
from corectl.config import EngineConfig
from corectl.errors import ConfigError, InvalidRequestError
from corectl.lora.checkpoint import LoRAAdapterError, load_adapter
from corectl.lora.shapes import BaseModelShape
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from support.adapters import save_adapter


@pytest.fixture(scope="module")
def shape(lora_base):
    return BaseModelShape.of(AutoConfig.from_pretrained(lora_base), max_lora_rank=16)


@pytest.fixture
def copy_of(adapters, tmp_path):
    def copy(name: str):
        folder = tmp_path / name
        shutil.copytree(adapters[name][0], folder)
        return folder
    return copy


def load(folder, shape):
    return load_adapter(LoRARequest("bad", 7, str(folder)), shape)


def edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_good_adapter_loads_with_peft_scaling(adapters, shape):
    adapter = load(adapters["r8"][0], shape)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert len(adapter.weights) == 2 * 7


def test_rank_above_the_limit(adapters, shape):
    with pytest.raises(LoRAAdapterError, match="rank 64, above max_lora_rank 16; .*--max-lora-rank"):
        load(adapters["r64"][0], shape)


@pytest.mark.parametrize("config_rank", [16, 4])
def test_a_config_rank_its_tensors_do_not_have(copy_of, shape, config_rank):
    """PEFT refuses such a folder; serving it would scale by lora_alpha over the wrong rank."""
    folder = copy_of("r8")
    edit_config(folder, r=config_rank)
    with pytest.raises(LoRAAdapterError, match=f"has rank 8, its adapter_config.json says r {config_rank}"):
        load(folder, shape)


def test_missing_config(copy_of, shape):
    folder = copy_of("r8")
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match="has no adapter_config.json"):
        load(folder, shape)


def test_corrupt_safetensors(copy_of, shape):
    folder = copy_of("r8")
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(LoRAAdapterError, match="not a readable safetensors file"):
        load(folder, shape)


def test_pickle_checkpoint_refused(copy_of, shape):
    folder = copy_of("r8")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="adapter_model.bin, a pickle checkpoint"):
        load(folder, shape)


def test_wrong_hidden_size(lora_base, tmp_path, shape):
    """An adapter trained on a model of another width names the module and both shapes."""
    from support.models import build_random_checkpoint

    other = build_random_checkpoint("llama", tmp_path / "wide", lora_base, hidden_size=96)
    save_adapter(other, tmp_path / "wide-adapter", rank=8, seed=0)
    with pytest.raises(LoRAAdapterError,
                       match=r"module 'model\.layers\.0\.\S+' has lora_A .*96.*was it trained on another base model"):
        load(tmp_path / "wide-adapter", shape)


@pytest.mark.parametrize("change, message", [
    (dict(use_dora=True), "DoRA"),
    (dict(target_modules=["q_proj", "lm_head"]), "targets module 'lm_head'"),
    (dict(target_modules=["embed_tokens"]), "targets module 'embed_tokens'"),
    (dict(modules_to_save=["lm_head"]), r"modules_to_save \['lm_head'\]"),
    (dict(bias="all"), "LoRA biases"),
])
def test_unsupported_features(copy_of, shape, change, message):
    folder = copy_of("r8")
    edit_config(folder, **change)
    with pytest.raises(LoRAAdapterError, match=message):
        load(folder, shape)


def test_embedding_weights_named(copy_of, shape):
    """Tensors for a module the engine cannot adapt (a LoRA on the embeddings) name that module."""
    folder = copy_of("r8")
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 100)
    save_file(tensors, path)
    with pytest.raises(LoRAAdapterError, match="module 'model.embed_tokens'"):
        load(folder, shape)


def test_engine_refuses_adapters_without_enable_lora(llm_int4, adapters):
    with pytest.raises(InvalidRequestError, match="runs without LoRA: start it with enable_lora=True"):
        llm_int4.generate("hi", SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, str(adapters["r8"][0])))


def test_one_id_names_one_adapter(lora_base, adapters):
    llm = LLM(str(lora_base), enable_lora=True, dtype="float32", max_model_len=64, kv_cache_memory_gib=0.01)
    params = SamplingParams(max_tokens=1)
    llm.generate([1, 2], params, lora_request=LoRARequest("r8", 1, str(adapters["r8"][0])), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 already names adapter 'r8'"):
        llm.generate([1, 2], params, lora_request=LoRARequest("r16", 1, str(adapters["r16"][0])), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([[1], [2]], params, lora_request=[None], use_tqdm=False)


@pytest.mark.parametrize("options, field", [
    (dict(max_lora_rank=12), "max_lora_rank"),
    (dict(max_loras=0), "max_loras"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
    (dict(lora_dtype="int8"), "lora_dtype"),
])
def test_bad_options(options, field):
    with pytest.raises(ConfigError) as caught:
        EngineConfig(**options)
    assert caught.value.field == field


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="needs a lora_path"):
        LoRARequest("a", 1, "")


def test_dummy_adapters_are_real_checkpoints(lora_base, shape, tmp_path):
    """The benchmarks' random adapters load through the same checks, on all seven projections."""
    from corectl.lora.dummy import write_dummy_adapters

    loras = write_dummy_adapters(tmp_path, AutoConfig.from_pretrained(lora_base), num=2, rank=8)
    assert [lora.lora_int_id for lora in loras] == [1, 2]
    adapter = load_adapter(loras[1], shape)
    assert adapter.rank == 8 and len(adapter.weights) == 7 * shape.num_layers
