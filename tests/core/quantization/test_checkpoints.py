"""Quantized checkpoints the tests write in each real format load, serve, and decode the greedy
tokens of the dense model of their dequantized weights (fp32) on 8 prompts x 16 tokens; a
divergence must sit at a near-tie of the reference. Broken checkpoints fail at startup."""
from __future__ import annotations

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from corectl.quantization.fp8 import quantize_rows
from safetensors.torch import load_file
from support.models import build_random_checkpoint
from support.quant_checkpoints import greedy_divergences, random_prompts, write_fp8_checkpoints, write_w4_checkpoints

ENGINE = {"dtype": "float32", "kv_cache_memory_gib": 0.05, "max_model_len": 128}


@pytest.fixture(scope="module")
def dense(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("dense") / "llama"
    return build_random_checkpoint("llama", folder, default_model_dir, seed=3, hidden_size=128,
                                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   initializer_range=0.1)


def _compare(quantized, reference, **options):
    ours = LLM(str(quantized), **ENGINE, **options)
    ref = LLM(str(reference), **ENGINE)
    return ours, greedy_divergences(ours, ref, random_prompts())


@pytest.mark.parametrize("method,act_order,group", [("awq", False, 128), ("gptq", False, 128), ("gptq", True, 128),
                                                    ("gptq", True, 32)])
def test_w4_checkpoint_matches_its_dequantized_model(method, act_order, group, dense, tmp_path):
    quantized, reference = write_w4_checkpoints(dense, tmp_path, method, group=group, act_order=act_order)
    ours, divergences = _compare(quantized, reference)
    assert ours.engine.info.quantization == f"{method} (cpu_int4pack)"
    print(f"{ours.engine.info.quantization}: {len(divergences)} near-tie divergences {divergences}")


@pytest.mark.parametrize("method,per_channel,static", [("compressed-tensors", True, False),
                                                       ("compressed-tensors", False, True), ("fp8", False, False)])
def test_fp8_checkpoint_loads_its_exact_weights_and_serves(method, per_channel, static, dense, tmp_path,
                                                           cpu_with_fp8_reference):
    """Every layer's e4m3 weight times its per-channel scale (per-tensor shard scales expanded)
    is the dequantized weight, bit for bit; activations are quantized per token, so tokens are
    compared on a real model (test_smollm2_quantized.py), not on this random one."""
    quantized, reference = write_fp8_checkpoints(dense, tmp_path, method, per_channel, static)
    llm = LLM(str(quantized), **ENGINE)
    assert llm.engine.info.quantization == f"{method} (fp8_reference)"
    expected = _packed_reference(load_file(reference / "model.safetensors"))
    layers = dict(llm.engine.executor.worker.runner.model.named_modules())
    checked = 0
    for name, weight in expected.items():
        ours = layers[name]
        assert ours.weight.dtype == torch.float8_e4m3fn and not hasattr(ours, "input_scale")
        assert torch.equal(ours.weight.float() * ours.weight_scale.view(-1, 1), weight), name
        checked += 1
    assert checked == 2 * 4
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_on_the_fly_quantizes_each_row_after_loading(dense, cpu_with_fp8_reference):
    llm = LLM(str(dense), quantization="fp8", **ENGINE)
    assert llm.engine.info.quantization == "fp8 (fp8_reference)"
    layer = llm.engine.executor.worker.runner.model.model.layers[0].mlp.gate_up_proj
    dense_weight = _packed_reference(load_file(dense / "model.safetensors"))["model.layers.0.mlp.gate_up_proj"]
    expected, scale = quantize_rows(dense_weight)
    assert torch.equal(layer.weight.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale.view(-1))


def _packed_reference(tensors: dict) -> dict:
    """Dense weights by the engine's layer names (q/k/v and gate/up stacked as the packed layers hold them)."""
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
              "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
    out = {}
    for layer in range(2):
        for block, names in (("self_attn", ("qkv_proj", "o_proj")), ("mlp", ("gate_up_proj", "down_proj"))):
            for name in names:
                parts = [tensors[f"model.layers.{layer}.{block}.{p}.weight"] for p in packed[name]]
                out[f"model.layers.{layer}.{block}.{name}"] = torch.cat(parts)
    return out


def test_fp8_without_an_fp8_kernel_is_refused_at_startup(dense):
    with pytest.raises(ConfigError, match="fp8_scaled_mm.*platform 'cpu' provides cpu_int4pack"):
        LLM(str(dense), quantization="fp8", **ENGINE)


def test_missing_shard_scale_is_named(dense, tmp_path, cpu_with_fp8_reference):
    quantized, _ = write_fp8_checkpoints(dense, tmp_path, "compressed-tensors", True,
                                         drop=("model.layers.1.self_attn.k_proj.weight_scale",))
    with pytest.raises(ConfigError, match=r"no weight_scale for shard\(s\) k of model.layers.1.self_attn.qkv_proj"):
        LLM(str(quantized), **ENGINE)


def test_missing_layer_scale_is_named(dense, tmp_path):
    quantized, _ = write_w4_checkpoints(dense, tmp_path, "awq", group=128)
    import safetensors.torch as st

    tensors = st.load_file(quantized / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.scales"]
    st.save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ConfigError, match="model.layers.0.mlp.down_proj.scales"):
        LLM(str(quantized), **ENGINE)


def test_quantization_other_than_the_checkpoints_is_refused(dense, tmp_path):
    quantized, _ = write_w4_checkpoints(dense, tmp_path, "awq", group=128)
    with pytest.raises(ConfigError, match="quantized with 'awq'"):
        LLM(str(quantized), quantization="gptq", **ENGINE)
    with pytest.raises(ConfigError, match="unknown quantization method 'int3'"):
        LLM(str(dense), quantization="int3", **ENGINE)


@pytest.mark.slow
@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_w4_checkpoint_at_tensor_parallel_2(method, act_order, dense, tmp_path):
    """Two ranks (processes over gloo) load their slices and decode the dequantized model's tokens."""
    quantized, reference = write_w4_checkpoints(dense, tmp_path, method, group=32, act_order=act_order)
    ours = LLM(str(quantized), tensor_parallel_size=2, **ENGINE)
    try:
        assert ours.engine.info.quantization == f"{method} (cpu_int4pack)"
        divergences = greedy_divergences(ours, LLM(str(reference), **ENGINE), random_prompts())
        print(f"{method} at TP 2: {len(divergences)} near-tie divergences {divergences}")
    finally:
        ours.engine.executor.shutdown()
