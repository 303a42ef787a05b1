"""The fused SiLU-and-mul FP8 row quantizer is the quantizer of `silu_and_mul`'s output, to the bit
(both Triton kernels, interpreted), and its launcher's checks."""
from __future__ import annotations

import pytest
import torch
from corectl.backends.triton.activation import silu_and_mul
from corectl.backends.triton.fp8_quant import quantize_rows_fp8, silu_mul_quantize_rows_fp8

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gate_up(m: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different magnitudes; row 0 all zeros (the scale's floor), the last row large (its
    max maps to 448: fp16 keeps silu(gate) * up below its 65504)."""
    x = torch.randn(m, 2 * inter) * (torch.rand(m, 1) * 10)
    x[0] = 0.0
    x[-1] *= 15.0 if dtype == torch.float16 else 1e3
    return x.to(dtype)


def _assert_same_bits(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = silu_mul_quantize_rows_fp8(gate_up)
    expected_q, expected_scale = quantize_rows_fp8(silu_and_mul(gate_up))
    assert q.dtype == torch.float8_e4m3fn and q.shape == expected_q.shape and scale.shape == expected_scale.shape
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale, expected_scale)
    return q, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter", [(2, 96), (5, 77), (9, 300), (17, 1000)])
def test_fused_quantizer_is_the_quantizer_of_silu_and_mul_to_the_bit(m, inter, dtype):
    q, scale = _assert_same_bits(_gate_up(m, inter, dtype))
    assert scale[0].item() == torch.tensor(1e-12).item() and not q[0].float().any()
    assert (q[1:].float().abs().amax(-1) == 448.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_quantizer_reads_rows_at_any_stride(dtype):
    """gate_up as a column slice of a wider tensor (rows farther apart than 2I)."""
    _assert_same_bits(_gate_up(6, 155, dtype)[:, :300])


def test_fused_quantizer_of_no_rows():
    q, scale = silu_mul_quantize_rows_fp8(torch.empty(0, 64))
    assert q.shape == (0, 32) and scale.shape == (0, 1)


def test_fused_quantizer_rejects_bad_inputs():
    with pytest.raises(ValueError, match="gate_up must be \\[M, 2 \\* intermediate\\], got an odd width 65"):
        silu_mul_quantize_rows_fp8(torch.randn(3, 65))
    with pytest.raises(ValueError, match="gate_up must have 2 dimensions, got shape \\(1, 3, 64\\)"):
        silu_mul_quantize_rows_fp8(torch.randn(1, 3, 64))
    with pytest.raises(ValueError, match="gate_up must be float32, float16 or bfloat16"):
        silu_mul_quantize_rows_fp8(torch.ones(3, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="gate_up must be contiguous in its last dimension"):
        silu_mul_quantize_rows_fp8(torch.randn(64, 3).t())
    with pytest.raises(ValueError, match="rows of at most 32768 features are quantized in one program, got 32769"):
        silu_mul_quantize_rows_fp8(torch.empty(1, 2 * 32769))
