"""Fused mixture-of-experts: the experts of one layer as two grouped GEMMs over tokens sorted by expert.

1. `align_to_experts` sorts the (token, slot) pairs by the expert they were routed to and pads each
   expert's run to a whole number of BLOCK_M rows, so every row block of the GEMMs belongs to one
   expert. It runs as torch ops on the device with no read-back: the buffers are sized for the
   worst case (every used expert padded by BLOCK_M - 1 rows), which depends only on the number of
   tokens, so a decode step has static shapes and can be captured in a CUDA graph; blocks past
   the real padded length exit at once.
2. `_moe_gemm_kernel` with GATED: each row block multiplies its tokens' hidden rows by its
   expert's gate and up rows and stores silu(gate) * up ([pairs, I]).
3. The same kernel without GATED: the down projection of those rows, scaled by the pair's routing
   weight ([pairs, H]).
4. The k weighted rows of each token are summed in fp32, in slot order (deterministic: a token's
   output does not depend on which other tokens share its blocks).

The torch reference is the models' own CPU path, `corectl.models.moe.fused_moe_torch`.
Numerics: fp32 accumulation; dot operands in the weights' dtype on GPUs (fp32 as IEEE fp32, never
TF32); the interpreter computes in fp32 (see paged_softmax.dot_dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_float, check_index, check_range, check_same_device, require
from .paged_softmax import dot_dtype


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pair_weight_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, N, K, a_rows_per_pair,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """out[pair, n] for this block's pairs and columns [pid_n * BLOCK_N, +BLOCK_N) of N.

    A row of `a` is pair // a_rows_per_pair (the token for the gate/up GEMM, the pair itself for
    the down GEMM). GATED: `w` holds gate rows [0, N) and up rows [N, 2N) per expert and the
    output is silu(gate) * up. WEIGHTED: the output row is scaled by the pair's routing weight."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // a_rows_per_pair).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(DOT_DTYPE)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_base + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0).to(DOT_DTYPE)
        acc += tl.dot(a, w, input_precision="ieee")
        if GATED:
            w_up = tl.load(w_base + N * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc_up += tl.dot(a, w_up.to(DOT_DTYPE), input_precision="ieee")
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        acc *= tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def align_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs (flat index token * k + slot) sorted by expert, each expert's run padded to whole
    `block_m` blocks. Returns sorted_pairs [P] int32 (padding rows hold num_pairs), block_expert
    [P / block_m] int32 (each block's expert) and num_padded [1] (the length in use), where P is
    the worst case for this many pairs."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    used_experts = min(num_experts, num_pairs)
    capacity = triton.cdiv(num_pairs + used_experts * (block_m - 1), block_m) * block_m
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    expert_ids = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_experts.dtype)
    bounds = torch.searchsorted(sorted_experts, expert_ids)         # first sorted pair of each expert
    counts = bounds[1:] - bounds[:-1]
    padded_ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - bounds[sorted_experts]
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[padded_starts[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device, dtype=padded_ends.dtype)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), padded_ends[-1:]


def _block_m(num_pairs: int, num_experts: int, device: torch.device) -> int:
    """Row block of both GEMMs: small when pairs are few per expert (decode), where padding would
    waste most of a larger block; tl.dot needs every dimension >= 16."""
    return 16 if device.type == "cpu" or num_pairs <= 2 * num_experts else 64


def _block_nk(block_m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    if device.type == "cpu":  # the interpreter runs one program at a time: small tiles
        return max(16, min(32, triton.next_power_of_2(n))), max(16, min(32, triton.next_power_of_2(k)))
    return (32, 64) if block_m == 16 else (64, 64)


def _check_inputs(hidden, gate_up, down, topk_weights, topk_ids, check_indices: bool) -> None:
    check_float("hidden", hidden, 2)
    check_float("gate_up", gate_up, 3)
    check_float("down", down, 3)
    check_float("topk_weights", topk_weights, 2)
    check_index("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    check_same_device(hidden=hidden, gate_up=gate_up, down=down, topk_weights=topk_weights, topk_ids=topk_ids)
    require(gate_up.dtype == down.dtype == hidden.dtype,
            f"hidden, gate_up and down must share a dtype, got {hidden.dtype}, {gate_up.dtype}, {down.dtype}")
    require(topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}")
    num_experts, two_inter, hidden_size = gate_up.shape
    inter = two_inter // 2
    require(two_inter % 2 == 0 and hidden.shape[1] == hidden_size,
            f"gate_up must be [E, 2 * I, H] with H = {hidden.shape[1]}, got {list(gate_up.shape)}")
    require(tuple(down.shape) == (num_experts, hidden_size, inter),
            f"down must be [E, H, I] = {[num_experts, hidden_size, inter]}, got {list(down.shape)}")
    require(topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == hidden.shape[0],
            f"topk_ids and topk_weights must both be [T, k] with T = {hidden.shape[0]}, "
            f"got {list(topk_ids.shape)} and {list(topk_weights.shape)}")
    require(topk_weights.is_contiguous() and topk_ids.is_contiguous(), "topk_weights and topk_ids must be contiguous")
    if check_indices:
        check_range("topk_ids", topk_ids, 0, num_experts)


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, check_indices: bool = True) -> torch.Tensor:
    """hidden [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; topk_weights
    [T, k] fp32; topk_ids [T, k] -> [T, H] in hidden's dtype: sum_j w[t, j] * expert_j(x_t).
    `check_indices` reads topk_ids back to check them (a sync; off inside CUDA graphs)."""
    _check_inputs(hidden, gate_up, down, topk_weights, topk_ids, check_indices)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = gate_up.shape
    inter, num_pairs = two_inter // 2, num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    dot = dot_dtype(hidden.dtype, hidden.device)
    block_m = _block_m(num_pairs, num_experts, hidden.device)
    block_n, block_k = _block_nk(block_m, inter, hidden_size, hidden.device)
    sorted_pairs, block_expert, num_padded = align_to_experts(topk_ids, num_experts, block_m)
    activated = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _moe_gemm_kernel[(sorted_pairs.numel() // block_m, triton.cdiv(inter, block_n))](
        hidden, gate_up, activated, topk_weights, sorted_pairs, block_expert, num_padded,
        num_pairs, inter, hidden_size, top_k,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), activated.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=True, WEIGHTED=False, DOT_DTYPE=dot,
        num_warps=4, num_stages=3,
    )
    block_n, block_k = _block_nk(block_m, hidden_size, inter, hidden.device)
    weighted = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _moe_gemm_kernel[(sorted_pairs.numel() // block_m, triton.cdiv(hidden_size, block_n))](
        activated, down, weighted, topk_weights, sorted_pairs, block_expert, num_padded,
        num_pairs, hidden_size, inter, 1,
        activated.stride(0), down.stride(0), down.stride(1), down.stride(2), weighted.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=False, WEIGHTED=True, DOT_DTYPE=dot,
        num_warps=4, num_stages=3,
    )
    return weighted.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
