"""Fused RMSNorm, optionally with the residual add that precedes it in every decoder layer.

Rounding follows Hugging Face Llama step for step: the residual sum is rounded to the model dtype
before it is normalised, and the normalised row is rounded before the weight multiplies it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_float, check_same_device, require
from ..pdl import grid_dependency, pdl_enabled


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # The weight is a parameter, written by no kernel of the step: read while the kernel before
    # this one still runs, not after the row's reduction.
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        summed = x + tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        rounded = summed.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, rounded, mask=mask)
        x = rounded.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, N] -> norm(x); with residual [T, N]: (norm(x + residual), x + residual), new tensors."""
    check_float("x", x, 2)
    check_float("weight", weight, 1)
    num_rows, width = x.shape
    if weight.shape[0] != width or weight.dtype != x.dtype:
        require(weight.shape[0] == width, f"weight has {weight.shape[0]} elements but rows of x have {width}")
        raise ValueError(f"weight and x must share a dtype, got {weight.dtype} and {x.dtype}")
    out = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    if residual is None:
        check_same_device(x=x, weight=weight)
        res_in = res_out = out
    else:
        check_float("residual", residual, 2)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must be {x.dtype} {tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}")
        check_same_device(x=x, weight=weight, residual=residual)
        res_in, res_out = residual, torch.empty_like(out)
    if num_rows:
        block = triton.next_power_of_2(width)
        pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(num_rows,)](
            x, res_in, weight, out, res_out, eps,
            x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            N=width, BLOCK=block, HAS_RESIDUAL=residual is not None, PDL=pdl,
            num_warps=min(16, max(1, block // 512)), launch_pdl=pdl,
        )
    return out if residual is None else (out, res_out)
