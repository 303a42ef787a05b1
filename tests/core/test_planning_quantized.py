"""`corectl plan` sizes quantized weights as the target platform serves them: FP8 on the fly on an
H100 (compute capability 9.0, named without one here), AWQ set on a shape preset through
hf_overrides, and the embedded GGUF on an H100 and on the CPU, where it is compared with the
engine's own tensors."""
from __future__ import annotations

import json

import pytest
import torch
from corectl import LLM
from corectl.backends.cpu import worker as cpu_worker
from corectl.config import EngineConfig
from corectl.errors import ConfigError
from corectl.planning import plan_deployment, read_checkpoint
from corectl.server.cli.main import main
from support.models import held_bytes

H100 = {"device_memory": 80 << 30, "device_capability": (9, 0)}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _linear_shapes(hf) -> list[tuple[int, int]]:
    """(out, in) of every quantizable layer of a Llama: packed qkv, o, packed gate_up, down."""
    head_dim = hf.hidden_size // hf.num_attention_heads
    qkv = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * head_dim
    h, i = hf.hidden_size, hf.intermediate_size
    return [(qkv, h), (h, hf.num_attention_heads * head_dim), (2 * i, h), (h, i)] * hf.num_hidden_layers


def _unquantized_bytes(hf, itemsize: int) -> int:
    """The embedding, the (untied) LM head and the norms, which every method leaves dense."""
    heads = 1 if hf.tie_word_embeddings else 2
    return (heads * hf.vocab_size * hf.hidden_size + (2 * hf.num_hidden_layers + 1) * hf.hidden_size) * itemsize


# The embedded GGUF's tests come first: they read the folder the session converted it into once (a
# conversion of their own costs seconds); the shape presets' tests after them write their configs
# to a cache of the module's own (`isolated_env`, which stays set from its first test to the end).
def test_the_embedded_gguf_on_the_cpu_plans_the_bytes_the_engine_holds(monkeypatch):
    monkeypatch.setattr(cpu_worker, "prepack_linears", lambda model, dtype: 0)
    options = {"max_model_len": 512, "kv_cache_memory_gib": 0.05}
    plan = plan_deployment(EngineConfig(**options), device="cpu")
    llm = LLM(**options)
    assert plan.quantization == llm.engine.info.quantization and plan.quantization.startswith("gguf")
    assert plan.weight_bytes + plan.buffer_bytes == held_bytes(llm)
    # The Q4_1 layers load a byte per code with fp32 scales and mins, and are served packed.
    assert plan.loading_weight_bytes_per_rank > 1.3 * plan.weight_bytes  # fp32 embedding served as loaded
    dense = plan_deployment(EngineConfig(**options, quantization="none"), device="cpu")
    assert dense.quantization is None and plan.weight_bytes < 0.5 * dense.weight_bytes


def test_the_embedded_gguf_on_a_gpu_plans_its_q4_1_layers_for_w4a16(default_model_dir):
    from transformers import AutoConfig

    plan = plan_deployment(EngineConfig(max_model_len=512), **H100)
    # The shapes from the converted folder's config: reading the GGUF header again costs seconds.
    hf = AutoConfig.from_pretrained(default_model_dir)
    # Codes eight to an int32 word, an fp16 scale and offset per group of 32 inputs and output,
    # and each input's group (g_idx, int32); the tied embedding and the norms in bf16.
    expected = sum(k * n // 2 + (k // 32) * n * 2 * 2 + 4 * k for n, k in _linear_shapes(hf))
    assert plan.quantization == "gguf (Q4_1 int4 layers via w4a16)" and plan.dtype == "bfloat16"
    assert plan.weight_bytes == expected + _unquantized_bytes(hf, 2)


@pytest.mark.usefixtures("isolated_env")
def test_fp8_on_the_fly_plans_fp8_matrices_with_row_scales():
    dense = plan_deployment(EngineConfig(model="llama3-8b"), **H100)
    fp8 = plan_deployment(EngineConfig(model="llama3-8b", quantization="fp8"), **H100)
    hf = read_checkpoint(EngineConfig(model="llama3-8b")).hf_config
    # e4m3 matrices (a byte a value) and an fp32 scale per output row; the rest stays bf16.
    expected = sum(n * k + 4 * n for n, k in _linear_shapes(hf)) + _unquantized_bytes(hf, 2)
    assert fp8.quantization == "fp8 (fp8_scaled_mm)" and dense.quantization is None
    assert fp8.weight_bytes == fp8.weight_bytes_per_rank == expected == 9_086_705_664
    assert fp8.weight_bytes == pytest.approx(dense.weight_bytes * 0.566, rel=0.01)
    # Quantized after loading: the checkpoint's bf16 weights are held until every layer is in.
    assert fp8.loading_weight_bytes_per_rank == dense.weight_bytes
    assert fp8.num_params == dense.num_params and fp8.dtype == "bfloat16"
    assert fp8.kv_tokens > dense.kv_tokens
    two = plan_deployment(EngineConfig(model="llama3-8b", quantization="fp8", tensor_parallel_size=2), **H100)
    assert two.weight_bytes_per_rank == pytest.approx(fp8.weight_bytes / 2, rel=0.001)


@pytest.mark.usefixtures("isolated_env")
def test_fp8_on_the_fly_plans_the_experts_as_fp8_with_row_scales():
    """Qwen3-30B-A3B: its experts (most of its weights) are planned as served, e4m3 matrices and an
    fp32 scale per output row of each expert, as are its attention projections."""
    dense = plan_deployment(EngineConfig(model="qwen3-30b-a3b"), **H100)
    fp8 = plan_deployment(EngineConfig(model="qwen3-30b-a3b", quantization="fp8"), **H100)
    hf = read_checkpoint(EngineConfig(model="qwen3-30b-a3b")).hf_config
    layers, experts, h, i = hf.num_hidden_layers, hf.num_experts, hf.hidden_size, hf.moe_intermediate_size
    q, qkv = hf.num_attention_heads * hf.head_dim, (hf.num_attention_heads + 2 * hf.num_key_value_heads) * hf.head_dim
    attention = [(qkv, h), (h, q)]
    dense_bytes = layers * (experts * 3 * i * h + sum(n * k for n, k in attention)) * 2
    fp8_bytes = layers * (experts * (3 * i * h + 4 * (2 * i + h)) + sum(n * k + 4 * n for n, k in attention))
    assert fp8.weight_bytes == dense.weight_bytes - dense_bytes + fp8_bytes
    assert fp8.weight_bytes == pytest.approx(dense.weight_bytes * 0.51, rel=0.01)
    assert fp8.loading_weight_bytes_per_rank == dense.weight_bytes and fp8.num_params == dense.num_params
    two = plan_deployment(EngineConfig(model="qwen3-30b-a3b", quantization="fp8", tensor_parallel_size=2), **H100)
    assert two.weight_bytes_per_rank < 0.51 * fp8.weight_bytes


@pytest.mark.usefixtures("isolated_env")
def test_awq_from_hf_overrides_plans_4bit_codes_and_group_scales():
    config = EngineConfig(model="llama3-8b", hf_overrides={"quantization_config": AWQ})
    hf = read_checkpoint(config).hf_config
    plan = plan_deployment(config, **H100)
    # w4a16 serves codes eight to an int32 word, bf16 scales and int32 zero codes per group of 128
    # inputs and output, and each input's group (g_idx, int32).
    expected = sum(k * n // 2 + (k // 128) * n * (2 + 4) + 4 * k for n, k in _linear_shapes(hf))
    assert plan.quantization == "awq (w4a16)"
    assert plan.weight_bytes == expected + _unquantized_bytes(hf, 2)
    # On the CPU the same checkpoint runs torch's packed int4 GEMM: two codes a byte, and a bf16
    # (scale, zero) pair per group and output.
    cpu = plan_deployment(config.replace(kv_cache_memory_gib=1), device="cpu", device_memory=64 << 30)
    packed = sum(k * n // 2 + (k // 128) * n * 4 for n, k in _linear_shapes(hf))
    assert cpu.quantization == "awq (cpu_int4pack)"
    assert cpu.weight_bytes == packed + _unquantized_bytes(hf, torch.empty((), dtype=getattr(torch, cpu.dtype)).element_size())


@pytest.mark.usefixtures("isolated_env")
def test_fp8_is_a_remedy_where_the_gpu_has_fp8_kernels(capsys):
    def plan(*args: str) -> tuple[int, dict]:
        code = main(["plan", "llama3-8b", "--device-memory", "16GiB", "--json", *args])
        return code, json.loads(capsys.readouterr().out)

    code, h100 = plan("--device-capability", "9.0")
    assert code == 1 and "--quantization fp8" in h100["remedies"]
    code, fp8 = plan("--device-capability", "9.0", "--quantization", "fp8")
    assert code == 0 and fp8["quantization"] == "fp8 (fp8_scaled_mm)"
    # Without a capability, a GPU elsewhere is planned as the oldest that runs bf16: no FP8 kernel.
    code, ampere = plan()
    assert code == 1 and "--quantization fp8" not in ampere["remedies"]
    with pytest.raises(ConfigError, match="fp8_scaled_mm, fp8_reference; platform 'cuda' provides w4a16"):
        plan_deployment(EngineConfig(model="llama3-8b", quantization="fp8"), device_memory=80 << 30)


@pytest.mark.usefixtures("isolated_env")
def test_the_table_names_the_method_and_the_loading_peak(capsys):
    assert main(["plan", "llama3-8b", "-q", "fp8", "--device-capability", "9.0", "--device-memory", "80GiB"]) == 0
    weights = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("weights"))
    assert "fp8 (fp8_scaled_mm), dtype bfloat16 8.46 GiB; 14.96 GiB while loading" in weights
