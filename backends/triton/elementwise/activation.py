"""SiLU-and-mul: the gated activation of Llama-style MLPs over a packed gate_up projection.

Rounds like Hugging Face's `act_fn(gate) * up` in the model dtype: silu(gate) is rounded to the
dtype before the multiply. `silu_mul` is that rounding for loaded values, shared with the FP8
decode GEMV, which forms the activation as it loads it (`fp8_gemv.py`, gated).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_float, require
from ..pdl import grid_dependency, pdl_enabled

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in the dtype gate and up were loaded in (the activation's): silu(gate) in
    fp32 rounded to it, times up in fp32, rounded again."""
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(tl.float32)
    return act.to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, INTER: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, silu_mul(gate, up), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (gate first, up second) -> silu(gate) * up, [T, I] in x's dtype."""
    check_float("x", x, 2)
    require(x.shape[1] % 2 == 0, f"x must be [T, 2 * intermediate], got an odd width {x.shape[1]}")
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows and inter:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
    return out
