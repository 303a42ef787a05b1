"""Sorting a step's (token, slot) pairs by expert for the fused MoE GEMMs, on the device.

Pair p = token * k + slot is routed to expert ids[p]. The GEMMs want the pairs grouped by expert
and each expert's run padded to whole BLOCK_M row blocks, so that every row block belongs to one
expert. Three small kernels (after a fill), no read-back and no atomics:

1. `_count_kernel`: each program counts its range of pairs per expert.
2. `_offsets_kernel` (one program): each expert's padded run [start, end), the total in use, every
   row block's expert, and where each program's pairs of each expert begin.
3. `_scatter_kernel`: each pair goes to its expert's run, after the earlier pairs of that expert.

Pairs keep their order within an expert (the result equals a stable sort; `align_to_experts_ref`
in reference.py is the specification). Buffers are sized for the worst case of the number of
pairs (every used expert padded by BLOCK_M - 1 rows), so a decode step has static shapes and can
be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pairs per program step (a [BLOCK_P, BLOCK_E] one-hot tile), and at most this many programs, so
# the one-program offsets pass stays short at prefill sizes.
BLOCK_P = 64
MAX_PROGRAMS = 64


@triton.jit
def _expert_one_hot(ids_ptr, start, num_pairs, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    pairs = start + tl.arange(0, BLOCK_P)
    valid = pairs < num_pairs
    experts = tl.load(ids_ptr + pairs, mask=valid, other=BLOCK_E)  # BLOCK_E matches no lane
    return pairs, valid, (experts[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, pairs_per_program,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    program = tl.program_id(0)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(program * pairs_per_program, (program + 1) * pairs_per_program, BLOCK_P):
        _, _, one_hot = _expert_one_hot(ids_ptr, start, num_pairs, BLOCK_P, BLOCK_E)
        counts += tl.sum(one_hot, 0)
    tl.store(counts_ptr + program * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _offsets_kernel(counts_ptr, block_expert_ptr, num_padded_ptr, num_programs, num_blocks,
                    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    """Turns the per-program counts (in place) into each program's first row per expert."""
    lanes = tl.arange(0, BLOCK_E)
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for program in range(num_programs):
        totals += tl.load(counts_ptr + program * BLOCK_E + lanes)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    next_row = ends - padded
    for program in range(num_programs):
        row = counts_ptr + program * BLOCK_E + lanes
        count = tl.load(row)
        tl.store(row, next_row)
        next_row += count
    # A block's expert: how many experts' runs end at or before the block's first row.
    for first in range(0, num_blocks, BLOCK_B):
        blocks = first + tl.arange(0, BLOCK_B)
        ended = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + blocks, tl.minimum(ended, NUM_EXPERTS - 1), mask=blocks < num_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, first_rows_ptr, sorted_pairs_ptr, num_pairs, pairs_per_program,
                    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    program = tl.program_id(0)
    next_row = tl.load(first_rows_ptr + program * BLOCK_E + tl.arange(0, BLOCK_E))
    for start in range(program * pairs_per_program, (program + 1) * pairs_per_program, BLOCK_P):
        pairs, valid, one_hot = _expert_one_hot(ids_ptr, start, num_pairs, BLOCK_P, BLOCK_E)
        earlier = tl.cumsum(one_hot, 0) - one_hot  # this step's earlier pairs of the same expert
        rows = tl.sum(one_hot * (earlier + next_row[None, :]), 1)
        tl.store(sorted_pairs_ptr + rows, pairs, mask=valid)
        next_row += tl.sum(one_hot, 0)


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every expert that can be used padded by block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def align_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (contiguous, values in [0, num_experts)) -> sorted_pairs [P] int32 (pairs
    grouped by expert, each run padded to whole `block_m` blocks with the value T * k),
    block_expert [P / block_m] int32 (each block's expert) and num_padded [1] int32 (the rows in
    use), where P = align_capacity(T * k, ...)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    capacity = align_capacity(num_pairs, num_experts, block_m)
    block_e = max(16, triton.next_power_of_2(num_experts))
    steps = triton.cdiv(triton.cdiv(num_pairs, BLOCK_P), MAX_PROGRAMS)
    pairs_per_program = steps * BLOCK_P
    num_programs = triton.cdiv(num_pairs, pairs_per_program)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    per_program = torch.empty(num_programs, block_e, dtype=torch.int32, device=device)
    _count_kernel[(num_programs,)](topk_ids, per_program, num_pairs, pairs_per_program,
                                   BLOCK_P=BLOCK_P, BLOCK_E=block_e, num_warps=4)
    _offsets_kernel[(1,)](per_program, block_expert, num_padded, num_programs, capacity // block_m,
                          NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=BLOCK_P,
                          num_warps=4)
    _scatter_kernel[(num_programs,)](topk_ids, per_program, sorted_pairs, num_pairs, pairs_per_program,
                                     BLOCK_P=BLOCK_P, BLOCK_E=block_e, num_warps=4)
    return sorted_pairs, block_expert, num_padded
