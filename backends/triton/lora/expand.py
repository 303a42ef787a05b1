"""LoRA expand: out += (xa_j @ B[slot][slice j].T) * scale[slot] for every token with an adapter slot.

`out` is a base projection's whole output, made of up to three slices (q, k and v of a packed qkv;
gate and up; or one), `b` the stacked B [S, N, R] in the same row order and `xa` the shrink's
partial sums [P, T, n * R], slice j reading columns [j * R, (j + 1) * R). One launch writes every
slice and sums the shrink's P partials as it loads them. Gathered form (decode, CUDA graphs): one
program per (token, output block); base tokens (slot -1) leave their row untouched. Segment form
(prefill and mixed steps): one program per (segment, row block, output block), `tl.dot` over the
rank. Sorted tiles (decode steps of many tokens): one program per (tile, group of output blocks),
the tile's rows read and written through the sorted order, its partial sums loaded once for the
group. The sum is formed in fp32 and rounded once into `out`'s dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from corectl.lora.punica import LoRASegments

from ..checks import check_float, check_same_device, require
from .checks import check_slots
from .config import SortedConfig, sorted_config, warps_for
from .segments import segment_tile

_GATHER_BLOCK_N = 128
# Elements of one program's B tile: 64 registers a thread at 4 warps.
_TILE_ELEMENTS = 8192
_SEGMENT_BLOCK_M = 16
_SEGMENT_BLOCK_N = 64
MAX_SLICES = 3


@triton.jit
def _slice_of(n, END0, END1):
    """Which slice each output column lies in (slices end at END0, END1 and N)."""
    return (n >= END0).to(tl.int32) + (n >= END1).to(tl.int32)


@triton.jit
def _expand_gathered_kernel(xa_ptr, b_ptr, scales_ptr, slots_ptr, out_ptr, N, R, P, END0, END1, stride_xp, stride_xt,
                            stride_bs, stride_bn, stride_ot, stride_xs, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        which = _slice_of(n, END0, END1)
        delta = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(NUM_SLICES):
            parts = tl.load(xa_ptr + p[:, None] * stride_xp + token * stride_xt + slot * stride_xs + j * R + r[None, :],
                            mask=(p[:, None] < P) & (r[None, :] < R), other=0.0).to(tl.float32)
            xa = tl.sum(parts, axis=0)
            delta = tl.where(which == j, tl.sum(b * xa[None, :], axis=1), delta)
        out = out_ptr + token * stride_ot + n
        y = tl.load(out, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out, (y + delta * tl.load(scales_ptr + slot)).to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _slice_bounds(j: tl.constexpr, N, END0, END1):
    """Slice j's first and past-the-end output columns."""
    if j == 0:
        return 0, END0
    elif j == 1:
        return END0, END1
    else:
        return END1, N


@triton.jit
def _expand_segment_kernel(xa_ptr, b_ptr, scales_ptr, starts_ptr, lens_ptr, seg_slots_ptr, order_ptr, out_ptr, N, R, P,
                           END0, END1, stride_xp, stride_xt, stride_bs, stride_bn, stride_ot, N_PER_PROGRAM,
                           NUM_SLICES: tl.constexpr, ORDERED: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    rows, in_segment, slot, live = segment_tile(starts_ptr, lens_ptr, seg_slots_ptr, order_ptr, BLOCK_M, ORDERED)
    if live:
        r = tl.arange(0, BLOCK_R)
        scale = tl.load(scales_ptr + slot)
        lo = tl.program_id(2) * N_PER_PROGRAM
        hi = tl.minimum(lo + N_PER_PROGRAM, N)
        for j in tl.static_range(NUM_SLICES):
            # This program's columns of slice j: xa's slice is summed over the splits once for all.
            first, end = _slice_bounds(j, N, END0, END1)
            n_lo = tl.maximum(lo, first)
            n_hi = tl.minimum(hi, end)
            if n_lo < n_hi:
                xa = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                for part in range(0, P):
                    xa += tl.load(xa_ptr + part * stride_xp + rows[:, None] * stride_xt + j * R + r[None, :],
                                  mask=in_segment[:, None] & (r[None, :] < R), other=0.0).to(tl.float32)
                for n0 in range(n_lo, n_hi, BLOCK_N):
                    n = n0 + tl.arange(0, BLOCK_N)
                    bt = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                                 mask=(n[None, :] < n_hi) & (r[:, None] < R), other=0.0).to(tl.float32)
                    mask = in_segment[:, None] & (n[None, :] < n_hi)
                    out = out_ptr + rows[:, None] * stride_ot + n[None, :]
                    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
                    tl.store(out, (y + tl.dot(xa, bt) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand(xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, token_slots: torch.Tensor,
                segments: LoRASegments | None, out: torch.Tensor, slice_sizes: Sequence[int] | None = None,
                check_indices: bool = False, config: SortedConfig | None = None) -> None:
    """out [T, N] += (sum_p xa[p] [T, n*R] slice j @ b[slot] [N, R] rows of slice j .T) * scales[slot]
    for rows with a slot >= 0, in place. `slice_sizes` (default: one slice of N) are the n slices'
    widths in `out`'s columns, in order; out may be a column slice of a larger tensor. In the
    gathered form xa may also be [P, T, S*n*R], every slot's columns side by side (a batch-1 step's
    stacked GEMV computes them all), of which each row reads its slot's. `config`: sorted tiles' launch
    knobs (default: `sorted_config` of the tiles)."""
    check_float("xa", xa, 3)
    check_float("b", b, 3)
    check_float("out", out, 2)
    check_float("scales", scales, 1)
    require(scales.dtype == torch.float32, f"scales must be float32, got {scales.dtype}")
    require(b.shape[0] == scales.shape[0], f"b has {b.shape[0]} slots, scales {scales.shape[0]}")
    sizes = [b.shape[1]] if slice_sizes is None else list(slice_sizes)
    require(1 <= len(sizes) <= MAX_SLICES and sum(sizes) == b.shape[1] and min(sizes) >= 0,
            f"slice_sizes {sizes} must be 1 to {MAX_SLICES} widths adding up to b's {b.shape[1]} rows")
    rank, num_slots = b.shape[2], b.shape[0]
    per_slot = num_slots > 1 and xa.shape[2] == num_slots * len(sizes) * rank
    require(per_slot or xa.shape[2] == len(sizes) * rank,
            f"xa has {xa.shape[2]} columns for {len(sizes)} slices of rank {rank} (or those of {num_slots} slots)")
    require(segments is None or not per_slot, "xa with every slot's columns takes the gathered form (segments=None)")
    require(out.shape == (xa.shape[1], b.shape[1]), f"out must be {(xa.shape[1], b.shape[1])}, got {tuple(out.shape)}")
    check_same_device(xa=xa, b=b, scales=scales, token_slots=token_slots, out=out)
    parts, num_tokens = xa.shape[0], xa.shape[1]
    n_out = out.shape[1]
    check_slots(token_slots, num_tokens, b.shape[0], segments, check_indices)
    if not (num_tokens and rank and n_out and parts):
        return
    ends = [sum(sizes[:j + 1]) for j in range(len(sizes) - 1)] + [n_out] * (MAX_SLICES - len(sizes) + 1)
    common = (n_out, rank, parts, ends[0], ends[1], xa.stride(0), xa.stride(1), b.stride(0), b.stride(1), out.stride(0))
    if segments is None:
        block_r = triton.next_power_of_2(rank)
        block_n = min(_GATHER_BLOCK_N, max(16, _TILE_ELEMENTS // block_r), triton.next_power_of_2(n_out))
        _expand_gathered_kernel[(num_tokens, triton.cdiv(n_out, block_n))](
            xa, b, scales, token_slots, out, *common, len(sizes) * rank if per_slot else 0, NUM_SLICES=len(sizes),
            BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=triton.next_power_of_2(parts), num_warps=4)
        return
    if not segments.num_segments or not segments.max_len:
        return
    ordered = segments.order is not None
    block_m = max(16, triton.next_power_of_2(segments.max_len)) if ordered else _SEGMENT_BLOCK_M
    config = (config or sorted_config(block_m)) if ordered else None
    block_r = max(16, triton.next_power_of_2(rank))
    widest = _SEGMENT_BLOCK_N if config is None else config.block_n
    block_n = max(16, min(widest, _TILE_ELEMENTS // block_r, triton.next_power_of_2(n_out)))
    row_blocks = triton.cdiv(segments.max_len, block_m)
    n_blocks = triton.cdiv(n_out, block_n)
    # A sorted tile's program covers several output blocks, loading its partial sums once.
    per_program = 1 if config is None else triton.cdiv(segments.num_segments * n_blocks, config.expand_programs)
    grid = (segments.num_segments, row_blocks, triton.cdiv(n_blocks, per_program))
    order = segments.starts if segments.order is None else segments.order
    _expand_segment_kernel[grid](
        xa, b, scales, segments.starts, segments.lens, segments.slots, order, out, *common, per_program * block_n,
        NUM_SLICES=len(sizes), ORDERED=ordered, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        num_warps=warps_for(block_m))
