"""FP8-weight GEMM for decode-sized batches (W8A16): out = x @ (W * w_scale[:, None]).T (+ bias).

Contract ("fp8_w8a16_gemv" in `corectl.quantization.fp8`): x [M, K] fp32/fp16/bf16 with
M <= MAX_M, weight [N, K] e4m3 row-major, w_scale [N] fp32 (one per output row), bias [N] or
None; out [M, N] in x's dtype. At decode the layer is bound by reading W (N*K bytes) once, so
the kernel streams W rows along K (contiguous: 16-byte loads, evict-first so x stays in L2) and
does no activation quantization: e4m3 values are exact in bf16/fp16/fp32, so the weight is
converted in registers and the products are exact; sums are fp32, the row scale is applied last.

Grid: cdiv(N, BLOCK_N) output slices x SPLIT_K slices of K. BLOCK_M = 1 (M = 1) multiplies in
fp32 on the CUDA cores and reduces once at the end (a GEMV); BLOCK_M = 16 (any M) runs one
16-row tensor-core tile (tl.dot needs >= 16 rows), computed as W @ x.T so W, whose K is contiguous, is the A operand;
its operands are x's dtype (fp32 in the interpreter, which has no 16-bit arithmetic).
Rows fit one 16-row tile, so W is read exactly once; MAX_M = 8 because the H100 sweep found this
kernel faster than W8A8 (`torch._scaled_mm` with the row quantizer) on every llama3-8b layer up to
M = 8, and the gate_up layer (28672x4096) at par at M = 16 (0.98x), where W's reuse across rows
starts to favour the FP8 tensor-core GEMM.

Gated (`gated=True`): x is a packed gate_up activation [M, 2K] and the GEMV multiplies
silu(gate) * up, formed as each program loads its K slice, rounded like the `silu_and_mul` kernel
(`activation.silu_mul`) and then read as that kernel's stored output would be: bit-identical to
the GEMV of `silu_and_mul(x)` with the same config, one launch (and one [M, K] store) fewer per MLP.

Split-K partials are reduced deterministically: the GEMM writes fp32 partials [SPLIT_K, M, N]
and a second launch sums them in split order, scales, adds the bias and casts (no atomics, so the
result does not depend on program order; no memset). SPLIT_K = 1 stores the output directly.
Everything is sized from shapes only: CUDA-graph capturable, no host syncs.

`dense_gemv` runs the same kernel on 16- or 32-bit weights without scales (SCALED off): small
matrices read at decode, such as a mixture-of-experts router ([E, H], 0.5 MB for Qwen3-30B-A3B),
where cuBLAS's smallest GEMM kernel takes about 5 us on an H100 for what is mostly launch latency,
and the dense layers of a decode step where the GEMV is ahead of cuBLAS (cuBLAS reads the small
projections of a batch-1 step well below copy bandwidth), gated too. Launch configs are a rule of
the problem size: `gemv_configs`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.paged_softmax import dot_dtype
from ..checks import check_float, check_same_device, require
from ..elementwise.activation import silu_mul
from ..pdl import grid_dependency, pdl_enabled
from .gemv_configs import DOT_M, MAX_M, GemvConfig, fp8_decode_config, small_n_config

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
_REDUCE_BLOCK = 1024


@triton.jit
def _load_activation(ptrs, mask, K, GATED: tl.constexpr):
    """The GEMV's input at `ptrs` in x's dtype; GATED: silu(gate) * up of the gate at `ptrs` and
    the up K columns further on (what the unfused path's silu_and_mul would have stored there)."""
    if GATED:
        x = silu_mul(tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + K, mask=mask, other=0.0))
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


# M only bounds masks: one compile serves every decode batch size of a BLOCK_M.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
                     stride_xm, stride_wn, stride_om, stride_os,
                     HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    k_start = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: splits never overlap
    k_end = tl.minimum(k_start + k_per_split, K)
    if BLOCK_M == 1:
        # A per-thread [BLOCK_N, BLOCK_K] accumulator: fused multiply-adds only inside the loop,
        # one cross-thread reduction at the end.
        acc_nk = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = _load_activation(x_ptr + offs_k, mask_k, K, GATED).to(tl.float32)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc_nk += w.to(tl.float32) * x[None, :]
        acc = tl.sum(acc_nk, axis=1)[:, None]
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xt = _load_activation(x_rows + offs_k[:, None], mask_k[:, None] & mask_m[None, :], K, GATED)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            # e4m3 -> x's dtype is exact; fp32 x stays fp32 ("ieee": no TF32 rounding).
            acc += tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), input_precision="ieee")
    mask = mask_n[:, None] & mask_m[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT_K == 1:
        if SCALED:
            acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs + pid_k * stride_os, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, N, total,
                          HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    """out (contiguous [M, N]) = sum over splits in order (deterministic) * scale + bias."""
    grid_dependency(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    n = offs % N
    if SCALED:
        acc *= tl.load(scale_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> None:
    """What both launchers need of a float x and a 2-D weight: a decode-sized x whose features
    (gated: twice them) are the weight's inputs, and weight rows contiguous and apart."""
    m, width = x.shape
    k = weight.shape[1]
    require(m <= MAX_M, f"x may have at most {MAX_M} rows (decode batches; larger ones take a GEMM), got {m}")
    if gated:
        require(width == 2 * k, f"gated x must be [M, 2K] (gate | up) with K = {k} (weight {tuple(weight.shape)}'s "
                f"inputs), got x {tuple(x.shape)}")
    else:
        require(k == width, f"weight must be [N, K] with K = {width} (x's features), got {tuple(weight.shape)}")
    require(weight.numel() == 0 or (weight.stride(1) == 1 and weight.stride(0) >= k),
            f"weight rows must be contiguous and not overlap, got strides {weight.stride()}")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                  gated: bool) -> None:
    check_float("x", x, 2)
    require(isinstance(weight, torch.Tensor) and weight.dtype == FP8_WEIGHT_DTYPE and weight.dim() == 2,
            f"weight must be a 2-D {FP8_WEIGHT_DTYPE} tensor [N, K], got "
            f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    _check_rows(x, weight, gated)
    n = weight.shape[0]
    require(isinstance(w_scale, torch.Tensor) and w_scale.dtype == torch.float32 and w_scale.dim() == 1
            and w_scale.shape[0] == n and w_scale.stride(0) == 1,
            f"w_scale must be a contiguous float32 [{n}] (one scale per output row), got "
            f"{getattr(w_scale, 'dtype', type(w_scale).__name__)} {tuple(getattr(w_scale, 'shape', ()))}")
    _check_bias_and_device(bias, n, x=x, weight=weight, w_scale=w_scale)


def _check_bias_and_device(bias: torch.Tensor | None, n: int, **tensors: torch.Tensor) -> None:
    """A bias, where given, is a float [N]; it and the other tensors share one device."""
    if bias is not None:
        check_float("bias", bias, 1)
        require(bias.shape[0] == n, f"bias must be [{n}], got {tuple(bias.shape)}")
        tensors["bias"] = bias
    check_same_device(**tensors)


def fp8_w8a16_gemv(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   config: GemvConfig | None = None, gated: bool = False) -> torch.Tensor:
    """x @ (weight * w_scale[:, None]).T + bias for M <= MAX_M rows; [M, N] in x's dtype.
    `config` overrides the rule's (the benchmark's sweep). `gated`: x is [M, 2K] (gate | up) and
    silu(gate) * up takes its place (module doc)."""
    _check_inputs(x, weight, w_scale, bias, gated)
    m = x.shape[0]
    n, k = weight.shape
    cfg = config or fp8_decode_config(m, n, k, x.device)
    require(cfg.block_m in (1, DOT_M) and m <= cfg.block_m,
            f"block_m must be 1 (M = 1) or {DOT_M}, and at least M = {m}; got {cfg}")
    require(cfg.block_m == 1 or cfg.block_n >= DOT_M,
            f"block_n must be >= {DOT_M} with block_m {DOT_M} (tl.dot), got {cfg}")
    return _run(x, weight, w_scale, bias, cfg, gated)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: GemvConfig | None = None, gated: bool = False) -> torch.Tensor:
    """x @ weight.T + bias for M <= MAX_M rows of a 16- or 32-bit weight [N, K] of x's dtype: the
    FP8 GEMV's kernel without scales (module doc); [M, N] in x's dtype. `gated`: x is [M, 2K]
    (gate | up) and silu(gate) * up takes its place."""
    check_float("x", x, 2)
    check_float("weight", weight, 2)
    require(weight.dtype == x.dtype, f"weight and x must share a dtype, got {weight.dtype} and {x.dtype}")
    _check_rows(x, weight, gated)
    n, k = weight.shape
    _check_bias_and_device(bias, n, x=x, weight=weight)
    return _run(x, weight, None, bias, config or small_n_config(max(x.shape[0], 1), n, k, x.device), gated)


def _run(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None, bias: torch.Tensor | None,
         cfg: GemvConfig, gated: bool) -> torch.Tensor:
    """The [M, N] output: empty products answered without a launch (K = 0 gives the bias), the rest
    launched."""
    m = x.shape[0]
    n, k = weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    return _launch(x, weight, w_scale, bias, out, cfg, gated)


def _launch(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None, bias: torch.Tensor | None,
            out: torch.Tensor, cfg: GemvConfig, gated: bool) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    # Whole BLOCK_K steps per split; a split left without K (tiny K) just writes zeros.
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    part = out if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    has_bias, scaled = bias is not None, w_scale is not None
    # Pointers a variant compiles out are given the weight's (never read).
    w_scale = w_scale if scaled else weight
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    pdl = pdl_enabled(x.device)
    _fp8_gemv_kernel[grid](x, weight, w_scale, bias if has_bias else w_scale, part, m, n, k, k_per_split,
                           x.stride(0), weight.stride(0), part.stride(-2), part.stride(0) if cfg.split_k > 1 else 0,
                           HAS_BIAS=has_bias, SCALED=scaled, SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m,
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
                           DOT_DTYPE=dot_dtype(x.dtype, x.device), GATED=gated, PDL=pdl, num_warps=cfg.num_warps,
                           launch_pdl=pdl)
    if cfg.split_k > 1:
        total = m * n
        _splitk_reduce_kernel[(triton.cdiv(total, _REDUCE_BLOCK),)](
            part, w_scale, bias if has_bias else w_scale, out, n, total,
            HAS_BIAS=has_bias, SCALED=scaled, SPLIT_K=cfg.split_k, BLOCK=_REDUCE_BLOCK, PDL=pdl, num_warps=4,
            launch_pdl=pdl)
    return out

