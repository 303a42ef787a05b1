"""gpt-oss's MXFP4 experts in the fused MoE paths, the weights dequantized on the fly inside the K loop.

The weights stay packed as the checkpoint stores them (`corectl.quantization.mxfp4`, whose loader
splits gate_up's interleaved rows into gate rows then up rows): `blocks` uint8 [E, N, K / 32, 16],
byte j of a group holding inputs 2j (low nibble) and 2j + 1 (high nibble) as e2m1 codes, and
`scales` uint8 [E, N, K / 32], the group's e8m0 exponent (2^(s - 127)). A kernel reads a tile of
bytes, decodes its low codes (the even inputs) and high codes (the odd inputs) separately and
multiplies them with the even and odd activations (split in registers after one contiguous load):
the interleaved weight row is never assembled. A weight costs 4.25 bits of memory traffic.

The sorted path decodes with bit moves (`_e2m1_tiny`: a code's bits placed in an fp32 are the value
times 2^-126, exactly, magnitude 1 as fp32's subnormal 2^-127): two shifts and a LOP3 a code. The
2^126 comes back with the group's scale: 2^(s - 65) (`_e8m0_high`) times the 2^64 the activations
are shifted by (`X_SHIFT`); it scales the decoded tile (and shifts fp16 tiles rather than fp16
activations, which 2^64 would overflow). Limits of that split: scales past 2^65 (e8m0 > 192; none in
checkpoints) read as inf, and groups whose scaled terms fall below fp32's range add nothing.

The pairs path's GEMVs were bound by the integer pipe decoding (an H100 SM issues 64 integer ops a
clock against 128 fp32 ones; at 4 a code they read 1.2 TB/s). They read a group's 16 bytes as four
int32 words (a 16-byte vector a thread) and build each code's fp32 with byte permutes
(`mxfp4_decode.decode_words`: 15 integer ops a word of 8 codes; 9 instructions a byte on sm_90 for
gate/up, 14 before), the subnormal 16 |value| * 2^-133; the activations carry X_SHIFT so products
stay normal, and each group's sum takes 2^(s - 62) (`mxfp4_pairs._e8m0_pairs`; scales past 2^62
read as inf).

gpt-oss's experts add a bias to both projections and gate with the clamped SwiGLU
(`corectl.models.gpt_oss.clamped_swiglu`): the gate/up kernels add their rows' biases to the fp32
sums, then apply it; the down kernels add the expert's bias before the routing weight.

Routing and the sorted path's sort are fused_moe.py's (`topk_route`/`topk_softmax`, `sort_by_expert`):
- pairs (decode batches, `mxfp4_pairs.py`): `_mx_pair_gate_up_kernel` per (pair, column block),
  `_mx_pair_down_kernel` per (token, column block), GEMVs streaming the packed rows along K
  (moe_pairs.py's structure), fp32 accumulators per row and group, launched by a rule of the shape (`pair_config`;
  `benchmarks/mxfp4_moe_bench.py --sweep` times its candidates), with PDL; from router logits
  (`routed_mxfp4_moe`) they take the top-k themselves, with no routing launch;
- sorted (prefill and larger batches): `_mx_moe_gemm_kernel`, tensor-core dots of bf16 activations
  with the decoded weight tiles, fp32 accumulation.
Nothing reads back to the host, so decode steps capture in CUDA graphs. The reference is
dequantize-then-torch (`corectl.quantization.mxfp4.mxfp4_dequantize`, `fused_moe_torch`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.paged_softmax import dot_dtype
from ..checks import check_float, check_index, check_range, check_same_device, require
from .fused_moe import sort_by_expert, topk_softmax
from .mxfp4_decode import GROUP, X_SHIFT, Mxfp4Stack, clamped_swiglu, strides
from .mxfp4_pairs import PairConfig, Routing, by_pair

@triton.jit
def _e2m1_tiny(packed):
    """Bytes (int32) -> their low and high e2m1 codes as fp32 values times 2^-126, from bit moves
    alone: a code's exponent and mantissa bits under fp32's exponent field and mantissa top bit
    give exactly that (magnitude 1, e = 0, is fp32's subnormal 2^-127: the kernels' fp32 arithmetic
    keeps subnormals, Triton emits no flush-to-zero), its sign bit at bit 31."""
    lo = ((packed << 22) & 0x01C00000) | ((packed << 28) & -0x80000000)
    hi = ((packed << 18) & 0x01C00000) | ((packed << 24) & -0x80000000)
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_high(scales):
    """e8m0 scales (uint8) -> 2^(s - 65) in fp32: the exponent field s + 62. Past 192 (scales over
    2^65, which no checkpoint has) it is inf."""
    return ((tl.minimum(scales.to(tl.int32), 193) + 62) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_dot(acc, a_even, a_odd, byte_ptrs, scale_ptrs, byte_mask, scale_mask, DOT_DTYPE: tl.constexpr,
            SHIFT_A: tl.constexpr):
    """acc + a @ W for a [BLOCK_K / 2, BLOCK_N] tile of packed bytes, as the even and odd halves'
    two dots; X_SHIFT is in the activations (SHIFT_A) or else put in the tile here. The tile's
    [BLOCK_K / 32, BLOCK_N] group scales are read once and spread over their 16 bytes in registers."""
    packed = tl.load(byte_ptrs, mask=byte_mask, other=0).to(tl.int32)
    scale = _e8m0_high(tl.load(scale_ptrs, mask=scale_mask, other=0))
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (scale.shape[0], 16, scale.shape[1])), packed.shape)
    lo, hi = _e2m1_tiny(packed)
    lo, hi = lo * scale, hi * scale
    if not SHIFT_A:
        lo, hi = lo * X_SHIFT, hi * X_SHIFT
    acc = tl.dot(a_even, lo.to(DOT_DTYPE), acc, input_precision="ieee")
    return tl.dot(a_odd, hi.to(DOT_DTYPE), acc, input_precision="ieee")


@triton.jit
def _mx_moe_gemm_kernel(
    a_ptr, blocks_ptr, scales_ptr, bias_ptr, out_ptr, pair_weight_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_padded_ptr, num_pairs, N, K, a_rows_per_pair,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_om, alpha, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, WEIGHTED: tl.constexpr, DOT_DTYPE: tl.constexpr, SHIFT_A: tl.constexpr,
):
    """fused_moe's `_moe_gemm_kernel` on packed weights, biased: GATED stores
    clamped_swiglu(gate + bias, up + bias) of gate rows [0, N) and up rows [N, 2N); otherwise
    (down) the rows plus bias, times the pair's routing weight when WEIGHTED."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = a_ptr + (pairs // a_rows_per_pair).to(tl.int64)[:, None] * stride_am
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    byte_rows = blocks_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    scale_rows = scales_ptr + expert * stride_se + offs_n[None, :] * stride_sn
    half, groups = tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # One contiguous (vectorised) load of the rows, split into even and odd inputs in registers.
        a = tl.load(a_rows + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        if SHIFT_A:
            a = a.to(tl.float32) * X_SHIFT
        a_even, a_odd = tl.split(tl.reshape(a.to(DOT_DTYPE), (BLOCK_M, BLOCK_K // 2, 2)))
        byte = (k0 // 2 + half)[:, None]
        group = (k0 // 32 + groups)[:, None]
        byte_mask = (k0 + 2 * half < K)[:, None] & n_ok[None, :]
        scale_mask = (k0 + 32 * groups < K)[:, None] & n_ok[None, :]
        acc = _mx_dot(acc, a_even, a_odd, byte_rows + byte, scale_rows + group, byte_mask, scale_mask, DOT_DTYPE,
                      SHIFT_A)
        if GATED:
            acc_up = _mx_dot(acc_up, a_even, a_odd, byte_rows + N * stride_bn + byte,
                             scale_rows + N * stride_sn + group, byte_mask, scale_mask, DOT_DTYPE, SHIFT_A)
    bias_row = bias_ptr + expert * stride_bias + offs_n
    acc += tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc_up += tl.load(bias_row + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = clamped_swiglu(acc, acc_up, alpha, limit)
    if WEIGHTED:
        acc *= tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _check_stack(name: str, stack: Mxfp4Stack, num_experts: int | None, rows: int, k: int) -> None:
    blocks, scales, bias = stack
    for part, tensor, ndim in (("blocks", blocks, 4), ("scales", scales, 3)):
        require(isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 and tensor.dim() == ndim
                and tensor.is_contiguous(), f"{name}_{part} must be a contiguous {ndim}-dimensional uint8 tensor, "
                f"got {getattr(tensor, 'dtype', type(tensor))} {list(getattr(tensor, 'shape', []))}")
    e = blocks.shape[0] if num_experts is None else num_experts
    require(tuple(blocks.shape) == (e, rows, k // GROUP, GROUP // 2) and tuple(scales.shape) == (e, rows, k // GROUP),
            f"{name}_blocks and {name}_scales must be [{e}, {rows}, {k // GROUP}, 16] and [{e}, {rows}, {k // GROUP}], "
            f"got {list(blocks.shape)} and {list(scales.shape)}")
    check_float(f"{name}_bias", bias, 2)
    require(tuple(bias.shape) == (e, rows) and bias.stride(1) == 1,
            f"{name}_bias must be [{e}, {rows}] contiguous in its last dimension, got {list(bias.shape)}")


def _check_experts(hidden, gate_up: Mxfp4Stack, down: Mxfp4Stack) -> None:
    check_float("hidden", hidden, 2)
    require(hidden.stride(1) == 1, "hidden must be contiguous in its last dimension")
    hidden_size = hidden.shape[1]
    require(gate_up.blocks.dim() == 4 and gate_up.blocks.shape[1] % 2 == 0 and hidden_size % GROUP == 0,
            f"gate_up_blocks must be [E, 2I, H / 32, 16] with H = {hidden_size} a multiple of {GROUP}, "
            f"got {list(gate_up.blocks.shape)}")
    num_experts, inter = gate_up.blocks.shape[0], gate_up.blocks.shape[1] // 2
    require(inter % GROUP == 0, f"the experts' intermediate rows ({inter}) must be a multiple of {GROUP}")
    _check_stack("gate_up", gate_up, None, 2 * inter, hidden_size)
    _check_stack("down", down, num_experts, hidden_size, inter)
    check_same_device(hidden=hidden, gate_up_blocks=gate_up.blocks, gate_up_scales=gate_up.scales,
                      gate_up_bias=gate_up.bias, down_blocks=down.blocks, down_scales=down.scales, down_bias=down.bias)


def _check_inputs(hidden, gate_up: Mxfp4Stack, down: Mxfp4Stack, topk_weights, topk_ids, check_indices) -> None:
    _check_experts(hidden, gate_up, down)
    num_experts = gate_up.blocks.shape[0]
    check_float("topk_weights", topk_weights, 2)
    check_index("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    check_same_device(hidden=hidden, topk_weights=topk_weights, topk_ids=topk_ids)
    require(topk_weights.dtype == torch.float32 and topk_ids.shape == topk_weights.shape
            and topk_ids.shape[0] == hidden.shape[0] and topk_weights.is_contiguous() and topk_ids.is_contiguous(),
            f"topk_weights (float32) and topk_ids must both be contiguous [T, k] with T = {hidden.shape[0]}, "
            f"got {topk_weights.dtype} {list(topk_weights.shape)} and {list(topk_ids.shape)}")
    if check_indices:
        check_range("topk_ids", topk_ids, 0, num_experts)


def _gemm_tiles(n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the sorted path. The interpreter pays per operation, not per element:
    there, tiles as wide as the tests' small matrices (fewer programs and K steps)."""
    if device.type == "cpu":
        return max(16, min(64, triton.next_power_of_2(n))), 64
    return 64, 128


def _expert_gemm(a, stack: Mxfp4Stack, routing, a_rows_per_pair, topk_weights, alpha, limit, *, gated: bool):
    n = stack.blocks.shape[1] // 2 if gated else stack.blocks.shape[1]
    k = stack.blocks.shape[2] * GROUP
    block_n, block_k = _gemm_tiles(n, a.device)
    out = torch.empty(routing.num_pairs, n, dtype=a.dtype, device=a.device)
    _mx_moe_gemm_kernel[(routing.sorted_pairs.numel() // routing.block_m, triton.cdiv(n, block_n))](
        a, stack.blocks, stack.scales, stack.bias, out, topk_weights, routing.sorted_pairs, routing.block_expert,
        routing.num_padded, routing.num_pairs, n, k, a_rows_per_pair, a.stride(0), *strides(stack), out.stride(0),
        alpha, limit, BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, WEIGHTED=not gated,
        DOT_DTYPE=dot_dtype(a.dtype, a.device), num_warps=4, num_stages=3,
        # fp16 activations would overflow at 2^64: their weight tiles take the shift (a multiply more).
        SHIFT_A=a.dtype != torch.float16,
    )
    return out


def _sorted(hidden, gate_up: Mxfp4Stack, down: Mxfp4Stack, topk_weights, topk_ids, alpha, limit) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    routing = sort_by_expert(topk_ids, gate_up.blocks.shape[0])
    activated = _expert_gemm(hidden, gate_up, routing, top_k, topk_weights, alpha, limit, gated=True)
    weighted = _expert_gemm(activated, down, routing, 1, topk_weights, alpha, limit, gated=False)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


def mxfp4_moe(hidden: torch.Tensor, gate_up: Mxfp4Stack, down: Mxfp4Stack, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, alpha: float, limit: float, *, check_indices: bool = True,
              path: str | None = None, pair_configs: tuple[PairConfig, PairConfig] | None = None) -> torch.Tensor:
    """hidden [T, H] (bf16, or fp32); gate_up: packed [E, 2I, H] (gate rows, then up rows) with
    bias [E, 2I]; down: packed [E, H, I] with bias [E, H]; topk_weights [T, k] fp32, topk_ids
    [T, k] -> [T, H] in hidden's dtype: sum_j w[t, j] * (down_j @ clamped_swiglu(gate_up_j @ x_t +
    b_j) + c_j). `check_indices` and `path` as in `fused_moe.fused_moe`; `pair_configs` (gate/up,
    down) overrides `pair_config` on the pairs path (the benchmark's sweep)."""
    _check_inputs(hidden, gate_up, down, topk_weights, topk_ids, check_indices)
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(hidden)
    if path is None:
        path = "pairs" if num_tokens * top_k <= gate_up.blocks.shape[0] // 2 else "sorted"
    require(path in ("pairs", "sorted"), f"path must be 'pairs' or 'sorted', got {path!r}")
    if path == "pairs":
        return by_pair(hidden, gate_up, down, Routing(top_k, topk_weights, topk_ids), float(alpha), float(limit),
                        pair_configs)
    return _sorted(hidden, gate_up, down, topk_weights, topk_ids, float(alpha), float(limit))


def routed_mxfp4_moe(hidden: torch.Tensor, router_logits: torch.Tensor, gate_up: tuple, down: tuple,
                     top_k: int, renormalize: bool, alpha: float, limit: float, *,
                     pair_configs: tuple[PairConfig, PairConfig] | None = None) -> torch.Tensor:
    """The `mxfp4_moe` kernel a worker hands `corectl.quantization.mxfp4` (gate_up and down as
    (blocks, scales, bias) tuples): routing (`topk_softmax`) then `mxfp4_moe`, or for decode
    batches the pairs path routing inside its kernels (one launch fewer). Expert ids come from that
    top-k (always in range): not read back to check. `pair_configs` as in `mxfp4_moe`."""
    gate_up, down = Mxfp4Stack(*gate_up), Mxfp4Stack(*down)
    check_float("router_logits", router_logits, 2)
    num_tokens, num_experts = router_logits.shape
    require(num_tokens == hidden.shape[0] and num_experts == gate_up.blocks.shape[0] and 0 < top_k <= num_experts
            and router_logits.stride(1) == 1,
            f"router_logits must be [T={hidden.shape[0]}, E={gate_up.blocks.shape[0]}] contiguous in its last "
            f"dimension with top_k in [1, E], got {list(router_logits.shape)} and top_k {top_k}")
    if 0 < num_tokens * top_k <= num_experts // 2:
        _check_experts(hidden, gate_up, down)
        check_same_device(hidden=hidden, router_logits=router_logits)
        return by_pair(hidden, gate_up, down, Routing(top_k, logits=router_logits, renormalize=renormalize),
                        float(alpha), float(limit), pair_configs)
    topk_weights, topk_ids = topk_softmax(router_logits, top_k, renormalize)
    return mxfp4_moe(hidden, gate_up, down, topk_weights, topk_ids, alpha, limit, check_indices=False)
