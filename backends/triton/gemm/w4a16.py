"""4-bit weight-only GEMM (AWQ/GPTQ/GGUF after loading): the weight is dequantized inside the GEMM.

Contract ("w4a16" in `corectl.quantization.int4`, reference `w4a16_reference`): x [M, K] (fp32,
fp16 or bf16), qweight [K/8, N] int32 with input k in nibble k % 8 of row k // 8 (or the same
words as column tiles [ceil(N / T), K/8, T], `int4.tile_words`: a column slice of a tile is one
contiguous stream, where plain rows give the GEMV a 64-byte piece every N * 4 bytes), per-group
scales [groups, N] and zeros [groups, N], and g_idx [K] naming each input's group (a
permutation under GPTQ act-order). Zeros are either int32 zero codes z, w = (q - z) s (AWQ,
GPTQ), or float offsets b, w = q s + b (GGUF's 4-bit blocks, whose offsets are no multiple of
their scale); their dtype picks the variant at compile time (OFFSETS), so each compiles alone and
the zero-code kernels are unchanged. `group_size` > 0 declares g_idx == arange(K) // group_size
(AWQ, GPTQ without act-order, GGUF; int4.py detects it once at load): each block of BLOCK_K
inputs then lies in one group, whose scale and zero row is loaded once per block, or (GEMV) spans
whole groups, each word row taking its group's row, and the group factors out of the sum,
sum_k (q - z) s x = s (sum_k q x - z sum_k x) (offsets: s sum_k q x + b sum_k x), so the inner
loop multiplies raw codes. Wide GEMV blocks keep more bytes in flight per program than one
group's 16 word rows, which a narrow column slice (small N, no split-K) needs.
Otherwise (act-order) each input's scale and zero are gathered through g_idx.

Programs cover [BLOCK_M, BLOCK_N] outputs over one of SPLIT_K slices of K. Two inner forms:
  - GEMV (BLOCK_M = 1, decode): broadcast multiply-adds in fp32 into a [BLOCK_K/8, BLOCK_N]
    accumulator, summed over K once at the end; no tensor cores, no padded rows.
  - tl.dot: codes (or, act-order, dequantized weights) in x's dtype on the tensor cores; fp32 x
    uses IEEE fp32 dots, matching torch's default fp32 matmul rather than TF32.
Split-K partials go to an fp32 [SPLIT_K, M, N] buffer summed in a second pass (`split_k`).
Configurations come from `w4a16_configs` (a table the benchmark fills, a heuristic otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_float, check_index, check_range, check_same_device, require
from ..pdl import grid_dependency, pdl_enabled
from .split_k import split_k_program, sum_splits
from .tiles import load_rows
from .w4a16_configs import W4Config, choose

ONE_BITS = 0x3F800000  # 1.0 as fp32 bits (`_code_dot`)


@triton.jit
def _nibble(words, J: tl.constexpr):
    """Code J of each word as an exact fp32: its 4 bits become the low mantissa of 2**23 + q, one
    bitwise op and an add instead of an int-to-float conversion (a quarter-rate instruction)."""
    bits = ((words >> (4 * J)) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _codes_f32(codes):
    """Codes 0..15 (int32) as exact fp32, through the mantissa as in `_nibble`: faster than int ->
    float, and Triton's interpreter converts int32 to bf16 wrongly."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _input_pair(x_ptr, rows, row_mask, I: tl.constexpr, X_PACKED: tl.constexpr):
    """Inputs 2I and 2I + 1 of each word row as fp32 [R]. X_PACKED (16-bit x, rows 4-byte aligned):
    one 32-bit load per pair instead of two 16-bit ones; the load/store unit issues a quarter as
    many instructions a cycle as the ALUs, and these loads repeat for every column slice."""
    if X_PACKED:
        pair = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + rows * 4 + I, mask=row_mask, other=0)
        first = pair.to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        second = (pair >> 16).to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    else:
        first = tl.load(x_ptr + rows * 8 + 2 * I, mask=row_mask, other=0.0).to(tl.float32)
        second = tl.load(x_ptr + rows * 8 + 2 * I + 1, mask=row_mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _biased_codes(codes, DTYPE: tl.constexpr):
    """Codes 0..15 (int32) as DTYPE values b + q, and b: for 16-bit DTYPE one bitwise op gives the
    code the low mantissa bits of 128 (bf16) or 1024 (fp16), instead of a conversion through fp32."""
    if DTYPE == tl.bfloat16:
        return (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True), 128.0
    if DTYPE == tl.float16:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True), 1024.0
    return _codes_f32(codes).to(DTYPE), 0.0


@triton.jit
def _code_dot(words, x_ptr, rows, row_mask, one_bits, X_PACKED: tl.constexpr):
    """Per word row: sum_j q_j x_j over its 8 codes [R, N], and sum_j x_j [R].

    Each code is read in place as mantissa bits: shifted so that a pair of codes lands at bits
    15..18 and 19..22, masked and given the exponent of 256 (first code) or 16 (second), the code q
    reads as f = 256 + q or 16 + q. So sum_j f_j x_j = sum_j q_j x_j + 256 sum x_even + 16 sum x_odd,
    and the row sums take the excess off once: a shift per two codes, then a mask-and-or and a
    multiply-add per code. An int-to-float conversion per code costs a quarter-rate instruction;
    this inner loop is the GEMV's ALU bound. Exact for bf16/fp16 x (f x needs at most 20 bits);
    the subtraction cancels at most 8 terms of 256 |x|, a relative error near 2**-13 of one word
    row's sum of |x|. `one_bits` is 1.0's bit pattern passed at run time: with the exponents in
    registers, ptxas makes each mask-and-or one LOP3 (two immediates would take two)."""
    bits_256 = one_bits + (8 << 23)
    bits_16 = one_bits + (4 << 23)
    raw = tl.zeros(words.shape, dtype=tl.float32)
    even = tl.zeros(rows.shape, dtype=tl.float32)
    odd = tl.zeros(rows.shape, dtype=tl.float32)
    for i in tl.static_range(4):
        # codes 2i and 2i + 1 (bits 8i..8i+7) move to bits 15..22
        if i < 2:
            pair = words << (15 - 8 * i)
        else:
            pair = words >> (8 * i - 15)
        x_first, x_second = _input_pair(x_ptr, rows, row_mask, i, X_PACKED)
        raw += ((pair & 0x78000) | bits_256).to(tl.float32, bitcast=True) * x_first[:, None]
        raw += ((pair & 0x780000) | bits_16).to(tl.float32, bitcast=True) * x_second[:, None]
        even += x_first
        odd += x_second
    return raw - (even * 256.0 + odd * 16.0)[:, None], even + odd


@triton.jit
def _group_sum(acc, qx, xs, s, z, OFFSETS: tl.constexpr):
    """acc plus the groups' share of the output from sum_k q x [R, N] and sum_k x [R]: s (qx - z xs)
    with zero codes, s qx + b xs with float offsets (s, z fp32, [1, N] for one group or [R, N] a row
    each); written as two multiply-adds into acc."""
    if OFFSETS:
        return acc + qx * s + xs[:, None] * z
    return acc + (qx - xs[:, None] * z) * s


@triton.jit
def _load_words(qw_ptr, rows, row_end, offs_n, mask_n, stride_qk, stride_qt, TILE: tl.constexpr):
    """Word rows `rows` of columns offs_n: plain [K/8, N] words (TILE 0, row stride stride_qk) or
    column tiles [N/TILE, K/8, TILE] (tile stride stride_qt, row stride TILE)."""
    mask = (rows < row_end)[:, None] & mask_n[None, :]
    if TILE:
        cols = (offs_n // TILE).to(tl.int64) * stride_qt + offs_n % TILE
        return tl.load(qw_ptr + rows[:, None].to(tl.int64) * TILE + cols[None, :], mask=mask, other=0)
    return tl.load(qw_ptr + rows[:, None].to(tl.int64) * stride_qk + offs_n[None, :], mask=mask, other=0)


@triton.jit
def _gemv_block(acc, x_ptr, s_ptr, z_ptr, g_ptr, words, rows, row_end, offs_n, mask_n, k0, one_bits,
                stride_sg, stride_zg, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr, OFFSETS: tl.constexpr,
                X_PACKED: tl.constexpr):
    """acc plus the block's w * x, summed over each word row's inputs ([BLOCK_K/8, BLOCK_N])."""
    row_mask = rows < row_end
    if GROUP_SIZE > 0:
        qx, xs = _code_dot(words, x_ptr, rows, row_mask, one_bits, X_PACKED)
        if BLOCK_K <= GROUP_SIZE:
            group = k0 // GROUP_SIZE
            s = tl.load(s_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + group * stride_zg + offs_n, mask=mask_n, other=0).to(tl.float32)[None, :]
        else:
            # The block spans several groups: each word row takes its group's scales (rows of one
            # group load the same row of scales, from L1).
            group = (rows * 8 // GROUP_SIZE).to(tl.int64)
            mask = row_mask[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group[:, None] * stride_zg + offs_n[None, :], mask=mask, other=0).to(tl.float32)
        return _group_sum(acc, qx, xs, s, z, OFFSETS)
    for j in tl.static_range(8):
        xj = tl.load(x_ptr + rows * 8 + j, mask=row_mask, other=0.0).to(tl.float32)
        group = tl.load(g_ptr + rows * 8 + j, mask=row_mask, other=0)
        mask = row_mask[:, None] & mask_n[None, :]
        s = tl.load(s_ptr + group[:, None].to(tl.int64) * stride_sg + offs_n[None, :], mask=mask, other=0.0)
        z = tl.load(z_ptr + group[:, None].to(tl.int64) * stride_zg + offs_n[None, :], mask=mask, other=0)
        if OFFSETS:
            acc += (_nibble(words, j) * s.to(tl.float32) + z.to(tl.float32)) * xj[:, None]
        else:
            acc += (_nibble(words, j) - z.to(tl.float32)) * s.to(tl.float32) * xj[:, None]
    return acc


@triton.jit
def _gemv(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, offs_n, mask_n, k_start, k_end, stride_qk, stride_qt, stride_sg,
          stride_zg, one_bits, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
          OFFSETS: tl.constexpr, X_PACKED: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    rows = k_start // 8 + tl.arange(0, BLOCK_K // 8)
    row_end = k_end // 8
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    # Weights are never written by the step's kernels: the first block is requested before waiting
    # for the previous kernel, so its latency overlaps that kernel's tail.
    words = _load_words(qw_ptr, rows, row_end, offs_n, mask_n, stride_qk, stride_qt, TILE)
    grid_dependency(PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        # The next block's words are requested before this block's arithmetic: their latency hides
        # behind it (register double buffering; the pipeliner only stages loads that feed tl.dot).
        upcoming = _load_words(qw_ptr, rows + BLOCK_K // 8, row_end, offs_n, mask_n, stride_qk, stride_qt, TILE)
        acc = _gemv_block(acc, x_ptr, s_ptr, z_ptr, g_ptr, words, rows, row_end, offs_n, mask_n, k0, one_bits,
                          stride_sg, stride_zg, BLOCK_K, GROUP_SIZE, OFFSETS, X_PACKED)
        words = upcoming
        rows += BLOCK_K // 8
    return tl.sum(acc, axis=0)


@triton.jit
def _dot_tile(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, offs_m, mask_m, offs_n, mask_n, k_start, k_end,
              stride_xm, stride_qk, stride_qt, stride_sg, stride_zg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr, OFFSETS: tl.constexpr, PRECISION: tl.constexpr,
              TILE: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = load_rows(x_ptr, offs_m, mask_m, offs_k, mask_k, stride_xm)
        words = _load_words(qw_ptr, k0 // 8 + tl.arange(0, BLOCK_K // 8), k_end // 8, offs_n, mask_n, stride_qk,
                            stride_qt, TILE)
        # Each word is read once and unpacked into its eight inputs: [BLOCK_K/8, 8, N] -> [BLOCK_K, N].
        codes = tl.reshape((words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        if GROUP_SIZE > 0:
            group = k0 // GROUP_SIZE
            s = tl.load(s_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group * stride_zg + offs_n, mask=mask_n, other=0).to(tl.float32)
            # Biased codes b + q are exact in x's dtype: the dot is exact-input, the group applies after.
            codes, bias = _biased_codes(codes, x.dtype)
            xs = tl.sum(x.to(tl.float32), axis=1)
            qx = tl.dot(x, codes, input_precision=PRECISION, out_dtype=tl.float32) - bias * xs[:, None]
            acc = _group_sum(acc, qx, xs, s[None, :], z[None, :], OFFSETS)
        else:
            group = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
            mask_w = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + group[:, None].to(tl.int64) * stride_sg + offs_n[None, :], mask=mask_w, other=0.0)
            z = tl.load(z_ptr + group[:, None].to(tl.int64) * stride_zg + offs_n[None, :], mask=mask_w, other=0)
            if OFFSETS:
                w = (_codes_f32(codes) * s.to(tl.float32) + z.to(tl.float32)).to(x.dtype)
            else:
                w = ((codes - z).to(tl.float32) * s.to(tl.float32)).to(x.dtype)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, K_SPLIT, one_bits,
                  stride_xm, stride_qk, stride_qt, stride_sg, stride_zg, stride_os, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, OFFSETS: tl.constexpr, GEMV: tl.constexpr, PRECISION: tl.constexpr,
                  X_PACKED: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    # M tiles vary fastest: a prefill's row tiles read each weight tile together, once from HBM.
    pid_m, pid_k, offs_n, mask_n, k_start, k_end = split_k_program(N, K, K_SPLIT, BLOCK_N)
    out_ptr += pid_k.to(tl.int64) * stride_os
    if GEMV:
        acc = _gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, qw_ptr, s_ptr, z_ptr, g_ptr, offs_n, mask_n,
                    k_start, k_end, stride_qk, stride_qt, stride_sg, stride_zg, one_bits, BLOCK_N, BLOCK_K, GROUP_SIZE,
                    OFFSETS, X_PACKED, TILE, PDL)
        tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        grid_dependency(PDL)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        acc = _dot_tile(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, offs_m, mask_m, offs_n, mask_n, k_start, k_end,
                        stride_xm, stride_qk, stride_qt, stride_sg, stride_zg, BLOCK_M, BLOCK_N, BLOCK_K,
                        GROUP_SIZE, OFFSETS, PRECISION, TILE)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _layout(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    """(N, word row stride, tile stride, TILE) of plain [K/8, N] words (TILE 0) or of column tiles
    [ceil(N / TILE), K/8, TILE] (N from the scales)."""
    if qweight.dim() == 3:
        return scales.shape[1], qweight.shape[2], qweight.stride(0), qweight.shape[2]
    return qweight.shape[1], qweight.stride(0), 0, 0


def _check_words(qweight: torch.Tensor, k: int, n: int) -> None:
    check_index("qweight", qweight, qweight.dim() if qweight.dim() in (2, 3) else 2, (torch.int32,))
    if qweight.dim() == 2:
        require(k % 8 == 0 and qweight.shape[0] * 8 == k,
                f"qweight must be [K/8, N] = [{k // 8}, N], got {tuple(qweight.shape)}")
        require(qweight.stride(0) >= n, f"qweight rows must not overlap, got strides {qweight.stride()}")
        return
    tile = qweight.shape[2]
    require(k % 8 == 0 and tile > 0 and tuple(qweight.shape[:2]) == (-(-n // tile), k // 8),
            f"qweight tiles must be [ceil(N / T), K/8, T] = [ceil({n} / T), {k // 8}, T], got {tuple(qweight.shape)}")
    require(qweight.stride(1) == tile and qweight.stride(0) >= k // 8 * tile,
            f"qweight tiles must be contiguous, got strides {qweight.stride()}")


def _check(x, qweight, scales, zeros, g_idx, group_size: int, check_indices: bool) -> None:
    check_float("x", x, 2)
    check_float("scales", scales, 2)
    if zeros.is_floating_point():
        check_float("zeros", zeros, 2)
    else:
        check_index("zeros", zeros, 2, (torch.int32,))
    check_index("g_idx", g_idx, 1, (torch.int32,))
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx)
    m, k = x.shape
    n = _layout(qweight, scales)[0]
    _check_words(qweight, k, n)
    require(scales.shape[1] == n and tuple(zeros.shape) == tuple(scales.shape),
            f"scales and zeros must both be [groups, {n}], got {tuple(scales.shape)} and {tuple(zeros.shape)}")
    require(g_idx.shape[0] == k, f"g_idx must have one group per input ({k}), got {g_idx.shape[0]}")
    if group_size:
        require(group_size > 0 and group_size % 8 == 0 and k % group_size == 0 and scales.shape[0] == k // group_size,
                f"group_size {group_size} must be a positive multiple of 8 dividing K = {k} into the "
                f"{scales.shape[0]} groups of scales")
    if check_indices:
        check_range("g_idx", g_idx, 0, scales.shape[0])
        if group_size:
            runs = torch.arange(k, dtype=torch.int32, device=g_idx.device) // group_size
            require(bool(torch.equal(g_idx, runs)), f"group_size {group_size} needs g_idx == arange(K) // {group_size}")


def _packed_inputs(x: torch.Tensor) -> bool:
    """Whether the GEMV may read x's 16-bit inputs in 32-bit pairs: every row 4-byte aligned (rows
    are contiguous: `_check`)."""
    return x.element_size() == 2 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0


def _block_k(cfg: W4Config, group_size: int) -> tuple[int, int]:
    """(BLOCK_K, GROUP_SIZE) to launch: with contiguous groups a dot block must lie in one group, so
    BLOCK_K shrinks to a power of two dividing the group (a GEMV block may also span whole groups);
    too small a block takes the gather path."""
    if not group_size:
        return cfg.block_k, 0
    if cfg.gemv and cfg.block_k % group_size == 0:
        return cfg.block_k, group_size
    block_k = cfg.block_k
    while group_size % block_k:
        block_k //= 2
    return (block_k, group_size) if block_k >= (8 if cfg.gemv else 16) else (cfg.block_k, 0)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, group_size: int = 0, check_indices: bool = True,
               config: W4Config | None = None) -> torch.Tensor:
    """x @ W.T for the 4-bit W described in the module docstring; [M, N] in x's dtype. `config`
    overrides the table (the benchmark's sweep)."""
    _check(x, qweight, scales, zeros, g_idx, group_size, check_indices)
    m, k = x.shape
    n, stride_qk, stride_qt, tile = _layout(qweight, scales)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or choose(m, n, k, x.device, gathered=not group_size)
    block_k, group = _block_k(cfg, group_size)
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, min(cfg.split_k, steps))
    splits = triton.cdiv(steps, per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    pdl = pdl_enabled(x.device)
    _w4a16_kernel[grid](x, qweight, scales, zeros, g_idx, target, m, n, k, per_split * block_k, ONE_BITS, x.stride(0),
                        stride_qk, stride_qt, scales.stride(0), zeros.stride(0), m * n, n,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_SIZE=group,
                        OFFSETS=zeros.is_floating_point(), GEMV=cfg.gemv, X_PACKED=_packed_inputs(x), TILE=tile,
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    if splits > 1:
        sum_splits(target, out, pdl)
    return out


def w4a16_gemm_trusted(x, qweight, scales, zeros, g_idx, group_size: int = 0) -> torch.Tensor:
    """The model's path: g_idx (and its contiguity for group_size) was checked once at load; a
    read-back per call would sync."""
    return w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size, check_indices=False)
