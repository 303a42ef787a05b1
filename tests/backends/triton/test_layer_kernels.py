"""The Triton layer kernels installed into real models (interpreted on CPU) decode exactly what the
models' torch code does: same greedy tokens, logprobs within fp32 rounding."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.backends.triton.layer_kernels import triton_layer_kernels
from corectl.models.kernels import install_layer_kernels
from helpers import build_random_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)


def _decode(llm: LLM, prompts):
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_fused_layers_match_torch_layers(arch, tmp_path, default_model_dir):
    folder = build_random_checkpoint(arch, tmp_path / arch, default_model_dir, seed=2)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_gib=0.01, max_model_len=128,
              enable_prefix_caching=False)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (3, 11)]
    model = llm.engine.executor.worker.runner.model
    reference_tokens, reference_logprobs = _decode(llm, prompts)
    kernels = triton_layer_kernels()
    fused_qk_calls, fused_moe_calls = [], []

    def counted_qk_norm_rotary(*args):
        fused_qk_calls.append(1)
        kernels.qk_norm_rotary(*args)

    def counted_fused_moe(*args):
        fused_moe_calls.append(1)
        return kernels.fused_moe(*args)

    counted = dataclasses.replace(kernels, qk_norm_rotary=counted_qk_norm_rotary, fused_moe=counted_fused_moe)
    assert install_layer_kernels(model, counted) > 0
    try:
        tokens, logprobs = _decode(llm, prompts)
    finally:
        install_layer_kernels(model, None)
    # Qwen3's q/k norms go through the fused norm-and-rotary kernel; Llama has none.
    assert bool(fused_qk_calls) == arch.startswith("qwen3")
    # The experts of a mixture-of-experts layer go through the fused MoE kernel.
    assert bool(fused_moe_calls) == (arch == "qwen3_moe")
    assert tokens == reference_tokens
    worst = max(abs(a - b) for row, ref in zip(logprobs, reference_logprobs) for a, b in zip(row, ref))
    assert worst < 1e-4


def test_fused_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("CORECTL_FUSED_KERNELS", "0")
    layer = torch.nn.Module()
    assert install_layer_kernels(layer, triton_layer_kernels()) == 0
