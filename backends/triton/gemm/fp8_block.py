"""Block-scaled FP8 weight GEMM (W8A16): out = x @ dequantized(W).T (+ bias), DeepSeek V3's layout.

Contract ("fp8_block_w8a16" in `corectl.quantization.fp8_block`, reference
`fp8_block_linear_reference` there): x [M, K] fp32/fp16/bf16, weight [N, K] e4m3 row-major,
scale [ceil(N / bn), ceil(K / bk)] fp32 (one per [bn, bk] block, the last ones possibly partial),
bias [N] or None; out [M, N] in x's dtype.

Each program computes a [BLOCK_M, BLOCK_N] tile of the output over all of K, in BLOCK_K steps
that divide bk, so every step sits inside one column of scale blocks. A step widens the e4m3 tile
to x's dtype (exact: e4m3 values are representable in fp16, bf16 and fp32; fp32 operands in the
interpreter, which has no 16-bit arithmetic), multiplies it on the tensor cores with fp32 sums, and scales those sums by each output column's block scale
(`scale[n // bn, k0 // bk]`) before adding them to the fp32 accumulator: the weight is never
rounded, and the scales cost one multiply per output per step. Activations are not quantized.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.paged_softmax import dot_dtype
from ..checks import check_float, check_same_device, require
from .tiles import load_rows

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
_DOT_M = 16  # the smallest tl.dot tile


@triton.jit
def _fp8_block_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_w, stride_s, stride_om,
                      BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    scale_rows = s_ptr + (offs_n // BN).to(tl.int64) * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = load_rows(x_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm).to(DOT_DTYPE)
        w = load_rows(w_ptr, offs_n, mask_n, offs_k, mask_k, stride_w).to(DOT_DTYPE)
        scale = tl.load(scale_rows + k0 // BK, mask=mask_n, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee") * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _block_k(bk: int) -> int:
    """The largest K step (at most 128, at least the 16 tl.dot needs) dividing bk."""
    step = 128
    while step >= _DOT_M and bk % step:
        step //= 2
    require(step >= _DOT_M, f"block columns {bk} must be a multiple of {_DOT_M}")
    return step


def fp8_block_w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    block: tuple[int, int]) -> torch.Tensor:
    """x @ (weight with its block scales).T + bias, [M, N] in x's dtype (module doc)."""
    check_float("x", x, 2)
    check_float("scale", scale, 2)
    require(weight.dtype == FP8_WEIGHT_DTYPE and weight.dim() == 2, f"weight must be 2-D e4m3, got {weight.dtype}")
    check_same_device(x=x, weight=weight, scale=scale)
    (m, k), n = x.shape, weight.shape[0]
    bn, bk = block
    require(weight.shape[1] == k and weight.stride(1) == 1, f"x has {k} features, weight {tuple(weight.shape)}")
    require(tuple(scale.shape) == (-(-n // bn), -(-k // bk)) and scale.stride(1) == 1,
            f"scale must be [{-(-n // bn)}, {-(-k // bk)}] for {bn} x {bk} blocks, got {tuple(scale.shape)}")
    require(bias is None or tuple(bias.shape) == (n,), f"bias must be [{n}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m = _DOT_M if m <= _DOT_M else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_kernel[grid](x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0),
                            weight.stride(0), scale.stride(0), out.stride(0), BN=bn, BK=bk, BLOCK_M=block_m,
                            BLOCK_N=block_n, BLOCK_K=_block_k(bk), HAS_BIAS=bias is not None,
                            DOT_DTYPE=dot_dtype(x.dtype, x.device), num_warps=4)
    return out
