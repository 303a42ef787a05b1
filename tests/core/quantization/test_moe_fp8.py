"""FP8 experts end to end on a random-weight Qwen3-MoE (8 experts, top 2): quantized on the fly
(`--quantization fp8`) and from FP8 checkpoints in the compressed-tensors and `fp8` layouts the
tests write (experts included). Greedy tokens are compared with the dense model of the
dequantized weights (e4m3 x scale, fp32); a divergence must sit at a near-tie of it.

The experts run W8A16 (activations not quantized). So that the whole model computes with the
dequantized weights, the linear layers take their W8A16 path too (`w8a16_linear`): their W8A8
path rounds activations to e4m3, which moves this random model's logits by more than near-ties
(test_checkpoints.py compares that path's tokens on a real model only)."""
from __future__ import annotations

import pytest
import torch
from corectl import LLM
from corectl.backends.cpu.worker import CPUWorker
from corectl.quantization import fp8
from safetensors.torch import load_file
from support.models import build_random_checkpoint
from support.quant_checkpoints import greedy_divergences, random_prompts, write_fp8_checkpoints

ENGINE = {"dtype": "float32", "kv_cache_memory_gib": 0.05, "max_model_len": 128}
NUM_LAYERS, NUM_EXPERTS = 2, 8


@pytest.fixture(scope="module")
def moe(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("moe") / "qwen3_moe"
    return build_random_checkpoint("qwen3_moe", folder, default_model_dir, seed=4, hidden_size=128,
                                   num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def w8a16_linear(monkeypatch, cpu_with_fp8_reference):
    """FP8 linear layers on their decode path (W8A16, by its torch reference) at every row count."""
    monkeypatch.setattr(fp8, "GEMV_MAX_M", 1 << 30)
    monkeypatch.setattr(CPUWorker, "quantization_kernels", lambda self: {fp8.GEMV_KERNEL: fp8.fp8_w8a16_reference})


def served_experts(llm: LLM, layer: int):
    return llm.engine.executor.worker.runner.model.model.layers[layer].mlp.experts


def stacked_reference(tensors: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's dequantized experts stacked as the layer holds them: gate_up [E, 2I, H], down [E, H, I]."""
    name = f"model.layers.{layer}.mlp.experts.{{}}.{{}}.weight".format
    gate_up = torch.stack([torch.cat([tensors[name(e, "gate_proj")], tensors[name(e, "up_proj")]])
                           for e in range(NUM_EXPERTS)])
    return gate_up, torch.stack([tensors[name(e, "down_proj")] for e in range(NUM_EXPERTS)])


def dequantized(experts) -> tuple[torch.Tensor, torch.Tensor]:
    return (experts.gate_up_proj.float() * experts.gate_up_proj_scale[..., None],
            experts.down_proj.float() * experts.down_proj_scale[..., None])


def test_fp8_on_the_fly_serves_the_tokens_of_the_dequantized_moe(moe, tmp_path, w8a16_linear):
    # Per-channel e4m3 rounding of every matrix is what on-the-fly quantization does to each row,
    # so the checkpoint writer's dequantized folder is this model's reference.
    _, reference = write_fp8_checkpoints(moe, tmp_path, "compressed-tensors", per_channel=True)
    ours = LLM(str(moe), quantization="fp8", **ENGINE)
    assert ours.engine.info.quantization == "fp8 (fp8_reference)"
    expected = load_file(reference / "model.safetensors")
    for layer in range(NUM_LAYERS):
        experts = served_experts(ours, layer)
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
        for got, want in zip(dequantized(experts), stacked_reference(expected, layer)):
            assert torch.equal(got, want)
    divergences = greedy_divergences(ours, LLM(str(reference), **ENGINE), random_prompts())
    print(f"fp8 on the fly, MoE: {len(divergences)} near-tie divergences {divergences}")


@pytest.mark.parametrize("method,per_channel", [("compressed-tensors", True), ("compressed-tensors", False),
                                                ("fp8", False)])
def test_fp8_moe_checkpoint_loads_exact_experts_and_serves(method, per_channel, moe, tmp_path, w8a16_linear):
    """Every expert's e4m3 matrix times its scale per row (a per-tensor scale expanded to rows) is
    the checkpoint's dequantized expert, bit for bit; static input scales are read past."""
    quantized, reference = write_fp8_checkpoints(moe, tmp_path, method, per_channel, static_inputs=True)
    ours = LLM(str(quantized), **ENGINE)
    assert ours.engine.info.quantization == f"{method} (fp8_reference)"
    expected = load_file(reference / "model.safetensors")
    for layer in range(NUM_LAYERS):
        for got, want in zip(dequantized(served_experts(ours, layer)), stacked_reference(expected, layer)):
            assert torch.equal(got, want)
    divergences = greedy_divergences(ours, LLM(str(reference), **ENGINE), random_prompts())
    print(f"{method} MoE checkpoint: {len(divergences)} near-tie divergences {divergences}")


@pytest.mark.slow
def test_fp8_moe_checkpoint_at_tensor_parallel_2(moe, tmp_path, cpu_with_fp8_reference):
    """Two ranks (processes over gloo) each load their intermediate rows of every FP8 expert (and
    their row scales) and decode the dequantized model's tokens. The attention stays dense (the
    checkpoint ignores it): the ranks are spawned processes, which `w8a16_linear` cannot reach."""
    quantized, reference = write_fp8_checkpoints(moe, tmp_path, "compressed-tensors", per_channel=True,
                                                 ignore=("self_attn",))
    ours = LLM(str(quantized), tensor_parallel_size=2, **ENGINE)
    try:
        assert ours.engine.info.quantization == "compressed-tensors (fp8_reference)"
        divergences = greedy_divergences(ours, LLM(str(reference), **ENGINE), random_prompts())
        print(f"FP8 MoE at TP 2: {len(divergences)} near-tie divergences {divergences}")
    finally:
        ours.engine.executor.shutdown()
