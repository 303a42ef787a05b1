"""Per-token FP8 activation quantization in one launch (the FP8 W8A8 method's activations).

torch needs five kernels per linear layer for it (abs, row max, divide, clamp, cast); at batch-1
decode that is ~640 launches per llama3-8b step, inside the CUDA graph or not. One program per row
loads the row, takes its max, and writes the e4m3 values and the fp32 scale (row max / 448,
floored at 1e-12), matching `corectl.quantization.fp8.quantize_rows`.

`silu_mul_quantize_rows_fp8` does the same for a gated MLP's down projection straight from the
packed gate_up: the row's silu(gate) * up is formed as `silu_and_mul` forms it (the shared
`activation.silu_mul`) and quantized by the same `_quantize_row`, so it is bit-identical to the
two launches it replaces, without the [M, I] activation's round trip through memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_mul
from .checks import check_float, require

# constexpr, so compiled kernels may read them (Triton refuses plain globals; its interpreter does not).
FP8_MAX = tl.constexpr(448.0)
_MIN_SCALE = tl.constexpr(1e-12)
_MAX_BLOCK = 32768


@triton.jit
def _quantize_row(x):
    """A row (fp32, masked lanes 0) -> (fp32 values on the e4m3 grid, the row's fp32 scale)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, _MIN_SCALE)
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    # Round to the e4m3 grid in fp32 (to nearest, ties to even), so the caller's cast is exact: 3
    # mantissa bits for normal values, steps of 2**-9 below 2**-6. Triton's interpreter casts
    # inexact values wrongly across a power of two (124.9 -> 64); GPUs would round the same way.
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (q + 24576.0) - 24576.0  # 1.5 * 2**14: fp32 addition rounds to a multiple of 2**-9
    return tl.where(tl.abs(q) < 0.015625, subnormal, normal), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_out, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_row(x)
    tl.store(out_ptr + row * stride_out + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _silu_mul_quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_out, INTER,
                                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0)
    q, scale = _quantize_row(silu_mul(gate, up).to(tl.float32))  # masked lanes: silu(0) * 0 = 0
    tl.store(out_ptr + row * stride_out + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def _outputs(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    require(k <= _MAX_BLOCK, f"rows of at most {_MAX_BLOCK} features are quantized in one program, got {k}")
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]) with x ~= values * scale per row."""
    check_float("x", x, 2)
    m, k = x.shape
    out, scales = _outputs(m, k, x.device)
    if m and k:
        _quantize_rows_kernel[(m,)](x, out, scales, x.stride(0), out.stride(0), k,
                                    BLOCK=triton.next_power_of_2(k), num_warps=8)
    return out, scales


def silu_mul_quantize_rows_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (gate first, up second) -> `quantize_rows_fp8(silu_and_mul(gate_up))`,
    (e4m3 [M, I], fp32 scales [M, 1]), to the bit."""
    check_float("gate_up", gate_up, 2)
    m, width = gate_up.shape
    require(width % 2 == 0, f"gate_up must be [M, 2 * intermediate], got an odd width {width}")
    inter = width // 2
    out, scales = _outputs(m, inter, gate_up.device)
    if m and inter:
        _silu_mul_quantize_rows_kernel[(m,)](gate_up, out, scales, gate_up.stride(0), out.stride(0), inter,
                                             BLOCK=triton.next_power_of_2(inter), num_warps=8)
    return out, scales
