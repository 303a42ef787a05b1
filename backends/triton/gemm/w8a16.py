"""8-bit grouped weight-only GEMM (GGUF's Q8_0, Q6_K and Q5 blocks after loading): the weight is
dequantized inside the GEMM.

Contract ("w8a16" in `corectl.quantization.gguf`, reference `w8a16_reference` there): x [M, K]
(fp32, fp16 or bf16), codes int8 [N, K], and per group of G inputs a scale and an offset, scales
and offsets [N, K/G] (float; offsets may be None), w[n, k] = codes[n, k] * s[n, k // G] + b[n, k // G].
G (16 or 32 in GGUF) divides the blocks, so a group's scale factors out of its sum:
sum_k w x = s sum_k q x + b sum_k x.

Programs cover [BLOCK_M, BLOCK_N] outputs over one of SPLIT_K slices of K. Two inner forms:
  - GEMV (BLOCK_M = 1, decode): per block, products in fp32 summed per group ([BLOCK_N, BLOCK_K/G]),
    scaled, and accumulated; weights are exact, so it is closer to the fp32 product than the
    dequantized model is.
  - tl.dot (M > 1): the block is dequantized to x's dtype (rounded as the dequantized model's own
    weights are) and multiplied on the tensor cores; fp32 x uses IEEE fp32 dots.
Split-K partials are summed in a second pass (`split_k`). The launch configuration is a heuristic
fitted to an H100 sweep (`config`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..checks import check_float, check_index, check_same_device, require
from ..pdl import grid_dependency, pdl_enabled
from .split_k import split_k_program, sum_splits
from .tiles import load_rows
from .w4a16_configs import sm_count

MAX_SPLIT_K = 4


@dataclass(frozen=True)
class W8Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int


def config(m: int, n: int, k: int, group: int, sms: int) -> W8Config:
    """From the H100 sweep of benchmarks/w8a16_bench.py (W8_SWEEP=1, llama3-8b shapes): GEMV at M = 1
    over 16-row slices in 512-input blocks (256 with groups of 16), K split four ways; 32- or
    64-column dot tiles of 128 inputs for decode batches, K split while the grid covers the SMs
    less than three times; 64x64 tiles for prefill. Each split keeps two blocks."""
    if m == 1:
        cfg, waves = W8Config(1, 16, 512 if group >= 32 else 256, 4, 4), 0
    elif m <= 16:
        cfg, waves = W8Config(16, 32 if group >= 32 else 64, 128, 1, 4), 3
    else:
        cfg, waves = W8Config(64, 64, max(64, group), 1, 4), 1
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split = cfg.split_k
    while split * 2 <= MAX_SPLIT_K and tiles * split < waves * sms:
        split *= 2
    while split > 1 and k // split < 2 * cfg.block_k:
        split //= 2
    return W8Config(cfg.block_m, cfg.block_n, cfg.block_k, split, cfg.num_warps)


@triton.jit
def _group_params(s_ptr, b_ptr, offs_n, mask_n, g0, g_end, stride_s, stride_b, GROUPS: tl.constexpr,
                  OFFSETS: tl.constexpr):
    """The scales and offsets of groups g0 .. g0 + GROUPS - 1 (those before g_end) of rows offs_n,
    fp32 [BLOCK_N, GROUPS]."""
    g = g0 + tl.arange(0, GROUPS)
    rows = offs_n[:, None].to(tl.int64)
    mask = mask_n[:, None] & (g[None, :] < g_end)
    s = tl.load(s_ptr + rows * stride_s + g[None, :], mask=mask, other=0.0).to(tl.float32)
    if OFFSETS:
        b = tl.load(b_ptr + rows * stride_b + g[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(s.shape, dtype=tl.float32)
    return s, b


@triton.jit
def _gemv(x_ptr, q_ptr, s_ptr, b_ptr, offs_n, mask_n, k_start, k_end, stride_q, stride_s, stride_b,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, OFFSETS: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        q = load_rows(q_ptr, offs_n, mask_n, offs_k, mask_k, stride_q)
        qx = tl.sum(tl.reshape(q.to(tl.float32) * x[None, :], (BLOCK_N, GROUPS, GROUP)), axis=2)
        s, b = _group_params(s_ptr, b_ptr, offs_n, mask_n, k0 // GROUP, k_end // GROUP, stride_s, stride_b, GROUPS,
                             OFFSETS)
        acc += qx * s
        if OFFSETS:
            acc += tl.sum(tl.reshape(x, (GROUPS, GROUP)), axis=1)[None, :] * b
    return tl.sum(acc, axis=1)


@triton.jit
def _dot_tile(x_ptr, q_ptr, s_ptr, b_ptr, offs_m, mask_m, offs_n, mask_n, k_start, k_end, stride_xm, stride_q,
              stride_s, stride_b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP: tl.constexpr, OFFSETS: tl.constexpr, PRECISION: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = load_rows(x_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm)
        q = load_rows(q_ptr, offs_n, mask_n, offs_k, mask_k, stride_q)
        s, b = _group_params(s_ptr, b_ptr, offs_n, mask_n, k0 // GROUP, k_end // GROUP, stride_s, stride_b, GROUPS,
                             OFFSETS)
        w = tl.reshape(q, (BLOCK_N, GROUPS, GROUP)).to(tl.float32) * s[:, :, None]
        if OFFSETS:
            w += b[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _w8a16_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_q, stride_s, stride_b,
                  stride_os, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP: tl.constexpr, OFFSETS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    pid_m, pid_k, offs_n, mask_n, k_start, k_end = split_k_program(N, K, K_SPLIT, BLOCK_N)
    out_ptr += pid_k.to(tl.int64) * stride_os
    if BLOCK_M == 1:
        acc = _gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, q_ptr, s_ptr, b_ptr, offs_n, mask_n, k_start, k_end,
                    stride_q, stride_s, stride_b, BLOCK_N, BLOCK_K, GROUP, OFFSETS)
        tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        acc = _dot_tile(x_ptr, q_ptr, s_ptr, b_ptr, offs_m, mask_m, offs_n, mask_n, k_start, k_end, stride_xm,
                        stride_q, stride_s, stride_b, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, OFFSETS, PRECISION)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _check(x, codes, scales, offsets, group: int) -> None:
    check_float("x", x, 2)
    check_index("codes", codes, 2, (torch.int8,))
    check_float("scales", scales, 2)
    tensors = {"x": x, "codes": codes, "scales": scales}
    if offsets is not None:
        check_float("offsets", offsets, 2)
        tensors["offsets"] = offsets
    check_same_device(**tensors)
    n, k = codes.shape
    require(x.shape[1] == k, f"x has {x.shape[1]} features, codes {k}")
    require(group >= 16 and group & (group - 1) == 0 and k % group == 0,
            f"group {group} must be a power of two >= 16 dividing K = {k}")
    for name in ("scales", "offsets"):
        shape = tuple(tensors[name].shape) if name in tensors else (n, k // group)
        require(shape == (n, k // group), f"{name} must be [{n}, {k // group}], got {shape}")


def w8a16_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
               group: int, cfg: W8Config | None = None) -> torch.Tensor:
    """x @ W.T for the grouped 8-bit W of the module docstring; [M, N] in x's dtype. `cfg`
    overrides the heuristic (tests, sweeps)."""
    _check(x, codes, scales, offsets, group)
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = cfg or config(m, n, k, group, sm_count(x.device))
    steps = triton.cdiv(k, cfg.block_k)
    per_split = triton.cdiv(steps, min(cfg.split_k, steps))
    splits = triton.cdiv(steps, per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    pdl = pdl_enabled(x.device)
    b = scales if offsets is None else offsets
    _w8a16_kernel[grid](x, codes, scales, b, target, m, n, k, per_split * cfg.block_k, x.stride(0), codes.stride(0),
                        scales.stride(0), b.stride(0), m * n, n, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        BLOCK_K=cfg.block_k, GROUP=group, OFFSETS=offsets is not None,
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl,
                        num_warps=cfg.num_warps, launch_pdl=pdl)
    if splits > 1:
        sum_splits(target, out, pdl)
    return out
