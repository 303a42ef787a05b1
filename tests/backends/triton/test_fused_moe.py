"""The fused MoE kernels (both paths) against the models' torch path (`fused_moe_torch`), under the interpreter."""
from __future__ import annotations

import pytest
import torch
from corectl.backends.triton.moe.fused_moe import fused_moe, topk_softmax
from corectl.backends.triton.moe.moe_align import align_to_experts
from corectl.backends.triton.reference import align_to_experts_ref
from corectl.models.moe import fused_moe_torch, select_experts
from corectl.quantization.fp8 import quantize_rows
from support.close import BF16_STEP


def moe_inputs(num_tokens, num_experts, hidden_size, inter, top_k, dtype, skip_expert=None):
    hidden = torch.randn(num_tokens, hidden_size).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden_size) / hidden_size ** 0.5).to(dtype)
    down = (torch.randn(num_experts, hidden_size, inter) / inter ** 0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9  # an expert no token chooses: its blocks must not exist
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return hidden, gate_up, down, weights, ids


@pytest.mark.parametrize("path", ["pairs", "sorted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "num_experts", "hidden_size", "inter", "top_k"), [
    (1, 8, 32, 16, 2),     # decode: one token, pairs in separate blocks
    (5, 4, 40, 24, 2),     # widths that are not powers of two: masked columns and reduction
    (21, 3, 48, 20, 2),    # more pairs per expert than one row block
    (2, 8, 32, 16, 3),     # a top-k that is not a power of two
])
def test_fused_moe_matches_the_torch_path(num_tokens, num_experts, hidden_size, inter, top_k, dtype, path,
                                          assert_close):
    inputs = moe_inputs(num_tokens, num_experts, hidden_size, inter, top_k, dtype, skip_expert=num_experts - 1)
    out, ref = fused_moe(*inputs, path=path), fused_moe_torch(*inputs)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert_close(out, ref)
    else:
        # The reference rounds silu(gate), the product and each expert's output to bf16; the kernel
        # rounds the activation and the weighted output once each: a few bf16 steps of the scale.
        assert_close(out, ref, 4 * BF16_STEP, norm="max")


def fp8_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked [E, N, K] weights as the FP8 method serves them: e4m3 [E, N, K], fp32 row scales [E, N]."""
    quantized, scale = quantize_rows(weight.reshape(-1, weight.shape[-1]))
    return quantized.view(weight.shape), scale.view(weight.shape[:2])


@pytest.mark.parametrize("path", ["pairs", "sorted"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "hidden_size", "inter", "top_k"), [
    (1, 8, 32, 16, 2), (5, 4, 40, 24, 2), (21, 3, 48, 20, 2),
])
def test_fp8_experts_match_the_torch_path_with_scales(num_tokens, num_experts, hidden_size, inter, top_k, path):
    """e4m3 weights widened in the kernel, each output row's fp32 sum scaled: the torch path's W8A16
    (fp32 activations, as the other interpreter tests: bf16 dots are not exact under it). Scales
    far from 1 per row and per expert catch a scale applied to the wrong row, expert or GEMM."""
    hidden, gate_up, down, weights, ids = moe_inputs(num_tokens, num_experts, hidden_size, inter, top_k,
                                                     torch.float32, skip_expert=num_experts - 1)
    gate_up_q, gate_up_scale = fp8_experts(gate_up * torch.rand(num_experts, 2 * inter, 1) * 10)
    down_q, down_scale = fp8_experts(down * torch.rand(num_experts, hidden_size, 1) * 10)
    scales = {"gate_up_scale": gate_up_scale, "down_scale": down_scale}
    out = fused_moe(hidden, gate_up_q, down_q, weights, ids, path=path, **scales)
    ref = fused_moe_torch(hidden, gate_up_q, down_q, weights, ids, **scales)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    dequantized = fused_moe_torch(hidden, gate_up_q.float() * gate_up_scale[..., None], down_q.float()
                                  * down_scale[..., None], weights, ids)
    torch.testing.assert_close(ref, dequantized, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_fp8_launcher_refuses_scales_that_do_not_fit():
    hidden, gate_up, down, weights, ids = moe_inputs(3, 4, 32, 16, 2, torch.float32)
    (gate_up_q, gate_up_scale), (down_q, down_scale) = fp8_experts(gate_up), fp8_experts(down)
    with pytest.raises(ValueError, match="come together"):
        fused_moe(hidden, gate_up_q, down_q, weights, ids, gate_up_scale=gate_up_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe(hidden, gate_up, down, weights, ids, gate_up_scale=gate_up_scale, down_scale=down_scale)
    with pytest.raises(ValueError, match=r"down_scale must be a contiguous float32 \[E, rows\]"):
        fused_moe(hidden, gate_up_q, down_q, weights, ids, gate_up_scale=gate_up_scale, down_scale=down_scale[:, :8])


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), [
    (5, 2, 4, 16),       # an expert with no pairs
    (1, 8, 128, 16),     # decode at Qwen3-30B-A3B's routing: more experts than pairs
    (700, 3, 6, 64),     # several steps per program, several blocks per expert
    (2600, 2, 20, 16),   # more pairs than MAX_PROGRAMS steps: programs take several steps each
])
def test_align_equals_the_reference(num_tokens, top_k, num_experts, block_m):
    topk_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    if num_experts > 4:
        topk_ids[topk_ids == 1] = 0  # expert 1 unused (a pair may now repeat an expert: allowed)
    for got, want in zip(align_to_experts(topk_ids, num_experts, block_m),
                         align_to_experts_ref(topk_ids, num_experts, block_m)):
        assert torch.equal(got, want)


def test_align_puts_each_pair_once_in_a_block_of_its_expert():
    topk_ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 1], [1, 0]])
    block_m, num_pairs = 16, topk_ids.numel()
    sorted_pairs, block_expert, num_padded = align_to_experts_ref(topk_ids, 4, block_m)
    used = int(num_padded)
    assert used == 3 * block_m  # experts 0, 1, 2 have pairs, expert 3 none
    assert sorted_pairs[:block_m].tolist()[:3] == [1, 4, 9] and block_expert.tolist()[:3] == [0, 1, 2]
    real = sorted_pairs[:used][sorted_pairs[:used] < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (sorted_pairs[used:] == num_pairs).all()
    # The buffers depend only on the number of pairs (static shapes for CUDA graphs).
    other = align_to_experts(torch.zeros_like(topk_ids), 4, block_m)
    assert other[0].shape == sorted_pairs.shape and other[1].shape == block_expert.shape


def test_launcher_refuses_inputs_that_do_not_fit():
    hidden, gate_up, down, weights, ids = moe_inputs(3, 4, 32, 16, 2, torch.float32)
    with pytest.raises(ValueError, match=r"down must be \[E, H, I\]"):
        fused_moe(hidden, gate_up, down[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_moe(hidden.bfloat16(), gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        fused_moe(hidden, gate_up, down, weights.double(), ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights must both be"):
        fused_moe(hidden[:2], gate_up, down, weights, ids)
    with pytest.raises(ValueError, match=r"topk_ids values must lie in \[0, 4\)"):
        fused_moe(hidden, gate_up, down, weights, ids + 3)
    with pytest.raises(ValueError, match="path must be 'pairs' or 'sorted'"):
        fused_moe(hidden, gate_up, down, weights, ids, path="dense")
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        fused_moe(hidden, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down, weights, ids)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (20, 3), (128, 8)])
def test_topk_softmax_routes_like_select_experts(num_experts, top_k, renormalize):
    logits = torch.randn(9, num_experts) * 3
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="top_k must lie in"):
        topk_softmax(logits, num_experts + 1, renormalize)


def test_topk_softmax_breaks_ties_toward_the_lower_expert():
    """Equal probabilities (a router's duplicated rows, or logits that round alike) pick the lower
    expert first: the kernel's documented order, which torch.topk leaves unspecified."""
    logits = torch.full((2, 16), -2.0)
    logits[0, [11, 4, 7]] = 1.5
    logits[1, [9, 3]] = 0.5
    logits[1, 12] = 3.0
    weights, ids = topk_softmax(logits, 3, renormalize=True)
    assert ids.tolist() == [[4, 7, 11], [12, 3, 9]]
    assert torch.allclose(weights[0], torch.full((3,), 1 / 3))
    assert weights[1, 1] == weights[1, 2] and torch.allclose(weights.sum(dim=1), torch.ones(2))
