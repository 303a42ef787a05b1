"""The absorbed MLA up-projections are read out of a block-FP8 `kv_b_proj` (as DeepSeek V3 ships it)
through its own quantized GEMM, on the torch path and on the Triton block kernel (interpreter):
each head's W_UK and W_UV equal the dequantized checkpoint weight."""
from __future__ import annotations

import pytest
import torch
from corectl.backends.triton.gemm.fp8_block import fp8_block_w8a16
from corectl.models.mla import MLAttention
from corectl.models.parallel import RowParallelLinear
from corectl.quantization.fp8 import Fp8Config
from corectl.quantization.fp8_block import BLOCK_KERNEL, TORCH_PATH
from support.close import assert_close
from support.quant_checkpoints import block_quantize
from support.quantized_layers import build_quantized_layer, finish_loading

HEADS, NOPE, ROPE, V_DIM, RANK = 4, 16, 8, 12, 32
PREFIX = "model.layers.0.self_attn.kv_b_proj"
KERNELS = {TORCH_PATH: {}, BLOCK_KERNEL: {BLOCK_KERNEL: fp8_block_w8a16}}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_absorbed_projections_are_the_dequantized_block_fp8_kv_b_proj(kernel):
    from transformers import DeepseekV2Config

    config = DeepseekV2Config(hidden_size=64, num_attention_heads=HEADS, kv_lora_rank=RANK, q_lora_rank=None,
                              qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM)
    attn = MLAttention(config, 0, None, interleave=True)
    q, scale, dense = block_quantize(torch.randn(HEADS * (NOPE + V_DIM), RANK) * 0.1, (16, 32))
    fp8 = Fp8Config(serialized=True, weight_block=(16, 32), kernel=kernel)
    attn.kv_b_proj = build_quantized_layer(fp8, KERNELS[kernel], lambda: RowParallelLinear(RANK, dense.shape[0],
                                                                                           bias=False),
                                           PREFIX, torch.float32)
    attn.kv_b_proj.weight.weight_loader(attn.kv_b_proj.weight, q)
    attn.kv_b_proj.weight_scale_inv.weight_loader(attn.kv_b_proj.weight_scale_inv, scale)
    finish_loading(attn.kv_b_proj, PREFIX)
    attn.absorb_weights()
    per_head = dense.view(HEADS, NOPE + V_DIM, RANK)
    assert_close(attn.w_uk, per_head[:, :NOPE], 1e-6, norm="max")
    assert_close(attn.w_uv, per_head[:, NOPE:].transpose(1, 2), 1e-6, norm="max")
