"""DeepSeek's decode step on the worker's kernels (Triton, interpreted) against its torch path: the
routed experts through the pre-routed MoE kernel, for V2's grouped top-k with routed scaling and
V3's corrected sigmoid, on both kernel paths (one token: pairs; five: sorted), the model decoding in
CUDA graphs only once every MoE layer runs that kernel (never with block-FP8 experts, which keep
the torch path); MLA's pairwise rope rows reordered into halves at load, every score kept, and
rotated by the rotary kernel in place; and a DeepSeek build leaves transformers' initialisation
working for models made after it."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from corectl.backends.triton.layer_kernels import triton_layer_kernels
from corectl.models.deepseek import DeepseekExperts
from corectl.models.kernels import install_layer_kernels
from corectl.models.layers import RotaryEmbedding
from corectl.models.mla import MLAttention
from corectl.models.registry import resolve_model_class
from corectl.quantization.fp8 import Fp8Config
from corectl.worker.worker import build_model
from support.close import assert_close
from test_deepseek_parity import deepseek_config


@pytest.mark.parametrize("num_tokens", [1, 5])
# V2-Lite's unscaled greedy rule takes the kernel's own softmax top-k routing, the others their own.
@pytest.mark.parametrize("version", ["v2-lite", "v2-grouped", "v3"])
def test_experts_on_the_kernel_match_the_torch_path(version, num_tokens):
    torch.manual_seed(11)
    config = deepseek_config(version)
    experts = DeepseekExperts(config, correction=version == "v3")
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    hidden = torch.randn(num_tokens, config.hidden_size)
    logits = torch.randn(num_tokens, config.n_routed_experts)
    assert not experts.runs_kernel
    expected = experts.run_experts(hidden, logits)
    experts.kernels = triton_layer_kernels()
    assert experts.runs_kernel and experts.plain_routing == (version == "v2-lite")
    assert_close(experts.run_experts(hidden, logits), expected)


@pytest.mark.parametrize("block_fp8", [False, True])
def test_graph_capture_follows_the_experts_kernel(block_fp8):
    hf = deepseek_config("v3")
    hf.architectures = ["DeepseekV3ForCausalLM"]
    quant = (Fp8Config.from_checkpoint({"quant_method": "fp8", "weight_block_size": [8, 8]}, None).bind((), "cuda")
             if block_fp8 else None)
    model = build_model(resolve_model_class(hf), hf, torch.bfloat16, "meta", 64, quant)
    assert not model.supports_graph_capture
    install_layer_kernels(model, triton_layer_kernels())
    assert model.supports_graph_capture is not block_fp8


def test_rope_rows_reordered_into_halves_keep_every_score_and_rotate_on_the_kernel():
    torch.manual_seed(12)
    config = deepseek_config("v2-lite")
    heads, nope, rope, rank = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, 32
    rotary = RotaryEmbedding(config, rope, 64, torch.float32)
    attn = MLAttention(config, 0, rotary, interleave=True)
    with torch.no_grad():
        for param in attn.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    positions, hidden = torch.tensor([3, 17, 40]), torch.randn(3, config.hidden_size)

    def rotated():
        """(q's rope features [T, H, rope], k's [T, rope]) as the forward rotates them, from its views."""
        q = attn.q_full_proj(hidden).view(3, heads, nope + rope)[..., nope:]
        k = attn.kv_a_proj_with_mqa(hidden)[:, rank:].unsqueeze(1)
        q, k = attn._rotate(positions, q, k)
        return q, k.squeeze(1)

    def scores(q, k):
        return torch.einsum("thd,sd->ths", q, k)

    pairs = rotated()
    attn.absorb_weights()
    assert not attn.interleave
    halves = rotated()
    assert_close(scores(*halves), scores(*pairs))
    rotary.kernels = triton_layer_kernels()
    for got, expected in zip(rotated(), halves):
        assert_close(got, expected)


# A fresh process, so that the build comes before any import of transformers' modeling code.
BUILD_THEN_HF = """
import sys
import torch
from transformers import DeepseekV2Config, LlamaConfig
from corectl.models.registry import resolve_model_class
from corectl.worker.worker import build_model
assert "transformers.initialization" not in sys.modules
hf = DeepseekV2Config(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, architectures=["DeepseekV2ForCausalLM"])
build_model(resolve_model_class(hf), hf, torch.float32, "meta", 32)
from transformers import AutoModelForCausalLM
llama = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    vocab_size=4096, initializer_range=0.5)
print(float(AutoModelForCausalLM.from_config(llama).lm_head.weight.detach().std()))
"""


def test_a_deepseek_build_leaves_transformers_initialisation_alone():
    """The worker builds models with torch's init functions stood in for (`_no_random_init`); a
    DeepSeek model imported none of transformers' modeling code there, which would record the
    stand-ins as torch's and leave later transformers models at torch's default init (std 0.07
    here instead of the config's 0.5; stacked experts uninitialised)."""
    out = subprocess.run([sys.executable, "-c", BUILD_THEN_HF], capture_output=True, text=True, check=True)
    assert abs(float(out.stdout.split()[-1]) - 0.5) < 0.02
