"""Split-K GEMMs: a program's place in the grid, and the second pass, fp32 partials [SPLIT_K, M, N]
summed into [M, N] in a fixed order. Deterministic (atomics would make each step's logits depend
on scheduling), no zero-filled buffer or extra cast launch, capturable in CUDA graphs (shape-only
allocations, no syncs)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import grid_dependency

REDUCE_BLOCK = 1024


@triton.jit
def split_k_program(N, K, K_SPLIT, BLOCK_N: tl.constexpr):
    """A program's place in a split-K GEMM grid (M tiles, N tiles, K slices): its row tile, its
    slice, its output columns and their mask, and the slice's inputs [k_start, k_end)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * K_SPLIT
    return pid_m, pid_k, offs_n, offs_n < N, k_start, tl.minimum(K, k_start + K_SPLIT)


@triton.jit
def _sum_splits(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    """out (contiguous [M, N]) = partials ([SPLIT_K, M, N] fp32) summed over the splits in order."""
    numel = out.numel()
    _sum_splits[(triton.cdiv(numel, REDUCE_BLOCK),)](partials, out, numel, SPLIT_K=partials.shape[0],
                                                     BLOCK=REDUCE_BLOCK, PDL=pdl, launch_pdl=pdl)
