"""The block-scaled FP8 GEMM (DeepSeek V3's 128 x 128 `weight_scale_inv` layout) compiled for the GPU:
on V3's projection shapes, from a decode row to a prefill chunk, against the dequantize-then-matmul
fp32 reference, and captured in a CUDA graph as the decode graphs capture it."""
from __future__ import annotations

import pytest
import torch
from corectl.backends.triton.gemm.fp8_block import fp8_block_w8a16
from corectl.quantization.fp8_block import fp8_block_linear_reference
from support.quant_checkpoints import block_quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK = (128, 128)
# (N, K): V3's q_a, kv_a (576: a partial last row block), o and dense MLP down projections.
SHAPES = [(1536, 7168), (576, 7168), (7168, 16384), (7168, 18432)]


def _quantized(n: int, k: int):
    w = torch.randn(n, k) * k ** -0.5 * torch.linspace(0.1, 4.0, n)[:, None]
    weight, scale, _ = block_quantize(w, BLOCK)
    return weight.cuda(), scale.cuda()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_gemm_on_v3_shapes_matches_the_reference(n, k, m, dtype):
    torch.manual_seed(n + m)
    weight, scale = _quantized(n, k)
    x = torch.randn(m, k, device="cuda").to(dtype)
    out = fp8_block_w8a16(x, weight, scale, None, BLOCK)
    expected = fp8_block_linear_reference(x, weight, scale, None, BLOCK)
    # Both sum in fp32 and round once to x's dtype; only the order of the sums differs.
    torch.testing.assert_close(out.float(), expected.float(), rtol=1.6e-2, atol=2e-2)


def test_block_gemm_replays_from_a_cuda_graph():
    weight, scale = _quantized(1536, 7168)
    x = torch.randn(8, 7168, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1536, device="cuda", dtype=torch.bfloat16)
    eager = fp8_block_w8a16(x, weight, scale, bias, BLOCK)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_block_w8a16(x, weight, scale, bias, BLOCK)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, fp8_block_w8a16(x, weight, scale, bias, BLOCK), rtol=0, atol=0)
    assert not torch.equal(captured, eager)
