"""4-bit weight-only GEMM (AWQ/GPTQ after loading): the weight is dequantized inside the GEMM.

Contract ("w4a16" in `corectl.quantization.int4`, reference `w4a16_reference`): x [M, K] (fp32,
fp16 or bf16), qweight [K/8, N] int32 with input k in nibble k % 8 of row k // 8, per-group
scales [groups, N] and zero codes [groups, N], and g_idx [K] naming each input's group (a
permutation under GPTQ act-order). Each program computes a [BLOCK_M, BLOCK_N] tile, walking K in
BLOCK_K steps: it loads each packed word once and unpacks its 8 inputs, applies (q - z) * s of
each input's group, rounds the tile to x's dtype (bf16 then runs on tensor cores) and accumulates
in fp32. Decode (M = 1) reads 4 bits per weight instead of 16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_float, check_index, check_range, check_same_device, require


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K,
                  stride_xm, stride_qk, stride_sg, stride_zg, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        # Each int32 word is read once and unpacked into its eight inputs: [BLOCK_K/8, 8, N] -> [BLOCK_K, N].
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(qw_ptr + offs_w[:, None].to(tl.int64) * stride_qk + offs_n[None, :],
                        mask=(offs_w < K // 8)[:, None] & mask_n[None, :], other=0)
        codes = tl.reshape((words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
        scale = tl.load(s_ptr + group[:, None].to(tl.int64) * stride_sg + offs_n[None, :], mask=mask_w, other=0.0)
        zero = tl.load(z_ptr + group[:, None].to(tl.int64) * stride_zg + offs_n[None, :], mask=mask_w, other=0)
        # Dequantized in fp32, rounded to x's dtype: bf16/fp16 inputs take the tensor cores.
        w = ((codes - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], out,
             mask=mask_m[:, None] & mask_n[None, :])


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, check_indices: bool = True) -> torch.Tensor:
    """x @ W.T for the 4-bit W described in the module docstring; [M, N] in x's dtype."""
    check_float("x", x, 2)
    check_index("qweight", qweight, 2, (torch.int32,))
    check_float("scales", scales, 2)
    check_index("zeros", zeros, 2, (torch.int32,))
    check_index("g_idx", g_idx, 1, (torch.int32,))
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx)
    m, k = x.shape
    n = qweight.shape[1]
    require(k % 8 == 0 and qweight.shape[0] * 8 == k, f"qweight must be [K/8, N] = [{k // 8}, N], got {tuple(qweight.shape)}")
    require(scales.shape[1] == n and tuple(zeros.shape) == tuple(scales.shape),
            f"scales and zeros must both be [groups, {n}], got {tuple(scales.shape)} and {tuple(zeros.shape)}")
    require(g_idx.shape[0] == k, f"g_idx must have one group per input ({k}), got {g_idx.shape[0]}")
    require(qweight.stride(0) >= n, f"qweight rows must not overlap, got strides {qweight.stride()}")
    if check_indices:
        check_range("g_idx", g_idx, 0, scales.shape[0])
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    # Decode-sized M: narrow N tiles so a 4096-wide layer still spreads over every SM.
    block_m = 16 if m <= 16 else 64
    block_n, block_k = (32, 128) if m <= 16 else (128, 32)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](x, qweight, scales, zeros, g_idx, out, m, n, k, x.stride(0), qweight.stride(0),
                        scales.stride(0), zeros.stride(0), out.stride(0),
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def w4a16_gemm_trusted(x, qweight, scales, zeros, g_idx) -> torch.Tensor:
    """The model's path: g_idx was range-checked once at load (a read-back per call would sync)."""
    return w4a16_gemm(x, qweight, scales, zeros, g_idx, check_indices=False)
