"""Tile loads shared by the GEMM kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rows(ptr, offs_m, mask_m, offs_k, mask_k, stride_m):
    """The [len(offs_m), len(offs_k)] tile of a row-major matrix (rows `stride_m` apart), zero where
    masked."""
    return tl.load(ptr + offs_m[:, None].to(tl.int64) * stride_m + offs_k[None, :],
                   mask=mask_m[:, None] & mask_k[None, :], other=0.0)
