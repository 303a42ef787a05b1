"""The MXFP4 MoE's pairs path (decode batches; `mxfp4_moe.py`'s module doc): per (pair, column block)
the gate/up GEMV, per (token, column block) the down GEMV with the token's slots summed, on packed
words decoded by `mxfp4_decode.decode_words`, launched by a rule of the shape (`pair_config`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..gemm.gemv_configs import device_sms
from ..pdl import grid_dependency, pdl_enabled
from .fused_moe import topk_route
from .moe_pairs import token_routes
from .mxfp4_decode import GROUP, X_SHIFT, Mxfp4Stack, clamped_swiglu, decode_words, strides


@triton.jit
def _word_sums(words, x0, x1, x2, x3, x4, x5, x6, x7, NATIVE: tl.constexpr):
    """[BLOCK_N, GROUPS, 4] packed words -> their dot products with the activations (x_j
    [GROUPS, 4]: input 32g + 8w + j) summed over each group, times 2^-129 (`decode_words`)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = decode_words(words, NATIVE)
    # One multiply-add chain (a sum tree would add a multiply and an add for each of half the codes).
    acc = v0 * x0[None]
    acc += v1 * x1[None]
    acc += v2 * x2[None]
    acc += v3 * x3[None]
    acc += v4 * x4[None]
    acc += v5 * x5[None]
    acc += v6 * x6[None]
    acc += v7 * x7[None]
    return tl.sum(acc, 2)


@triton.jit
def _e8m0_pairs(scales):
    """e8m0 scales (uint8) -> 2^(s - 62) in fp32 (2^(s - 127) times the 2^129 of `_word_sums`'
    codes over the X_SHIFT of the activations); past 189 (scales over 2^62) inf."""
    return ((tl.minimum(scales.to(tl.int32), 190) + 65) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_groups(row_ptr, groups, g_ok, factor):
    """The inputs of `groups` ([GROUPS] indices) of an activation row as fp32 times `factor`,
    split in registers after one contiguous load into `_word_sums`' x_0 ... x_7 ([GROUPS, 4])."""
    x = tl.load(row_ptr + groups[:, None] * 32 + tl.arange(0, 32)[None, :], mask=g_ok[:, None], other=0.0)
    x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32) * factor, (groups.shape[0], 4, 2, 2, 2)))
    x0, x4 = tl.split(tl.split(x_even)[0])
    x2, x6 = tl.split(tl.split(x_even)[1])
    x1, x5 = tl.split(tl.split(x_odd)[0])
    x3, x7 = tl.split(tl.split(x_odd)[1])
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_planes(row_ptr, plane, groups, g_ok):
    """x_0 ... x_7 of `groups` from a row stored code-major (`_mx_pair_gate_up_kernel`'s output:
    input 32g + 8w + j at j * plane + 4g + w): eight loads in the words' own layout, no exchange
    of activations between threads a step."""
    offs = groups[:, None] * 4 + tl.arange(0, 4)[None, :]
    mask = g_ok[:, None]
    return (tl.load(row_ptr + offs, mask=mask, other=0.0), tl.load(row_ptr + plane + offs, mask=mask, other=0.0),
            tl.load(row_ptr + 2 * plane + offs, mask=mask, other=0.0),
            tl.load(row_ptr + 3 * plane + offs, mask=mask, other=0.0),
            tl.load(row_ptr + 4 * plane + offs, mask=mask, other=0.0),
            tl.load(row_ptr + 5 * plane + offs, mask=mask, other=0.0),
            tl.load(row_ptr + 6 * plane + offs, mask=mask, other=0.0),
            tl.load(row_ptr + 7 * plane + offs, mask=mask, other=0.0))


@triton.jit
def _mx_group_sums(word_ptrs, scale_ptrs, word_mask, scale_mask, x0, x1, x2, x3, x4, x5, x6, x7, NATIVE: tl.constexpr):
    """[BLOCK_N, GROUPS] true group dot products of packed rows (`_word_sums` scaled)."""
    words = tl.load(word_ptrs, mask=word_mask, other=0, eviction_policy="evict_first")
    scale = _e8m0_pairs(tl.load(scale_ptrs, mask=scale_mask, other=0, eviction_policy="evict_first"))
    return _word_sums(words, x0, x1, x2, x3, x4, x5, x6, x7, NATIVE) * scale


@triton.jit
def _word_offsets(offs_n, stride_wn, groups):
    """[BLOCK_N, GROUPS, 4] word offsets of rows' groups: a group's four words are 16 aligned
    bytes (rows are K / 8 words, K a multiple of 32), one vector load a thread."""
    offs = offs_n[:, None, None] * stride_wn + groups[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    return tl.max_contiguous(tl.multiple_of(offs, (1, 1, 4)), (1, 1, 4))


@triton.jit
def _routes(ids_ptr, weights_ptr, logits_ptr, stride_l, num_experts, token, TOP_K: tl.constexpr,
            BLOCK_TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, FROM_LOGITS: tl.constexpr):
    """(slot lanes, expert ids, routing weights) of a token: as given, or (FROM_LOGITS) the top-k of
    its router logits taken here (`topk_route`: every program of the token picks the same), which
    saves decode the routing kernel's launch."""
    if FROM_LOGITS:
        slots, coeffs, experts = topk_route(logits_ptr + token * stride_l, num_experts, TOP_K, RENORMALIZE, BLOCK_E,
                                            BLOCK_TOP_K)
        experts = experts.to(tl.int64)
    else:
        slots, experts, coeffs = token_routes(ids_ptr, weights_ptr, token, TOP_K, BLOCK_TOP_K)
    return slots, experts, coeffs.to(tl.float32)


@triton.jit
def _mx_pair_gate_up_kernel(x_ptr, words_ptr, scales_ptr, bias_ptr, ids_ptr, weights_ptr, logits_ptr, out_ptr, N, K,
                            stride_l, num_experts, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_bias,
                            stride_om, alpha, limit, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr,
                            BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, FROM_LOGITS: tl.constexpr,
                            BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, NUM_STAGES: tl.constexpr,
                            NATIVE: tl.constexpr, PDL: tl.constexpr):
    """out[pair] = clamped_swiglu(gate[e] @ x + gate_bias, up[e] @ x + up_bias) times the pair's
    routing weight and X_SHIFT, in fp32, code-major (`_x_planes`), for columns [pid_n * BLOCK_N,
    +BLOCK_N) of N; x the pair's token row, e its expert."""
    grid_dependency(PDL)
    pair = tl.program_id(0).to(tl.int64)
    token = pair // TOP_K
    slots, experts, coeffs = _routes(ids_ptr, weights_ptr, logits_ptr, stride_l, num_experts, token, TOP_K,
                                     BLOCK_TOP_K, BLOCK_E, RENORMALIZE, FROM_LOGITS)
    expert = tl.sum(tl.where(slots == pair - token * TOP_K, experts, 0))
    x_row = x_ptr + token * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    g = tl.arange(0, GROUPS)
    gate_words = words_ptr + expert * stride_we + _word_offsets(offs_n, stride_wn, g)
    gate_scales = scales_ptr + expert * stride_se + offs_n[:, None] * stride_sn + g[None, :]
    acc_gate = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    num_groups = K // 32
    for g0 in tl.range(0, num_groups, GROUPS, num_stages=NUM_STAGES):
        g_ok = g0 + g < num_groups
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_groups(x_row, g0 + g, g_ok, X_SHIFT)
        word_mask = n_ok[:, None, None] & g_ok[None, :, None]
        scale_mask = n_ok[:, None] & g_ok[None, :]
        step_words, step_scales = gate_words + g0 * 4, gate_scales + g0
        acc_gate += _mx_group_sums(step_words, step_scales, word_mask, scale_mask, x0, x1, x2, x3, x4, x5, x6, x7,
                                   NATIVE)
        acc_up += _mx_group_sums(step_words + N * stride_wn, step_scales + N * stride_sn, word_mask, scale_mask,
                                 x0, x1, x2, x3, x4, x5, x6, x7, NATIVE)
    bias_row = bias_ptr + expert * stride_bias + offs_n
    gate = tl.sum(acc_gate, 1) + tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)
    up = tl.sum(acc_up, 1) + tl.load(bias_row + N, mask=n_ok, other=0.0).to(tl.float32)
    # For the down kernel: fp32 times the pair's routing weight and X_SHIFT, stored code-major
    # (`_x_planes`).
    coeff = tl.sum(tl.where(slots == pair - token * TOP_K, coeffs, 0.0)) * X_SHIFT
    tl.store(out_ptr + pair * stride_om + (offs_n % 8) * (N // 8) + offs_n // 8,
             clamped_swiglu(gate, up, alpha, limit) * coeff, mask=n_ok)


@triton.jit
def _mx_pair_down_kernel(act_ptr, words_ptr, scales_ptr, bias_ptr, ids_ptr, weights_ptr, logits_ptr, out_ptr, N, K,
                         stride_l, num_experts, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_bias,
                         stride_om, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr, FROM_LOGITS: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUPS: tl.constexpr, NUM_STAGES: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """out[token, n] = sum over the token's k pairs, in slot order, of down[e] @ act[pair] + weight *
    down_bias[e], act the gate/up kernel's (weighted). One flat loop over slot and K, as moe_pairs'
    down kernel (its doc says why)."""
    grid_dependency(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    slots, experts, coeffs = _routes(ids_ptr, weights_ptr, logits_ptr, stride_l, num_experts, token, TOP_K,
                                     BLOCK_TOP_K, BLOCK_E, RENORMALIZE, FROM_LOGITS)
    g = tl.arange(0, GROUPS)
    row_words = _word_offsets(offs_n, stride_wn, g)
    num_groups = K // 32
    g_steps = tl.cdiv(num_groups, GROUPS)
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for step in tl.range(0, TOP_K * g_steps, num_stages=NUM_STAGES):
        slot = step // g_steps
        expert = tl.sum(tl.where(slots == slot, experts, 0))
        g0 = (step - slot * g_steps) * GROUPS
        g_ok = g0 + g < num_groups
        # The activations come with the routing weight (and X_SHIFT) in them: a slot's products are
        # weighted already.
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(act_ptr + (token * TOP_K + slot) * stride_am, K // 8, g0 + g, g_ok)
        scale_rows = offs_n[:, None] * stride_sn + (g0 + g)[None, :]
        acc += _mx_group_sums(words_ptr + expert * stride_we + row_words + g0 * 4,
                              scales_ptr + expert * stride_se + scale_rows, n_ok[:, None, None] & g_ok[None, :, None],
                              n_ok[:, None] & g_ok[None, :], x0, x1, x2, x3, x4, x5, x6, x7, NATIVE)
    out = tl.sum(acc, 1)
    for slot in tl.static_range(TOP_K):
        expert = tl.sum(tl.where(slots == slot, experts, 0))
        bias = tl.load(bias_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        out += tl.sum(tl.where(slots == slot, coeffs, 0.0)) * bias
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


class PairConfig(NamedTuple):
    block_n: int
    groups: int
    num_warps: int
    num_stages: int


# Programs a SM the pairs launch aims for: short programs (a few K steps each), many of them, read
# the experts fastest. An H100's sweep (2026-11-27, call 4; us a layer, both kernels): at 1 token
# gate/up in 4-row blocks (2,880 programs) 47.3 against 53.6 in 16-row ones (720) and 62 in 32-row
# ones; at 2 tokens 8-row blocks (2,880) 87.6 against 93.6-101.8; the down kernel best in 4-row
# blocks at 1, 2 and 4 tokens (the narrowest it takes); at 4 tokens on an H200, gate/up in 16-row
# blocks (2,880) 164 against 166-209 for the others. Stages 1-3 moved the 1-2 token ones under 5%.
PROGRAMS_PER_SM = 21


def pair_config(rows: int, programs: int, k: int, device: torch.device) -> PairConfig:
    """A pairs kernel's launch from its shape: column blocks narrowed (down to 4 rows) until the
    grid reaches PROGRAMS_PER_SM programs a SM, then as many groups a step as give each of the 4
    warps' threads one 16-byte vector of a projection's words (BLOCK_N x GROUPS = 128), 3 stages.
    The interpreter pays per operation, not per element: there, tiles as large as the tests' small
    matrices (fewer programs and steps)."""
    if device.type == "cpu":
        return PairConfig(min(64, triton.next_power_of_2(rows)), min(2, triton.next_power_of_2(k // GROUP)), 4, 1)
    block_n = 32
    while block_n > 4 and programs * triton.cdiv(rows, block_n) < PROGRAMS_PER_SM * device_sms(device):
        block_n //= 2
    return PairConfig(block_n, min(128 // block_n, triton.next_power_of_2(k // GROUP)), 4, 3)


def _words(stack: Mxfp4Stack) -> torch.Tensor:
    """The blocks as int32 words [E, N, K / 32, 4]: a group's 16 bytes are four words."""
    return stack.blocks.view(torch.int32)


class Routing(NamedTuple):
    """A pairs launch's routing: the top-k as given, or the router's logits, which the kernels
    route themselves (`_routes`)."""

    top_k: int
    topk_weights: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    renormalize: bool = True

    def args(self) -> tuple:
        """(ids, weights, logits, logits' row stride, experts): unused pointers stand in as another."""
        if self.logits is None:
            return self.topk_ids, self.topk_weights, self.topk_ids, 0, 0
        return self.logits, self.logits, self.logits, self.logits.stride(0), self.logits.shape[1]

    def meta(self) -> dict:
        num_experts = 1 if self.logits is None else self.logits.shape[1]
        return dict(TOP_K=self.top_k, BLOCK_TOP_K=triton.next_power_of_2(self.top_k),
                    BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=self.renormalize,
                    FROM_LOGITS=self.logits is not None)


def by_pair(hidden, gate_up: Mxfp4Stack, down: Mxfp4Stack, routing: Routing, alpha, limit,
             configs: tuple[PairConfig, PairConfig] | None = None) -> torch.Tensor:
    num_tokens, top_k = hidden.shape[0], routing.top_k
    hidden_size, inter = hidden.shape[1], gate_up.blocks.shape[1] // 2
    native, pdl = hidden.device.type == "cuda", pdl_enabled(hidden.device)
    up_cfg, down_cfg = configs or (pair_config(inter, num_tokens * top_k, hidden_size, hidden.device),
                                   pair_config(hidden_size, num_tokens, inter, hidden.device))
    ids, weights, logits, stride_l, num_experts = routing.args()
    activated = torch.empty(num_tokens * top_k, inter, dtype=torch.float32, device=hidden.device)
    words = _words(gate_up)
    _mx_pair_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, up_cfg.block_n))](
        hidden, words, gate_up.scales, gate_up.bias, ids, weights, logits, activated, inter, hidden_size, stride_l,
        num_experts, hidden.stride(0), words.stride(0), words.stride(1), *strides(gate_up)[2:], activated.stride(0),
        alpha, limit, **routing.meta(), BLOCK_N=up_cfg.block_n, GROUPS=up_cfg.groups, NUM_STAGES=up_cfg.num_stages,
        NATIVE=native, PDL=pdl, num_warps=up_cfg.num_warps, launch_pdl=pdl,
    )
    out = torch.empty_like(hidden)
    words = _words(down)
    _mx_pair_down_kernel[(num_tokens, triton.cdiv(hidden_size, down_cfg.block_n))](
        activated, words, down.scales, down.bias, ids, weights, logits, out, hidden_size, inter, stride_l,
        num_experts, activated.stride(0), words.stride(0), words.stride(1), *strides(down)[2:], out.stride(0),
        **routing.meta(), BLOCK_N=down_cfg.block_n, GROUPS=down_cfg.groups, NUM_STAGES=down_cfg.num_stages,
        NATIVE=native, PDL=pdl, num_warps=down_cfg.num_warps, launch_pdl=pdl,
    )
    return out
