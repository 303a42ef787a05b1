"""The block-scaled FP8 weight GEMM (W8A16) against the dequantize-then-matmul fp32 reference, on
shapes whose last blocks are partial along both axes."""
from __future__ import annotations

import pytest
import torch
from corectl.backends.triton.gemm.fp8_block import fp8_block_w8a16
from corectl.quantization.fp8_block import fp8_block_linear_reference
from support.quant_checkpoints import block_quantize


# M = 1 and M > 1 (one and two row tiles), with 64 x 64 blocks and bk below the largest K step.
@pytest.mark.parametrize("block,m,dtype,bias", [((128, 128), 1, torch.float32, True),
                                                ((128, 128), 40, torch.bfloat16, False),
                                                ((64, 64), 1, torch.bfloat16, True),
                                                ((64, 64), 70, torch.float32, False),
                                                ((128, 32), 5, torch.float32, True)])
def test_block_gemm_matches_dequantized_reference(block, m, dtype, bias, assert_close):
    # Row blocks of different magnitudes, so a scale applied to the wrong block shows.
    w = torch.randn(200, 320) * 320 ** -0.5 * torch.linspace(0.1, 4.0, 200)[:, None]
    weight, scale, _ = block_quantize(w, block)
    x = torch.randn(m, 320).to(dtype)
    b = torch.randn(200).to(dtype) if bias else None
    assert_close(fp8_block_w8a16(x, weight, scale, b, block), fp8_block_linear_reference(x, weight, scale, b, block))


def test_scale_of_the_wrong_shape_is_refused():
    weight, scale, _ = block_quantize(torch.randn(200, 320), (128, 128))
    with pytest.raises(ValueError, match=r"scale must be \[2, 3\]"):
        fp8_block_w8a16(torch.randn(1, 320), weight, scale[:, :2], None, (128, 128))
