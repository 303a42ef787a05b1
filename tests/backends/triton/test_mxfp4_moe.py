"""The MXFP4 MoE kernels (both paths) against dequantize-then-torch (`mxfp4_dequantize`, then the
models' `fused_moe_torch` with gpt-oss's biases and clamped SwiGLU), under the interpreter."""
from __future__ import annotations

import functools

import pytest
import torch
from corectl.backends.triton.moe.mxfp4_moe import Mxfp4Stack, mxfp4_moe, routed_mxfp4_moe
from corectl.models.gpt_oss import clamped_swiglu
from corectl.models.moe import fused_moe_torch, select_experts
from corectl.quantization.mxfp4 import mxfp4_dequantize

ALPHA, LIMIT = 1.702, 1.5


def packed_stack(num_experts: int, rows: int, k: int, scale_low: int, scale_high: int) -> Mxfp4Stack:
    """Random codes (every one of the 16, both nibbles), e8m0 scales drawn from [low, high], a bias."""
    blocks = torch.randint(0, 256, (num_experts, rows, k // 32, 16), dtype=torch.uint8)
    scales = torch.randint(scale_low, scale_high + 1, (num_experts, rows, k // 32), dtype=torch.uint8)
    return Mxfp4Stack(blocks, scales, torch.randn(num_experts, rows) / 4)


def reference(hidden, gate_up: Mxfp4Stack, down: Mxfp4Stack, weights, ids) -> torch.Tensor:
    dense = [mxfp4_dequantize(stack.blocks, stack.scales, torch.float32) for stack in (gate_up, down)]
    return fused_moe_torch(hidden, *dense, weights, ids, gate_up_bias=gate_up.bias, down_bias=down.bias,
                           activation=functools.partial(clamped_swiglu, alpha=ALPHA, limit=LIMIT))


def experts(num_tokens, num_experts, hidden_size, inter, top_k, scales=(122, 126)):
    """Inputs scaled so the clamp is reached by some gate and up sums and not by all."""
    hidden = torch.randn(num_tokens, hidden_size) / 4
    gate_up = packed_stack(num_experts, 2 * inter, hidden_size, *scales)
    down = packed_stack(num_experts, hidden_size, inter, *scales)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts), top_k, renormalize=True)
    return hidden, gate_up, down, weights, ids


@pytest.mark.parametrize(("num_tokens", "num_experts", "hidden_size", "inter", "top_k", "path"), [
    *[(*shape, path) for path in ("pairs", "sorted") for shape in (
        (1, 8, 64, 32, 2),    # decode: one token
        (3, 4, 96, 64, 4),    # a few tokens, every expert chosen, groups that do not fill a step
        (2, 6, 32, 96, 3),    # a top-k that is not a power of two, intermediate rows over one column block
    )],
    (20, 3, 64, 32, 2, "sorted"),  # more pairs per expert than one row block
])
def test_mxfp4_moe_matches_dequantize_then_torch(num_tokens, num_experts, hidden_size, inter, top_k, path,
                                                 assert_close):
    hidden, gate_up, down, weights, ids = experts(num_tokens, num_experts, hidden_size, inter, top_k)
    out = mxfp4_moe(hidden, gate_up, down, weights, ids, ALPHA, LIMIT, path=path)
    assert_close(out, reference(hidden, gate_up, down, weights, ids))


@pytest.mark.parametrize("path", ["pairs", "sorted"])
def test_e8m0_extremes(path, assert_close):
    """Scales from 0 (2^-127, fp32's one subnormal scale) to 2^10 in one layer: each row's first
    group at 2^-127 or 2^-126, its last at 2^10 or 2^-19 by expert, those between at 1 or 2^-10.
    A scale decoded one step off, applied to the wrong group, or the subnormal decoded wrongly
    moves the sums far off. No clamp: it would hide the gate and up sums."""
    hidden, gate_up, down, weights, ids = experts(3, 4, 128, 64, 2, scales=(0, 1))
    for stack in (gate_up, down):
        stack.scales[..., 1:-1] = 127 - 10 * torch.randint(0, 2, stack.scales[..., 1:-1].shape, dtype=torch.uint8)
        stack.scales[:2, :, -1] = 137
        stack.scales[2:, :, -1] = 108
    out = mxfp4_moe(hidden, gate_up, down, weights, ids, ALPHA, 1e9, path=path)
    dense = [mxfp4_dequantize(stack.blocks, stack.scales, torch.float32) for stack in (gate_up, down)]
    assert dense[0].abs().amax() == 6 * 2.0 ** 10 and dense[0][dense[0] != 0].abs().amin() == 0.5 * 2.0 ** -127
    ref = fused_moe_torch(hidden, *dense, weights, ids, gate_up_bias=gate_up.bias, down_bias=down.bias,
                          activation=functools.partial(clamped_swiglu, alpha=ALPHA, limit=1e9))
    # Sums of terms 2^30 apart cancel: fp32 noise relative to the whole output, not each element.
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_activations(dtype, assert_close):
    """fp16 activations (the sorted path shifts their weight tiles by 2^64 instead: it would overflow
    them) and bf16 ones, against the reference on the same rounded inputs."""
    hidden, gate_up, down, weights, ids = experts(20, 3, 64, 32, 2)
    hidden = hidden.to(dtype)
    out = mxfp4_moe(hidden, gate_up, down, weights, ids, ALPHA, LIMIT, path="sorted")
    assert out.dtype == dtype
    assert_close(out, reference(hidden.float(), gate_up, down, weights, ids), 2e-2)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(3, 8, 4), (2, 16, 4)])
def test_routed_entry_point_routes_like_select_experts(num_tokens, num_experts, top_k, assert_close, monkeypatch):
    """The kernel the worker provides: gpt-oss's router softmax over the top k, then the experts
    (3 tokens: topk_softmax, then the sorted path; 2 of 16 experts: the pairs kernels route, with
    no routing launch)."""
    from corectl.backends.triton.moe import mxfp4_moe as module

    routings = []
    real_topk = module.topk_softmax
    monkeypatch.setattr(module, "topk_softmax", lambda *args: routings.append(1) or real_topk(*args))
    hidden, gate_up, down, _, _ = experts(num_tokens, num_experts, 64, 32, top_k)
    logits = torch.randn(num_tokens, num_experts)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    out = routed_mxfp4_moe(hidden, logits, tuple(gate_up), tuple(down), top_k, True, ALPHA, LIMIT)
    assert bool(routings) == (num_tokens * top_k > num_experts // 2)
    assert_close(out, reference(hidden, gate_up, down, weights, ids))


def test_bad_shapes_are_refused():
    hidden, gate_up, down, weights, ids = experts(2, 4, 64, 32, 2)
    with pytest.raises(ValueError, match="down_blocks and down_scales must be"):
        mxfp4_moe(hidden, gate_up, down._replace(blocks=down.blocks[:, :32].contiguous()), weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="gate_up_scales must be a contiguous 3-dimensional uint8"):
        mxfp4_moe(hidden, gate_up._replace(scales=gate_up.scales.float()), down, weights, ids, ALPHA, LIMIT)


_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
from corectl.backends.triton.moe import mxfp4_pairs as pairs
pairs.device_sms = lambda device: 132
for routed in (True, False):
    ids, weights = ("*bf16", "*bf16") if routed else ("*i32", "*fp32")
    routing = dict(ids_ptr=ids, weights_ptr=weights, logits_ptr="*bf16", out_ptr=None, N="i32", K="i32", stride_l="i32",
                   num_experts="i32")
    for kernel, x, out, rows, programs in ((pairs._mx_pair_gate_up_kernel, "x_ptr", "*fp32", 2880, 4),
                                           (pairs._mx_pair_down_kernel, "act_ptr", "*bf16", 2880, 1)):
        cfg = pairs.pair_config(rows, programs, 2880, torch.device("cuda"))
        meta = dict(TOP_K=4, BLOCK_TOP_K=4, BLOCK_E=32, RENORMALIZE=True, FROM_LOGITS=routed, BLOCK_N=cfg.block_n,
                    GROUPS=cfg.groups, NUM_STAGES=cfg.num_stages, NATIVE=True, PDL=True)
        names = kernel.arg_names
        types = {x: "*bf16" if x == "x_ptr" else "*fp32", "words_ptr": "*i32", "scales_ptr": "*u8", "bias_ptr": "*bf16",
                 **routing, "out_ptr": out, "alpha": "fp32", "limit": "fp32"}
        signature = {name: "constexpr" if name in meta else types.get(name, "i32") for name in names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=meta),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps))
        assert compiled.asm["cubin"]
print("compiled")
"""


def test_pairs_kernels_compile_for_sm90_with_their_ptx():
    """The pairs kernels' GPU form, which the interpreter never runs (the inline-PTX decode, PDL,
    routing from bf16 logits or from given ids and weights), through Triton's front end and ptxas
    for an H100 at the rule's 1-token launch: a kernel that does not compile fails here, not on the
    device."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
