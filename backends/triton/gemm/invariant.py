"""A dense GEMM whose every output row is the same bits whatever else is in the batch
(`--batch-invariant`, docs/performance.md "Batch-invariant output").

cuBLAS picks its algorithm (tile shape, split-K) by M, so a request's logits change with the number
of rows sharing its step. Here the launch is a function of (N, K, dtype) alone: fixed tiles, no
split-K, fp32 accumulation over K in BLOCK_K steps from 0 upwards, the bias added to the fp32 sum
before the one rounding to the output dtype. M only sets how many row tiles there are; a row's
products, their order and the instructions that sum them are the same in every tile it can land in.

Persistent and grouped: `programs` (one per SM) walk the (M tile, N tile) grid in GROUP_M-row
bands, so the programs running at once share weight tiles in L2 during long prefills. M is not a
specialisation key (Triton compiles a separate kernel for an integer argument equal to 1 or divisible
by 16): a batch size never selects another compiled kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..checks import check_float, check_same_device, require
from .w4a16_configs import sm_count


class InvariantConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# 128 x 128 tiles, 64 inputs a step: the compute-bound prefill shapes keep the tensor cores busy, and a
# decode step's few rows cost one row tile per weight tile (the weights are read once either way).
# 4 warps and 4 stages beat 8 and 3 on every llama3-8b projection from 1 to 8,192 rows on an H100
# (`sweep:invgemmcfg`, docs/performance.md "Batch-invariant output").
_HALF = InvariantConfig(128, 128, 64, 8, 4, 4)
# fp32 runs IEEE FMAs (TF32 would round the inputs): smaller K steps keep the operands in registers.
_FLOAT = InvariantConfig(64, 64, 32, 8, 4, 3)


def invariant_config(n: int, k: int, dtype: torch.dtype) -> InvariantConfig:
    """The launch for a layer of N outputs over K inputs: never a function of the batch's rows.
    Narrow layers (a router's experts, a tiny model) take the narrowest power-of-two tile that
    covers them."""
    base = _FLOAT if dtype == torch.float32 else _HALF
    if n < base.block_n:
        base = base._replace(block_n=max(16, triton.next_power_of_2(n)))
    return base


@triton.jit(do_not_specialize=["M", "programs"])
def _invariant_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, OPERAND: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), tiles_m * tiles_n, programs):
        first_m = tile // band * GROUP_M
        rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + tile % band % rows_in_band
        pid_n = tile % band // rows_in_band
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows and columns past the edge read row / column 0 (never stored): only K needs a mask,
        # and a row's loads are the same whether or not its tile is full.
        safe_m = tl.where(offs_m < M, offs_m, 0)
        safe_n = tl.where(offs_n < N, offs_n, 0)
        a_ptrs = a_ptr + safe_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + safe_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(a.to(OPERAND), b.to(OPERAND), acc, input_precision="ieee")
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def _operand(x: torch.Tensor):
    # The interpreter multiplies with numpy, which has no bfloat16: fp32 operands hold bf16 and fp16
    # exactly, and a whole tile's product still runs as one fixed-shape matmul.
    if x.device.type == "cpu" or x.dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     programs: int | None = None, config: InvariantConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T + bias [N] in x's dtype, each row independent of the others'
    count and values. `programs` caps the persistent grid (a test's way to make programs loop over
    several tiles; default: one per SM); `config` overrides `invariant_config` (a benchmark's
    sweep: rows stay invariant under any one config, not across two)."""
    require(x.dim() >= 1, f"x must have at least one dimension, got shape {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    check_float("weight", weight, 2)
    m, k = rows.shape
    n = weight.shape[0]
    require(weight.shape[1] == k, f"x has {k} inputs per row but weight is {tuple(weight.shape)}")
    require(rows.dtype == weight.dtype, f"x is {rows.dtype} but weight is {weight.dtype}")
    if bias is not None:
        require(bias.shape == (n,) and bias.stride(0) == 1, f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
        check_same_device(x=x, weight=weight, bias=bias)
    else:
        check_same_device(x=x, weight=weight)
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    if m and n:
        cfg = config or invariant_config(n, k, rows.dtype)
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        grid = min(tiles, programs or sm_count(rows.device))
        _invariant_gemm_kernel[(grid,)](
            rows, weight, weight if bias is None else bias, out, m, n, k, rows.stride(0), rows.stride(1),
            weight.stride(0), weight.stride(1), out.stride(0), out.stride(1), grid,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            HAS_BIAS=bias is not None, OPERAND=_operand(rows),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out.view(*x.shape[:-1], n)
