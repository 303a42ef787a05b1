"""Per-token FP8 activation quantization in one launch (the FP8 W8A8 method's activations).

torch needs five kernels per linear layer for it (abs, row max, divide, clamp, cast); at batch-1
decode that is ~640 launches per llama3-8b step, inside the CUDA graph or not. One program per row
loads the row, takes its max, and writes the e4m3 values and the fp32 scale (row max / 448,
floored at 1e-12), matching `corectl.quantization.fp8.quantize_rows`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_float, require

# constexpr, so compiled kernels may read them (Triton refuses plain globals; its interpreter does not).
FP8_MAX = tl.constexpr(448.0)
_MIN_SCALE = tl.constexpr(1e-12)
_MAX_BLOCK = 32768


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_out, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, _MIN_SCALE)
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    # Round to the e4m3 grid in fp32 (to nearest, ties to even), so the cast below is exact: 3
    # mantissa bits for normal values, steps of 2**-9 below 2**-6. Triton's interpreter casts
    # inexact values wrongly across a power of two (124.9 -> 64); GPUs would round the same way.
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (q + 24576.0) - 24576.0  # 1.5 * 2**14: fp32 addition rounds to a multiple of 2**-9
    q = tl.where(tl.abs(q) < 0.015625, subnormal, normal)
    tl.store(out_ptr + row * stride_out + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]) with x ~= values * scale per row."""
    check_float("x", x, 2)
    m, k = x.shape
    require(k <= _MAX_BLOCK, f"rows of at most {_MAX_BLOCK} features are quantized in one program, got {k}")
    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_rows_kernel[(m,)](x, out, scales, x.stride(0), out.stride(0), k,
                                    BLOCK=triton.next_power_of_2(k), num_warps=8)
    return out, scales
