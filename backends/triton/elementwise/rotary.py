"""Rotary position embedding (neox / rotate_half style, as in Hugging Face Llama), in place, and
the same rotation fused with the per-head q/k RMSNorm that Qwen3 applies just before it.

The fused kernel rounds as the two kernels in sequence do (the normalised row and the weight
product to the model dtype, then the rotation in fp32 with one rounding), in one launch instead of
three per layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_float, check_index, check_range, check_same_device, require
from ..pdl import grid_dependency, pdl_enabled


@triton.jit
def rotated_heads(base, stride_h, w_ptr, eps, cos1, cos2, sin1, sin2, offs_r, r_mask,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads [BLOCK_H, 2 x HALF] at `base` (head h at h * stride_h), per-head RMSNormed (HAS_NORM)
    and rotated: (their first halves, their second halves, the mask), in the input dtype."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & r_mask[None, :]
    first = base + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return ((x1 * cos1[None, :] - x2 * sin1[None, :]).to(dtype), (x2 * cos2[None, :] + x1 * sin2[None, :]).to(dtype),
            mask)


@triton.jit
def rotation_tables(pos_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, HALF: tl.constexpr,
                    BLOCK_R: tl.constexpr):
    """A token's cos and sin halves (fp32), the half-row offsets and their mask. Positions and the
    tables are written before the step (not by the kernel before this one, the q/k projection), so
    their two dependent loads may run while that kernel still does."""
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    cos_row = cos_ptr + pos * stride_cos + offs_r
    sin_row = sin_ptr + pos * stride_sin + offs_r
    cos1 = tl.load(cos_row, mask=r_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF, mask=r_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=r_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF, mask=r_mask, other=0.0).to(tl.float32)
    return cos1, cos2, sin1, sin2, offs_r, r_mask


@triton.jit
def rotate_heads(base, stride_h, w_ptr, eps, cos1, cos2, sin1, sin2, offs_r, r_mask,
                 NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """`rotated_heads`, written back in place."""
    y1, y2, mask = rotated_heads(base, stride_h, w_ptr, eps, cos1, cos2, sin1, sin2, offs_r, r_mask,
                                 NUM_HEADS, BLOCK_H, HALF, HAS_NORM)
    first = base + tl.arange(0, BLOCK_H)[:, None] * stride_h + offs_r[None, :]
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF, y2, mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_R: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2, offs_r, r_mask = rotation_tables(pos_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin,
                                                             HALF, BLOCK_R)
    grid_dependency(PDL)
    rotate_heads(q_ptr + token * stride_qt, stride_qh, q_w_ptr, eps, cos1, cos2, sin1, sin2, offs_r, r_mask,
                 NUM_Q_HEADS, BLOCK_QH, HALF, HAS_NORM)
    rotate_heads(k_ptr + token * stride_kt, stride_kh, k_w_ptr, eps, cos1, cos2, sin1, sin2, offs_r, r_mask,
                 NUM_K_HEADS, BLOCK_KH, HALF, HAS_NORM)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, *, check_indices: bool = True) -> None:
    """Rotate the first rot_dim dims of every head of q [T, Hq, D] and k [T, Hk, D] in place.

    cos_cache, sin_cache: [max_positions, rot_dim] (both halves stored, as HF builds them), looked
    up at positions [T]. Math in fp32, one rounding to the input dtype per element.
    `check_indices` reads the positions back to validate them (a GPU synchronisation).
    """
    _check_rotary(positions, q, k, cos_cache, sin_cache, check_indices)
    _launch(positions, q, k, cos_cache, sin_cache, None, None, 0.0)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   *, check_indices: bool = True) -> None:
    """RMSNorm every head of q [T, Hq, D] and k [T, Hk, D] (weights [D]) and then rotate all D dims,
    in place: `rotary_embedding(positions, rms_norm(q), rms_norm(k), ...)` in one launch."""
    check_whole_rotation(positions, q, k, cos_cache, sin_cache, q_weight, k_weight, check_indices, "the fused norm")
    _launch(positions, q, k, cos_cache, sin_cache, q_weight, k_weight, eps)


def check_whole_rotation(positions, q, k, cos_cache, sin_cache, q_weight, k_weight, check_indices: bool,
                         what: str) -> None:
    """`rotary_embedding`'s checks, for a kernel that rotates whole heads (`what` names it), with
    per-head norm weights [D] of q's dtype or none."""
    _check_rotary(positions, q, k, cos_cache, sin_cache, check_indices)
    head_dim = q.shape[2]
    require(cos_cache.shape[1] == head_dim,
            f"{what} rotates whole heads: cos_cache width must be head_dim={head_dim}, got {cos_cache.shape[1]}")
    if q_weight is None and k_weight is None:
        return
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_float(name, weight, 1)
        require(weight.shape[0] == head_dim and weight.dtype == q.dtype,
                f"{name} must be {q.dtype} [{head_dim}], got {weight.dtype} {tuple(weight.shape)}")
        require(weight.stride(0) == 1, f"{name} must be contiguous")
    check_same_device(q=q, q_weight=q_weight, k_weight=k_weight)


def _check_rotary(positions, q, k, cos_cache, sin_cache, check_indices: bool) -> None:
    check_float("q", q, 3)
    check_float("k", k, 3)
    check_float("cos_cache", cos_cache, 2)
    check_float("sin_cache", sin_cache, 2)
    check_index("positions", positions, 1, (torch.int64, torch.int32))
    num_tokens, head_dim = positions.shape[0], q.shape[2]
    require(q.shape[0] == num_tokens and k.shape[0] == num_tokens and k.shape[2] == head_dim,
            f"q [T, Hq, D] and k [T, Hk, D] must match positions [T={num_tokens}] and each other, "
            f"got {tuple(q.shape)} and {tuple(k.shape)}")
    require(q.dtype == k.dtype, f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    require(q.stride(2) == 1 and k.stride(2) == 1, "q and k must be contiguous within each head")
    require(cos_cache.shape == sin_cache.shape,
            f"cos_cache and sin_cache must match, got {tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}")
    require(cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1, "cos_cache and sin_cache rows must be contiguous")
    rot_dim = cos_cache.shape[1]
    require(rot_dim % 2 == 0 and 0 < rot_dim <= head_dim,
            f"cos_cache width (rot_dim) must be even and in (0, head_dim={head_dim}], got {rot_dim}")
    check_same_device(positions=positions, q=q, k=k, cos_cache=cos_cache, sin_cache=sin_cache)
    if check_indices:
        check_range("positions", positions, 0, cos_cache.shape[0])


def _launch(positions, q, k, cos_cache, sin_cache, q_weight, k_weight, eps: float) -> None:
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    half = cos_cache.shape[1] // 2
    has_norm = q_weight is not None
    pdl = pdl_enabled(q.device)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_cache, sin_cache, q_weight if has_norm else q, k_weight if has_norm else k, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0), sin_cache.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half,
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_R=triton.next_power_of_2(half), HAS_NORM=has_norm, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
