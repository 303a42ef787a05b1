"""Fused mixture-of-experts: the experts of one layer in two Triton kernels, by one of two paths.

Sorted path (batches with several pairs per expert):
1. `align_to_experts` (moe_align.py) sorts the (token, slot) pairs by the expert they were routed
   to and pads each expert's run to a whole number of BLOCK_M rows, so every row block of the GEMMs
   belongs to one expert. It runs on the device with no read-back, in buffers sized for the worst
   case of the step's token count, so a decode step has static shapes and can be captured in a
   CUDA graph; blocks past the real padded length exit at once.
2. `_moe_gemm_kernel` with GATED: each row block multiplies its tokens' hidden rows by its
   expert's gate and up rows and stores silu(gate) * up ([pairs, I]).
3. The same kernel without GATED: the down projection of those rows, scaled by the pair's routing
   weight ([pairs, H]).
4. The k weighted rows of each token are summed in fp32, in slot order.
`sort_by_expert` (step 1) and `expert_gemm` (one launch of steps 2-3) are what
`lora/moe_lora.py` builds the adapters' path on.

Pair path (small decode batches, at most one pair per two experts): no sort; two GEMV launches,
every expert's weights read once per pair, at batch 1 exactly the weights the token needs
(moe_pairs.py, with its tuned configs).

FP8 weights (`gate_up_scale`, `down_scale` given: e4m3 weights, fp32 scales per output row
[E, 2I] and [E, H]): every kernel takes a SCALED switch; the e4m3 values are widened in the
kernel to the dot's dtype (exact), and each output row's scale multiplies its fp32 sum before the
SiLU-and-multiply and before the routing weight. Activations are not quantized (W8A16), the
contract of the torch path with scales. Without scales the kernels are the bf16/fp32 ones.

Both paths are deterministic (no atomics; a token's k outputs are summed in slot order); which
path runs, and the tile sizes, depend on the batch size (docs/models.md). The torch reference is
the models' own CPU path, `corectl.models.moe.fused_moe_torch`.
Numerics: fp32 accumulation; dot operands in the weights' dtype on GPUs (fp32 as IEEE fp32, never
TF32); the interpreter computes in fp32 (see paged_softmax.dot_dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..attention.paged_softmax import dot_dtype
from ..checks import check_float, check_index, check_range, check_same_device, require
from ..gemm.fp8_gemv import FP8_WEIGHT_DTYPE
from .moe_align import align_to_experts
from .moe_pairs import by_pair, scale_args


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, out_ptr, pair_weight_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, N, K, a_rows_per_pair,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """out[pair, n] for this block's pairs and columns [pid_n * BLOCK_N, +BLOCK_N) of N.

    A row of `a` is pair // a_rows_per_pair (the token for the gate/up GEMM, the pair itself for
    the down GEMM). GATED: `w` holds gate rows [0, N) and up rows [N, 2N) per expert and the
    output is silu(gate) * up. WEIGHTED: the output row is scaled by the pair's routing weight.
    SCALED: `w` is e4m3 and `scale` holds its expert's row scales (gate's then up's when GATED)."""
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
    if SCALED:
        scale_row = scale_ptr + expert * stride_se + offs_n
        acc *= tl.load(scale_row, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(scale_row + N, mask=n_ok, other=0.0)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        acc *= tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def topk_route(logits_row, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """(slot lanes [BLOCK_K], weights, expert ids) of one token's router logits row: softmax over
    them (fp32), the top k largest first (ties to the lower expert), renormalised to sum to 1 when
    RENORMALIZE; lanes past k hold 0.

    Each pick is one max over int64 keys, probability bits high and the inverted lane low: the
    bits of non-negative floats order like the floats, so one reduction yields both the value and
    (ties to the lower lane) its expert, where argmax and max would take two."""
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < num_experts
    logits = tl.load(logits_row + lanes, mask=valid, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - lanes)
    keys = tl.where(valid, keys, -1)  # below every probability's key
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(keys, 0)
        lane = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        chosen = tl.where(slots == slot, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), chosen)
        chosen_ids = tl.where(slots == slot, lane, chosen_ids)
        keys = tl.where(lanes == lane, -1, keys)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, 0)
    return slots, chosen, chosen_ids


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One token's `topk_route`. Decode launches this once per MoE layer per step, so its latency
    is what counts."""
    token = tl.program_id(0).to(tl.int64)
    slots, chosen, chosen_ids = topk_route(logits_ptr + token * stride_l, num_experts, TOP_K, RENORMALIZE, BLOCK_E,
                                           BLOCK_K)
    tl.store(weights_ptr + token * TOP_K + slots, chosen, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def _block_m(num_pairs: int, num_experts: int, device: torch.device) -> int:
    """Row block of both GEMMs: small when pairs are few per expert (decode), where padding would
    waste most of a larger block; tl.dot needs every dimension >= 16."""
    return 16 if device.type == "cpu" or num_pairs <= 2 * num_experts else 64


def _block_nk(block_m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    if device.type == "cpu":  # the interpreter runs one program at a time: small tiles
        return max(16, min(32, triton.next_power_of_2(n))), max(16, min(32, triton.next_power_of_2(k)))
    return (32, 64) if block_m == 16 else (64, 64)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """corectl.models.moe.select_experts in one launch: router_logits [T, E] -> (weights [T, k]
    fp32, expert ids [T, k] int32)."""
    check_float("router_logits", router_logits, 2)
    num_tokens, num_experts = router_logits.shape
    require(0 < top_k <= num_experts, f"top_k must lie in [1, {num_experts}], got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _topk_softmax_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            # One warp: its reductions are register shuffles, with no shared-memory round trip.
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=1,
        )
    return weights, ids


def _check_weights(hidden, gate_up, down, gate_up_scale, down_scale) -> None:
    """Weights in hidden's dtype, or e4m3 with an fp32 scale per output row of each expert."""
    require((gate_up_scale is None) == (down_scale is None),
            "gate_up_scale and down_scale come together (FP8 weights) or not at all")
    if gate_up_scale is None:
        check_float("gate_up", gate_up, 3)
        check_float("down", down, 3)
        require(gate_up.dtype == down.dtype == hidden.dtype,
                f"hidden, gate_up and down must share a dtype, got {hidden.dtype}, {gate_up.dtype}, {down.dtype}")
        return
    for name, weight, scale in (("gate_up", gate_up, gate_up_scale), ("down", down, down_scale)):
        require(isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.dtype == FP8_WEIGHT_DTYPE
                and weight.stride(-1) == 1, f"{name} must be a 3-dimensional float8_e4m3fn tensor contiguous in "
                f"its last dimension when scales are given, got {getattr(weight, 'dtype', type(weight))}")
        require(isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.is_contiguous()
                and tuple(scale.shape) == tuple(weight.shape[:2]),
                f"{name}_scale must be a contiguous float32 [E, rows] = {list(weight.shape[:2])}, got "
                f"{getattr(scale, 'dtype', None)} {list(getattr(scale, 'shape', []))}")


def _check_inputs(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale,
                  check_indices: bool) -> None:
    check_float("hidden", hidden, 2)
    _check_weights(hidden, gate_up, down, gate_up_scale, down_scale)
    check_float("topk_weights", topk_weights, 2)
    check_index("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    scales = {} if gate_up_scale is None else {"gate_up_scale": gate_up_scale, "down_scale": down_scale}
    check_same_device(hidden=hidden, gate_up=gate_up, down=down, topk_weights=topk_weights, topk_ids=topk_ids,
                      **scales)
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
              topk_ids: torch.Tensor, *, gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None, check_indices: bool = True,
              path: str | None = None) -> torch.Tensor:
    """hidden [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; topk_weights
    [T, k] fp32; topk_ids [T, k] -> [T, H] in hidden's dtype: sum_j w[t, j] * expert_j(x_t).
    With `gate_up_scale` [E, 2I] and `down_scale` [E, H] (fp32) the weights are e4m3, scaled per
    output row (module doc). `check_indices` reads topk_ids back to check them (a sync; off inside
    CUDA graphs). `path` ("pairs" or "sorted", module doc) is chosen from the batch when None."""
    _check_inputs(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale, check_indices)
    num_tokens, top_k = topk_ids.shape
    num_experts = gate_up.shape[0]
    if num_tokens * top_k == 0:
        return torch.zeros_like(hidden)
    if path is None:
        path = "pairs" if num_tokens * top_k <= num_experts // 2 else "sorted"
    require(path in ("pairs", "sorted"), f"path must be 'pairs' or 'sorted', got {path!r}")
    run = by_pair if path == "pairs" else _sorted
    return run(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale)


@dataclass(frozen=True)
class SortedRouting:
    """A step's (token, slot) pairs sorted by expert (`align_to_experts`) in row blocks of `block_m`."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> SortedRouting:
    num_pairs = topk_ids.numel()
    block_m = _block_m(num_pairs, num_experts, topk_ids.device)
    return SortedRouting(*align_to_experts(topk_ids, num_experts, block_m), block_m, num_pairs)


def expert_gemm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, routing: SortedRouting,
                a_rows_per_pair: int, topk_weights: torch.Tensor, *, gated: bool, weighted: bool) -> torch.Tensor:
    """Every sorted pair's row of `a` (row pair // a_rows_per_pair) times its expert's `weight`
    [E, N, K] -> [pairs, N] in a's dtype; gated: silu(gate) * up of N = 2I rows, [pairs, I];
    weighted: scaled by the pair's routing weight. `scale`: e4m3 weights' row scales [E, N]."""
    n = weight.shape[1] // 2 if gated else weight.shape[1]
    k = weight.shape[2]
    block_n, block_k = _block_nk(routing.block_m, n, k, a.device)
    out = torch.empty(routing.num_pairs, n, dtype=a.dtype, device=a.device)
    scale_ptr, stride_se = scale_args(weight, scale)
    _moe_gemm_kernel[(routing.sorted_pairs.numel() // routing.block_m, triton.cdiv(n, block_n))](
        a, weight, scale_ptr, out, topk_weights, routing.sorted_pairs, routing.block_expert, routing.num_padded,
        routing.num_pairs, n, k, a_rows_per_pair,
        a.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), stride_se, out.stride(0),
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, WEIGHTED=weighted,
        SCALED=scale is not None, DOT_DTYPE=dot_dtype(a.dtype, a.device), num_warps=4, num_stages=3,
    )
    return out


def _sorted(hidden, gate_up, down, topk_weights, topk_ids, gate_up_scale, down_scale) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    routing = sort_by_expert(topk_ids, gate_up.shape[0])
    activated = expert_gemm(hidden, gate_up, gate_up_scale, routing, top_k, topk_weights, gated=True, weighted=False)
    weighted = expert_gemm(activated, down, down_scale, routing, 1, topk_weights, gated=False, weighted=True)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
