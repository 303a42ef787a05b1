"""LoRA inside the fused mixture-of-experts layer: each pair's adapter, per (slot, expert).

`fused_moe_lora` runs the sorted path of `moe.fused_moe` (every pair of a step grouped by expert
in row blocks, `align_to_experts`) with two changes: the gate_up GEMM stores gate and up
themselves, so each pair's adapter delta lands before the activation, and the adapters' deltas
ride on the same sorted row blocks. A LoRA program takes one (row block, adapter slot): the
block's rows whose token has that slot, against the block's expert's A and B of that slot;
a program whose block holds no row of its slot exits at once, so a step reads each (slot,
expert) pair of matrices once per row block that needs it. Rows of different slots are
different programs' rows: no atomics, and the result does not depend on the schedule.

Per layer: shrink x @ A_gu[s, e].T (gate's and up's A, one [2R, H] stack) into fp32 [pairs, 2R];
expand it into gate_up's two halves (slice j reads columns [jR, (j+1)R)); silu(gate) * up; the
down shrink of that activation; the weighted down GEMM; the down expand scaled by the pair's
routing weight too, so the sum over a token's k pairs is unchanged. Nothing reads back to the
host and every buffer is sized by the step's token count: decode CUDA graphs capture it, the
slots coming from the batch's static `token_slots` buffer (`corectl.lora.layers.LoRABatch`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.paged_softmax import dot_dtype
from ..checks import check_float, require
from ..elementwise.activation import silu_and_mul
from ..moe.fused_moe import SortedRouting, expert_gemm, sort_by_expert

# Columns of one expand program, and the widest rank block of a shrink program.
_BLOCK_N = 64
_MAX_BLOCK_R = 64
_BLOCK_K = 64


@triton.jit
def _block_rows(sorted_pairs_ptr, block_expert_ptr, slots_ptr, num_pairs, TOP_K: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """This program's row block: (its pairs, which of them have this program's slot, the slot,
    the block's expert)."""
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    pair_slots = tl.load(slots_ptr + pairs // TOP_K, mask=row_ok, other=-1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return pairs, row_ok & (pair_slots == slot), slot.to(tl.int64), expert


@triton.jit
def _moe_lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, xa_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
                            num_pairs, num_experts, K, R, x_rows_per_pair, stride_xm, stride_ae, stride_ar,
                            stride_om, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """xa[pair, r] = x[pair // x_rows_per_pair] . A[slot, expert][r] for this block's rows of this slot."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, mine, slot, expert = _block_rows(sorted_pairs_ptr, block_expert_ptr, slots_ptr, num_pairs, TOP_K, BLOCK_M)
    if tl.max(mine.to(tl.int32), 0) == 0:
        return
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    a_base = a_ptr + (slot * num_experts + expert) * stride_ae
    x_rows = (pairs // x_rows_per_pair).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + x_rows[:, None] * stride_xm + k[None, :], mask=mine[:, None] & (k[None, :] < K), other=0.0)
        at = tl.load(a_base + r[None, :] * stride_ar + k[:, None], mask=(r[None, :] < R) & (k[:, None] < K), other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision="ieee")
    tl.store(xa_ptr + pairs.to(tl.int64)[:, None] * stride_om + r[None, :], acc, mask=mine[:, None] & (r[None, :] < R))


@triton.jit
def _moe_lora_expand_kernel(xa_ptr, b_ptr, scales_ptr, slots_ptr, pair_weights_ptr, out_ptr, sorted_pairs_ptr,
                            block_expert_ptr, num_padded_ptr, num_pairs, num_experts, N, R, SLICE_N, stride_xm,
                            stride_be, stride_bn, stride_om, TOP_K: tl.constexpr, NUM_SLICES: tl.constexpr,
                            WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr):
    """out[pair, n] += (xa[pair] slice j . B[slot, expert][n]) * scale[slot] (* the pair's routing
    weight) for this block's rows of this slot; column n lies in slice j = n // SLICE_N."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, mine, slot, expert = _block_rows(sorted_pairs_ptr, block_expert_ptr, slots_ptr, num_pairs, TOP_K, BLOCK_M)
    if tl.max(mine.to(tl.int32), 0) == 0:
        return
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    bt = tl.load(b_ptr + (slot * num_experts + expert) * stride_be + n[None, :] * stride_bn + r[:, None],
                 mask=(n[None, :] < N) & (r[:, None] < R), other=0.0).to(tl.float32)
    rows = pairs.to(tl.int64)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(NUM_SLICES):
        xa = tl.load(xa_ptr + rows[:, None] * stride_xm + j * R + r[None, :], mask=mine[:, None] & (r[None, :] < R),
                     other=0.0)
        delta = tl.where((n // SLICE_N)[None, :] == j, tl.dot(xa, bt, input_precision="ieee"), delta)
    delta *= tl.load(scales_ptr + slot)
    if WEIGHTED:
        delta *= tl.load(pair_weights_ptr + pairs, mask=mine, other=0.0)[:, None]
    mask = mine[:, None] & (n[None, :] < N)
    out = out_ptr + rows[:, None] * stride_om + n[None, :]
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (y + delta).to(out_ptr.dtype.element_ty), mask=mask)


def moe_lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, routing: SortedRouting, top_k: int,
                    x_rows_per_pair: int) -> torch.Tensor:
    """x [rows, K], a [S, E, R', K] (R' = n * R), token_slots [T] int32 -> fp32 xa [pairs, R']:
    each pair's row of x (pair // x_rows_per_pair) times its (slot, expert)'s A; zero for base pairs."""
    num_slots, num_experts, rank, k = a.shape
    xa = torch.zeros(routing.num_pairs, rank, dtype=torch.float32, device=x.device)
    block_r = max(16, min(_MAX_BLOCK_R, triton.next_power_of_2(rank)))
    grid = (routing.sorted_pairs.numel() // routing.block_m, num_slots, triton.cdiv(rank, block_r))
    _moe_lora_shrink_kernel[grid](
        x, a, token_slots, xa, routing.sorted_pairs, routing.block_expert, routing.num_padded, routing.num_pairs,
        num_experts, k, rank, x_rows_per_pair, x.stride(0), a.stride(1), a.stride(2), xa.stride(0), TOP_K=top_k,
        BLOCK_M=routing.block_m, BLOCK_R=block_r, BLOCK_K=max(16, min(_BLOCK_K, triton.next_power_of_2(k))),
        DOT_DTYPE=dot_dtype(x.dtype, x.device), num_warps=4)
    return xa


def moe_lora_expand(xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, token_slots: torch.Tensor,
                    routing: SortedRouting, top_k: int, out: torch.Tensor, num_slices: int,
                    pair_weights: torch.Tensor | None = None) -> None:
    """out [pairs, N] += per pair (xa slice j @ B[slot, expert] rows of slice j .T) * scales[slot]
    (* pair_weights [pairs] when given), in place; b [S, E, N, R], N in `num_slices` equal slices."""
    num_slots, num_experts, n_out, rank = b.shape
    require(n_out % num_slices == 0 and xa.shape[1] == num_slices * rank,
            f"xa has {xa.shape[1]} columns for {num_slices} slices of rank {rank} over {n_out} rows")
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = max(16, min(_BLOCK_N, 8192 // block_r, triton.next_power_of_2(n_out)))
    grid = (routing.sorted_pairs.numel() // routing.block_m, num_slots, triton.cdiv(n_out, block_n))
    weights = xa if pair_weights is None else pair_weights
    _moe_lora_expand_kernel[grid](
        xa, b, scales, token_slots, weights, out, routing.sorted_pairs, routing.block_expert, routing.num_padded,
        routing.num_pairs, num_experts, n_out, rank, n_out // num_slices, xa.stride(0), b.stride(1), b.stride(2),
        out.stride(0), TOP_K=top_k, NUM_SLICES=num_slices, WEIGHTED=pair_weights is not None,
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)


def fused_moe_lora(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, lora, *, gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`moe.fused_moe` (sorted path) plus each token's adapter in its experts (module doc); `lora`
    is a `corectl.lora.experts.ExpertLoRA`: its stacks and its batch's token_slots [>= T] and
    scales [S]."""
    check_float("hidden", hidden, 2)
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(hidden)
    slots, scales = lora.batch.token_slots[:num_tokens], lora.batch.scales
    routing = sort_by_expert(topk_ids, gate_up.shape[0])
    a_gu, a_down = (a.flatten(2, 3) for a in (lora.gate_up_a, lora.down_a))
    projected = expert_gemm(hidden, gate_up, gate_up_scale, routing, top_k, topk_weights, gated=False, weighted=False)
    xa = moe_lora_shrink(hidden, a_gu, slots, routing, top_k, top_k)
    moe_lora_expand(xa, lora.gate_up_b, scales, slots, routing, top_k, projected, 2)
    activated = silu_and_mul(projected)
    xa = moe_lora_shrink(activated, a_down, slots, routing, top_k, 1)
    weighted = expert_gemm(activated, down, down_scale, routing, 1, topk_weights, gated=False, weighted=True)
    moe_lora_expand(xa, lora.down_b, scales, slots, routing, top_k, weighted, 1, topk_weights.view(-1))
    return weighted.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
