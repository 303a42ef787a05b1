"""The pairs path of the fused MoE layer: small decode batches, each routed (token, slot) pair on its own.

No sort: at batch 1 each pair's expert is read once, which is all the weight the token needs, so the
two kernels are GEMVs bound by reading expert rows (Qwen3-30B-A3B: 8 experts x 3 x 768 x 2048 bf16,
75 MB a layer, ~25 us at H100 copy bandwidth).

- `_pair_gate_up_kernel`, grid (pair, column block): silu(gate[e] @ x) * (up[e] @ x) for BLOCK_N
  columns of the intermediate width, gate and up rows streamed together along K.
- `_pair_down_sum_kernel`, grid (token, column block): the token's k down projections, weighted by
  their routing weights and summed in slot order. The loop runs over slot and K as one flat range,
  so the loads of the next slot's expert are in flight while this slot's finish (the pipeliner
  stages across the whole range, not within one slot only).

Both stream weights row-major along K with per-thread [BLOCK_N, BLOCK_K] fp32 accumulators (fused
multiply-adds only, one cross-thread sum at the end) and evict-first loads, so the activations stay
in L2. Bandwidth comes from programs x bytes in flight per program: narrow column blocks give
enough programs at batch 1 and `num_stages` keeps loads ahead, both tuned per shape on an H100
(`python -m corectl.backends.triton.bench.moe --sweep coarse|fine` prints the table below).

FP8 weights (SCALED): e4m3 rows widened in registers; gate and up sums scaled per row before the
SiLU; in the down kernel the row scale joins the routing weight of each slot. Deterministic: no
atomics, a token's slots summed in order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# The smallest grid that keeps every SM of an H100 (132) streaming: the heuristic narrows column
# blocks until the batch's programs reach it.
TARGET_PROGRAMS = 4 * 132


class PairConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class PairConfigs(NamedTuple):
    gate_up: PairConfig
    down: PairConfig


# Tuned on an H100 (2026-11-25, triton 3.6) by `bench.moe --sweep` (bucket 8: `--sweep fine`), bf16 weights:
# {(hidden, intermediate): {pairs bucket: PairConfigs}}, buckets the powers of two of the pair count
# (tokens x top_k). They serve 16-bit and e4m3 weights; fp32 weights (whose staged tiles need twice
# the shared memory) and other shapes take the heuristic.
TUNED: dict[tuple[int, int], dict[int, PairConfigs]] = {
    (2048, 768): {
        8: PairConfigs(gate_up=PairConfig(8, 256, 2, 3), down=PairConfig(2, 1024, 2, 4)),
        16: PairConfigs(gate_up=PairConfig(8, 512, 4, 2), down=PairConfig(16, 512, 4, 4)),
        32: PairConfigs(gate_up=PairConfig(16, 256, 4, 2), down=PairConfig(16, 256, 4, 4)),
        64: PairConfigs(gate_up=PairConfig(8, 256, 4, 4), down=PairConfig(16, 512, 8, 4)),
    },
}


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, out_ptr, N, K, top_k, stride_xm, stride_we, stride_wn,
                         stride_se, stride_om, SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """out[pair, n] = silu(gate[e] @ x) * (up[e] @ x) for columns [pid_n * BLOCK_N, +BLOCK_N) of N,
    x the pair's token row, e its expert; `w` holds gate rows [0, N) and up rows [N, 2N) (SCALED:
    e4m3, with `scale`'s row scales in the same order)."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        gate = tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        up = tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        acc_gate += gate.to(tl.float32) * x
        acc_up += up.to(tl.float32) * x
    gate, up = tl.sum(acc_gate, 1), tl.sum(acc_up, 1)
    if SCALED:
        scale_row = scale_ptr + expert * stride_se + offs_n
        gate *= tl.load(scale_row, mask=n_ok, other=0.0)
        up *= tl.load(scale_row + N, mask=n_ok, other=0.0)
    tl.store(out_ptr + pair * stride_om + offs_n, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=n_ok)


@triton.jit
def token_routes(ids_ptr, pair_weight_ptr, token, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr):
    """(slot lanes, expert ids, routing weights) of a token, read once: inside a down kernel's loop a
    weight row's address then comes from registers, not from a load the pipeliner would wait for."""
    slots = tl.arange(0, BLOCK_TOP_K)
    experts = tl.load(ids_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0).to(tl.int64)
    coeffs = tl.load(pair_weight_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0.0)
    return slots, experts, coeffs


@triton.jit
def _pair_down_sum_kernel(act_ptr, w_ptr, scale_ptr, ids_ptr, pair_weight_ptr, out_ptr, N, K,
                          stride_am, stride_we, stride_wn, stride_se, stride_om,
                          TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr, SCALED: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out[token, n] = sum over the token's k pairs, in slot order, of weight * (down[e] @ act[pair])
    (SCALED: `w` e4m3, each row's products times its scale in `scale`)."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    slots, experts, coeffs = token_routes(ids_ptr, pair_weight_ptr, token, TOP_K, BLOCK_TOP_K)
    k_steps = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in tl.range(0, TOP_K * k_steps, num_stages=NUM_STAGES):
        slot = step // k_steps
        expert = tl.sum(tl.where(slots == slot, experts, 0))
        offs_k = (step - slot * k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        # The routing weight scales the activation (BLOCK_K products) rather than the BLOCK_N x BLOCK_K tile.
        act = tl.load(act_ptr + (token * TOP_K + slot) * stride_am + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        act *= tl.sum(tl.where(slots == slot, coeffs, 0.0))
        w = tl.load(w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
        if SCALED:
            w *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_ok, other=0.0)[:, None]
        acc += w * act[None, :]
    tl.store(out_ptr + token * stride_om + offs_n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=n_ok)


def _heuristic(num_rows: int, num_programs: int, k: int, element_size: int, device: torch.device) -> PairConfig:
    """1 KB of each row per step (512 bf16 values, 256 fp32 ones, whose deeper stages would not fit
    shared memory); column blocks narrowed (down to 4 rows) until the grid reaches TARGET_PROGRAMS.
    The interpreter runs one program at a time: small tiles there."""
    if device.type == "cpu":
        return PairConfig(16, 32, 4, 1)
    block_k = max(64, min(1024 // max(element_size, 2), triton.next_power_of_2(k)))
    block_n = 32
    while block_n > 4 and num_programs * triton.cdiv(num_rows, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return PairConfig(block_n, block_k, 4, 2 if element_size > 2 else 3)


def default_configs(hidden_size: int, inter: int, num_tokens: int, top_k: int, weight_dtype: torch.dtype,
                    device: torch.device) -> PairConfigs:
    """The tuned configs of the shape at the pair count's power-of-two bucket, else the heuristic
    (the gate/up kernel's programs are per pair, the down kernel's per token)."""
    num_pairs = num_tokens * top_k
    element_size = weight_dtype.itemsize
    tuned = TUNED.get((hidden_size, inter), {}).get(1 << (num_pairs - 1).bit_length())
    if tuned is not None and element_size <= 2 and device.type != "cpu":
        return tuned
    return PairConfigs(_heuristic(inter, num_pairs, hidden_size, element_size, device),
                       _heuristic(hidden_size, num_tokens, inter, element_size, device))


def scale_args(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(scale pointer, its expert stride); unscaled kernels never read it, so the weight stands in."""
    return (weight, 0) if scale is None else (scale, scale.stride(0))


def gate_up_by_pair(hidden, gate_up, topk_ids, gate_up_scale, cfg: PairConfig) -> torch.Tensor:
    """silu(gate) * up of every pair: [T * k, I] in hidden's dtype."""
    num_tokens, top_k = topk_ids.shape
    _, two_inter, hidden_size = gate_up.shape
    inter = two_inter // 2
    activated = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    scale, stride_se = scale_args(gate_up, gate_up_scale)
    _pair_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, cfg.block_n))](
        hidden, gate_up, scale, topk_ids, activated, inter, hidden_size, top_k,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), stride_se, activated.stride(0),
        SCALED=gate_up_scale is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
    )
    return activated


def down_sum_by_token(activated, down, topk_ids, topk_weights, down_scale, cfg: PairConfig) -> torch.Tensor:
    """Each token's k down projections, weighted and summed: [T, H] in activated's dtype."""
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = down.shape[1:]
    out = torch.empty(num_tokens, hidden_size, dtype=activated.dtype, device=activated.device)
    scale, stride_se = scale_args(down, down_scale)
    _pair_down_sum_kernel[(num_tokens, triton.cdiv(hidden_size, cfg.block_n))](
        activated, down, scale, topk_ids, topk_weights, out, hidden_size, inter,
        activated.stride(0), down.stride(0), down.stride(1), stride_se, out.stride(0),
        TOP_K=top_k, BLOCK_TOP_K=triton.next_power_of_2(top_k), SCALED=down_scale is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )
    return out


def by_pair(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale,
            configs: PairConfigs | None = None) -> torch.Tensor:
    """The pairs path on checked inputs (fused_moe's contract); `configs` overrides the table."""
    num_tokens, top_k = topk_ids.shape
    inter, hidden_size = down.shape[2], down.shape[1]
    cfg = configs or default_configs(hidden_size, inter, num_tokens, top_k, gate_up.dtype, hidden.device)
    activated = gate_up_by_pair(hidden, gate_up, topk_ids, gate_up_scale, cfg.gate_up)
    return down_sum_by_token(activated, down, topk_ids, topk_weights, down_scale, cfg.down)
