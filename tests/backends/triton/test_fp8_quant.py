"""The Triton FP8 row quantizer (a W8A8 GEMM's activations) against the torch reference, bit for bit."""
from __future__ import annotations

import torch
from corectl.backends.triton.gemm.fp8_quant import quantize_rows_fp8
from corectl.quantization.fp8 import quantize_rows


def test_triton_fp8_row_quantizer_matches_reference():
    x = torch.randn(5, 300) * torch.rand(5, 1) * 10
    x[0, :4] = torch.tensor([0.0, 1e-4, -3e-3, 7e-3])  # zero and e4m3 subnormals (after scaling)
    got, got_scale = quantize_rows_fp8(x)
    expected, expected_scale = quantize_rows(x)
    torch.testing.assert_close(got_scale, expected_scale)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
