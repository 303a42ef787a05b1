"""LoRA shrink: xa = x @ A[slot].T for every token of a step, each with its own adapter slot.

The result is fp32 partial sums [P, T, R] over P splits of the input features (their sum is xa):
the expand adds them up as it loads them, so a decode step's shrink can spread one token's
reduction over many programs without a second launch or atomics.

Gathered form (decode steps, CUDA graphs): one program per (token, rank block, input split) reads
its token's slot and reduces over its share of the input features; a base token (slot -1) writes
zeros. A batch-1 step has one token: without the split, one program would stream a whole A
(0.4 MB for llama3-8b's qkv) alone. Segment form (prefill and mixed steps): one program per
(segment, row block, input split and rank block) multiplies a tile of a run of tokens sharing one
adapter with that adapter's A by `tl.dot`, so A is read once per tile instead of once per token;
its splits are summed before it returns (P = 1). Sorted tiles (decode steps of many tokens: the
segment kernel over tiles of rows sorted by slot, read through the order) keep their splits for the
expand and leave rows of no tile unwritten, so a captured graph adds no fill or sum. Loads are
converted to fp32 at once and accumulate in fp32 (the interpreter computes no bf16 arithmetic).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from corectl.lora.punica import LoRASegments

from ..checks import check_float, check_same_device, require
from .checks import check_slots
from .config import SortedConfig, sorted_config, warps_for
from .segments import segment_tile

_GATHER_BLOCK_K = 256
# Elements of one program's fp32 tile: 64 registers a thread at 4 warps.
_TILE_ELEMENTS = 8192
# Programs a gathered launch aims for (about 8 per H100 multiprocessor), and the most input splits
# (the expand reads every split's partial sums).
_TARGET_PROGRAMS = 1024
MAX_SPLITS = 64
_SEGMENT_BLOCK_M = 32
_SEGMENT_BLOCK_K = 64


@triton.jit
def _input(ptrs, K, mask, GATED: tl.constexpr):
    """The shrink's input at `ptrs`; gated: silu(gate) * up of a gated MLP's [gate | up] row (the
    activation the down projection's base GEMV forms as it loads it, formed here the same way)."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x


@triton.jit
def _shrink_gathered_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, K, R, K_PER_SPLIT, stride_xt, stride_as, stride_ar,
                            stride_os, stride_ot, GATED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        k_start = split * K_PER_SPLIT
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = _input(x_ptr + token * stride_xt + k, K, k < K, GATED)
            a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(out_ptr + split * stride_os + token * stride_ot + r, acc, mask=r < R)


@triton.jit
def _shrink_segment_kernel(x_ptr, a_ptr, starts_ptr, lens_ptr, seg_slots_ptr, order_ptr, out_ptr, K, R, K_PER_SPLIT,
                           stride_xt, stride_as, stride_ar, stride_os, stride_ot, RANK_BLOCKS, GATED: tl.constexpr,
                           ORDERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, in_segment, slot, live = segment_tile(starts_ptr, lens_ptr, seg_slots_ptr, order_ptr, BLOCK_M, ORDERED)
    if live:
        # Axis 2 is (input split, rank block).
        split = tl.program_id(2) // RANK_BLOCKS
        r = (tl.program_id(2) % RANK_BLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        k_start = split * K_PER_SPLIT
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xt = _input(x_ptr + rows[:, None] * stride_xt + k[None, :], K, in_segment[:, None] & (k[None, :] < K), GATED)
            at = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                         mask=(r[None, :] < R) & (k[:, None] < K), other=0.0).to(tl.float32)
            acc += tl.dot(xt, at)
        tl.store(out_ptr + split * stride_os + rows[:, None] * stride_ot + r[None, :], acc,
                 mask=in_segment[:, None] & (r[None, :] < R))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, segments: LoRASegments | None = None,
                check_indices: bool = False, gated: bool = False, config: SortedConfig | None = None) -> torch.Tensor:
    """x [T, K], a [S, R, K], token_slots [T] int32 (-1: base) -> fp32 partial sums [P, T, R] whose
    sum over P is x @ a[slot].T per row (zero on base rows). With `segments` the segment form runs
    (P = 1; rows outside every segment are zero). `check_indices` reads the slots back to check
    their range (a host sync). `gated`: x is a gated MLP's [T, 2K] (gate | up), and silu(gate) * up
    takes its place. `config`: sorted tiles' launch knobs (default: `sorted_config` of the tiles)."""
    check_float("x", x, 2)
    check_float("a", a, 3)
    require(a.stride(1) == a.shape[2] or a.shape[1] <= 1, f"a's rows must be contiguous, got strides {a.stride()}")
    width = 2 * a.shape[2] if gated else a.shape[2]
    require(width == x.shape[1], f"a has {a.shape[2]} input features, x has {x.shape[1]}" + (" (gated)" if gated else ""))
    check_same_device(x=x, a=a, token_slots=token_slots)
    check_slots(token_slots, x.shape[0], a.shape[0], segments, check_indices)
    if segments is None:
        return _shrink_gathered(x, a, token_slots, gated)
    return _shrink_segments(x, a, segments, gated, config)


def _splits(k: int, block_k: int, programs: int, target: int = _TARGET_PROGRAMS,
            most: int = MAX_SPLITS) -> tuple[int, int]:
    """(input features per split, splits): about `target` programs, at most `most` splits and one per k block."""
    k_blocks = triton.cdiv(k, block_k)
    splits = max(1, min(k_blocks, most, triton.cdiv(target, max(1, programs))))
    k_per_split = max(1, triton.cdiv(k_blocks, splits)) * block_k
    return k_per_split, max(1, triton.cdiv(k, k_per_split))


def _shrink_gathered(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, gated: bool) -> torch.Tensor:
    num_tokens, (rank, k) = x.shape[0], a.shape[1:]
    block_r = min(triton.next_power_of_2(max(rank, 1)), 64)
    block_k = min(_GATHER_BLOCK_K, _TILE_ELEMENTS // block_r, triton.next_power_of_2(max(k, 1)))
    rank_blocks = triton.cdiv(rank, block_r)
    k_per_split, splits = _splits(k, block_k, num_tokens * rank_blocks)
    out = torch.empty((splits, num_tokens, rank), dtype=torch.float32, device=x.device)
    if num_tokens and rank:
        _shrink_gathered_kernel[(num_tokens, rank_blocks, splits)](
            x, a, token_slots, out, k, rank, k_per_split, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
            out.stride(1), GATED=gated, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out


def _shrink_segments(x: torch.Tensor, a: torch.Tensor, segments: LoRASegments, gated: bool,
                     config: SortedConfig | None) -> torch.Tensor:
    num_tokens, (rank, k) = x.shape[0], a.shape[1:]
    ordered = segments.order is not None
    if not (segments.num_segments and segments.max_len and rank):
        return torch.zeros((1, num_tokens, rank), dtype=torch.float32, device=x.device)
    block_m = max(16, triton.next_power_of_2(segments.max_len)) if ordered else _SEGMENT_BLOCK_M
    block_r = max(16, min(triton.next_power_of_2(rank), 64))
    block_k = max(16, min(_SEGMENT_BLOCK_K, triton.next_power_of_2(k)))
    rank_blocks = triton.cdiv(rank, block_r)
    row_blocks = triton.cdiv(segments.max_len, block_m)
    # One 512-token prompt is 16 row blocks: its reduction is split too.
    programs = segments.num_segments * row_blocks * rank_blocks
    if ordered:
        config = config or sorted_config(block_m)
        target, most = config.shrink_programs, config.shrink_splits
    else:
        target, most = _TARGET_PROGRAMS, MAX_SPLITS
    k_per_split, splits = _splits(k, block_k, programs, target, most)
    # Rows outside every segment stay zero in every split; sorted tiles (a decode step's, whose graph
    # must not grow by a fill) leave them unwritten, as the expand never reads them.
    alloc = torch.empty if ordered else torch.zeros
    out = alloc((splits, num_tokens, rank), dtype=torch.float32, device=x.device)
    order = segments.starts if segments.order is None else segments.order
    _shrink_segment_kernel[(segments.num_segments, row_blocks, splits * rank_blocks)](
        x, a, segments.starts, segments.lens, segments.slots, order, out, k, rank, k_per_split, x.stride(0),
        a.stride(0), a.stride(1), out.stride(0), out.stride(1), rank_blocks, GATED=gated, ORDERED=ordered,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps_for(block_m))
    # The segment expand would read every split once per output block: they are summed once here.
    # A sorted expand program covers many output blocks and sums them itself, without a launch more.
    return out if ordered or splits == 1 else out.sum(0, keepdim=True)
