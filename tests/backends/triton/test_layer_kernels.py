"""The Triton layer kernels installed into real models (interpreted on CPU) decode exactly what the
models' torch code does: same greedy tokens, logprobs within fp32 rounding. FP8 Llama with the
Triton W8A16 GEMV as well: its MLP then forms the activation inside the down GEMV at decode."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.backends.cpu.worker import CPUWorker
from corectl.backends.triton.gemm.fp8_gemv import fp8_w8a16_gemv
from corectl.backends.triton.layer_kernels import triton_layer_kernels
from corectl.models.kernels import install_layer_kernels
from corectl.quantization.fp8 import GEMV_KERNEL, GEMV_MAX_M
from support.models import build_random_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)


def _decode(llm: LLM, prompts):
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


def _llm(arch: str, tmp_path, default_model_dir, **engine) -> LLM:
    folder = build_random_checkpoint(arch, tmp_path / arch, default_model_dir, seed=2)
    return LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.01, max_model_len=128,
               enable_prefix_caching=False, **engine)


def _assert_fused_decode_matches(llm: LLM, kernels) -> None:
    """Greedy decode with the torch layers, then with `kernels` installed: same tokens, logprobs
    within fp32 rounding. Two prompts: prefill steps of 14 tokens, decode steps of 2 rows."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (3, 11)]
    model = llm.engine.executor.worker.runner.model
    # The CPU worker installs its own C kernels: the reference is the torch code. (FP8 activations
    # round per token, so even the C kernels' last-bit differences move an FP8 model's logprobs.)
    install_layer_kernels(model, None)
    reference_tokens, reference_logprobs = _decode(llm, prompts)
    assert install_layer_kernels(model, kernels) > 0
    try:
        tokens, logprobs = _decode(llm, prompts)
    finally:
        install_layer_kernels(model, None)
    assert tokens == reference_tokens
    worst = max(abs(a - b) for row, ref in zip(logprobs, reference_logprobs) for a, b in zip(row, ref))
    assert worst < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_fused_layers_match_torch_layers(arch, tmp_path, default_model_dir):
    llm = _llm(arch, tmp_path, default_model_dir)
    kernels = triton_layer_kernels()
    fused_qk_calls, fused_moe_calls = [], []

    def counted_qk_norm_rotary(*args):
        fused_qk_calls.append(1)
        kernels.qk_norm_rotary(*args)

    def counted_fused_moe(*args):
        fused_moe_calls.append(1)
        return kernels.fused_moe(*args)

    _assert_fused_decode_matches(llm, dataclasses.replace(kernels, qk_norm_rotary=counted_qk_norm_rotary,
                                                          fused_moe=counted_fused_moe))
    # Qwen3's q/k norms go through the fused norm-and-rotary kernel; Llama has none.
    assert bool(fused_qk_calls) == arch.startswith("qwen3")
    # The experts of a mixture-of-experts layer go through the fused MoE kernel.
    assert bool(fused_moe_calls) == (arch == "qwen3_moe")


def test_fp8_decode_mlp_forms_the_activation_inside_the_down_gemv(tmp_path, default_model_dir, monkeypatch,
                                                                   cpu_with_fp8_reference):
    """FP8 Llama with the Triton W8A16 GEMV: the torch layers run silu(gate) * up, then the down
    GEMV; the fused layers hand decode steps' gate_up to the gated GEMV and keep silu_and_mul for
    the prefill (14 rows, more than the GEMV takes: W8A8)."""
    gated_rows = []

    def gemv(x, weight, scale, bias, gated=False):
        if gated:
            gated_rows.append(x.shape[0])
        return fp8_w8a16_gemv(x, weight, scale, bias, gated=gated)

    monkeypatch.setattr(CPUWorker, "quantization_kernels", lambda self: {GEMV_KERNEL: gemv})
    llm = _llm("llama", tmp_path, default_model_dir, quantization="fp8")
    assert llm.engine.info.quantization == "fp8 (fp8_reference)"
    kernels = triton_layer_kernels()
    silu_rows = []

    def counted_silu_and_mul(x):
        silu_rows.append(x.shape[0])
        return kernels.silu_and_mul(x)

    _assert_fused_decode_matches(llm, dataclasses.replace(kernels, silu_and_mul=counted_silu_and_mul))
    assert gated_rows and max(gated_rows) <= GEMV_MAX_M
    assert silu_rows and min(silu_rows) > GEMV_MAX_M


def test_fused_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("CORECTL_FUSED_KERNELS", "0")
    layer = torch.nn.Module()
    assert install_layer_kernels(layer, triton_layer_kernels()) == 0


@pytest.mark.parametrize("num_tokens", [1, 5, 9])
def test_router_logits_take_the_gemv_at_decode_sizes_and_f_linear_above(num_tokens, monkeypatch):
    """Up to 8 tokens the router's logits come from the unscaled GEMV, above that from F.linear;
    both equal the router's linear layer, with its bias (gpt-oss's) and without."""
    from corectl.backends.triton import layer_kernels

    gemv_calls = []
    real_gemv = layer_kernels.dense_gemv
    monkeypatch.setattr(layer_kernels, "dense_gemv", lambda x, w, b: gemv_calls.append(1) or real_gemv(x, w, b))
    hidden, weight, bias = torch.randn(num_tokens, 64), torch.randn(16, 64), torch.randn(16)
    router = triton_layer_kernels().router_logits
    torch.testing.assert_close(router(hidden, weight), hidden @ weight.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(router(hidden, weight, bias), hidden @ weight.t() + bias, rtol=1e-5, atol=1e-5)
    assert len(gemv_calls) == (2 if num_tokens <= 8 else 0)


@pytest.mark.parametrize("num_tokens", [1, 3, 9])
def test_dense_layers_take_the_gemv_where_the_rule_chooses_it(num_tokens, monkeypatch):
    """bf16 column- and row-parallel layers with the Triton kernels installed: a batch-1 step goes
    through the dense GEMV (the down projection gated: silu(gate) * up formed on load); at more rows
    these small layers keep F.linear (gemv_configs); both equal the torch layers."""
    from corectl.backends.triton import layer_kernels
    from corectl.models.parallel import PackedLinear, RowParallelLinear
    from torch.nn import functional as F

    hidden, inter = 64, 96
    calls = []
    real = layer_kernels.dense_gemv
    monkeypatch.setattr(layer_kernels, "dense_gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    gate_up = PackedLinear(hidden, {"gate": inter, "up": inter}, bias=False)
    down = RowParallelLinear(inter, hidden, bias=True)
    for layer in (gate_up, down):
        layer.set_quant_method(None, torch.bfloat16, torch.device("cpu"))
        torch.nn.init.normal_(layer.weight, std=0.1)
    down.bias = torch.nn.Parameter(torch.randn(hidden).to(torch.bfloat16))
    assert install_layer_kernels(torch.nn.ModuleList([gate_up, down]), triton_layer_kernels()) == 2

    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    projected = gate_up(x)
    torch.testing.assert_close(projected, F.linear(x, gate_up.weight), rtol=2 ** -7, atol=1e-2)
    gated = down.forward_gated(projected)
    expected = F.linear(triton_layer_kernels().silu_and_mul(projected), down.weight, down.bias)
    if num_tokens > 1:  # no fused form: the MLP runs silu_and_mul and forward
        assert gated is None and calls == []
        return
    torch.testing.assert_close(gated, expected, rtol=2 ** -7, atol=1e-2)
    assert calls == [(1, hidden), (1, 2 * inter)]


def test_lm_head_takes_the_dense_gemv_at_decode_rows(monkeypatch):
    """The LM head's logits come from the dense GEMV at a decode step, and equal F.linear."""
    from corectl.backends.triton.gemm import fp8_gemv
    from corectl.models.parallel import ParallelLMHead

    head = ParallelLMHead(32, 200).to(torch.bfloat16)
    hidden = torch.randn(1, 32).to(torch.bfloat16)
    reference = head(hidden)  # no kernels installed: F.linear
    install_layer_kernels(head, triton_layer_kernels())
    calls = []
    real = fp8_gemv.dense_gemv
    monkeypatch.setattr("corectl.backends.triton.layer_kernels.dense_gemv", lambda *a: calls.append(1) or real(*a))
    torch.testing.assert_close(head(hidden), reference, rtol=2 ** -7, atol=1e-2)
    assert calls == [1]
