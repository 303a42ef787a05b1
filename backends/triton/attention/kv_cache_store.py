"""Write a step's new keys and values into the paged KV cache; or rotate q and k first and store
the rotated keys, in one launch (`rotate_and_store_kvcache`: a layer's rotary embedding and its
cache write are one kernel instead of two, and k is never written back)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import (
    FP8_KV_DTYPE,
    check_cache_dtype,
    check_index,
    check_kv_cache,
    check_kv_scales,
    check_packed_heads,
    check_range,
    check_same_device,
    require,
)
from ..elementwise.rotary import check_whole_rotation, rotate_heads, rotated_heads, rotation_tables
from ..pdl import grid_dependency, pdl_enabled


@triton.jit
def _round_to_e4m3(x):
    """x (fp32) saturated at +-448 and rounded to the nearest e4m3 value, ties to even, in fp32
    arithmetic, so the cast that follows is exact. The cast alone would do on GPUs; Triton's
    interpreter truncates it and loses the carry into the exponent, so the tests would check a
    different rounding than the device runs."""
    x = tl.clamp(x, -448.0, 448.0)
    # e4m3 keeps 3 fraction bits; below 2**-6 the spacing stays 2**-9 (subnormals).
    exponent = tl.maximum(tl.floor(tl.log2(tl.abs(x))), -6.0)
    quantum = tl.exp2(exponent - 3.0)
    # Adding and removing 1.5 * 2**23 rounds |x / quantum| < 2**22 to an integer, ties to even.
    return ((x / quantum + 12582912.0) - 12582912.0) * quantum


@triton.jit
def _store_row(dst, row, inv_scale, mask, FP8: tl.constexpr):
    if FP8:
        # Scaled into e4m3's range and saturated there (e4m3fn has no infinity).
        row = _round_to_e4m3(row.to(tl.float32) * inv_scale)
    tl.store(dst, row.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, k_inv_scale, v_inv_scale,
    stride_kt, stride_vt, stride_kind, stride_blk, stride_tok,
    ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_ROW: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # Slot -1 marks padding tokens (e.g. a CUDA-graph batch padded to its bucket size).
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_ROW)
    mask = offs < ROW
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_tok + offs
    _store_row(dst, tl.load(k_ptr + token * stride_kt + offs, mask=mask), k_inv_scale, mask, FP8)
    _store_row(dst + stride_kind, tl.load(v_ptr + token * stride_vt + offs, mask=mask), v_inv_scale, mask, FP8)


@triton.jit
def _rotate_store_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, slot_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
    k_inv_scale, v_inv_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_cos, stride_sin,
    stride_kind, stride_blk, stride_tok,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr, BLOCK_R: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_ROW: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos1, cos2, sin1, sin2, offs_r, r_mask = rotation_tables(pos_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin,
                                                             HALF, BLOCK_R)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    grid_dependency(PDL)
    rotate_heads(q_ptr + token * stride_qt, stride_qh, q_w_ptr, eps, cos1, cos2, sin1, sin2, offs_r, r_mask,
                 NUM_Q_HEADS, BLOCK_QH, HALF, HAS_NORM)
    # Slot -1 marks padding tokens (e.g. a CUDA-graph batch padded to its bucket size).
    if slot < 0:
        return
    k1, k2, mask = rotated_heads(k_ptr + token * stride_kt, stride_kh, k_w_ptr, eps, cos1, cos2, sin1, sin2, offs_r,
                                 r_mask, NUM_K_HEADS, BLOCK_KH, HALF, HAS_NORM)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_tok
    k_dst = dst + tl.arange(0, BLOCK_KH)[:, None] * (2 * HALF) + offs_r[None, :]
    _store_row(k_dst, k1, k_inv_scale, mask, FP8)
    _store_row(k_dst + HALF, k2, k_inv_scale, mask, FP8)
    offs = tl.arange(0, BLOCK_ROW)
    row_mask = offs < NUM_K_HEADS * 2 * HALF
    _store_row(dst + stride_kind + offs, tl.load(v_ptr + token * stride_vt + offs, mask=row_mask), v_inv_scale,
               row_mask, FP8)


def rotate_and_store_kvcache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             kv_cache: torch.Tensor, slot_mapping: torch.Tensor, cos_cache: torch.Tensor,
                             sin_cache: torch.Tensor, q_weight: torch.Tensor | None = None,
                             k_weight: torch.Tensor | None = None, eps: float = 0.0, *, check_indices: bool = True,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`rotary_embedding` (with `q_weight`/`k_weight`: `qk_norm_rotary`) of whole heads, then
    `store_kvcache`, in one launch and with the same bits: q [T, Hq, D] is rotated in place, k
    [T, Hk, D] is rotated into the cache only (the tensor keeps its input), v [T, Hk * D] is copied."""
    check_whole_rotation(positions, q, k, cos_cache, sin_cache, q_weight, k_weight, check_indices, "the fused store")
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_store(k.flatten(1), v, kv_cache, slot_mapping, check_indices, k_scale, v_scale)
    if num_tokens == 0:
        return
    has_norm, pdl = q_weight is not None, pdl_enabled(q.device)
    half, row = head_dim // 2, num_kv_heads * head_dim
    _rotate_store_kernel[(num_tokens,)](
        positions, q, k, v, kv_cache, slot_mapping, cos_cache, sin_cache, q_weight if has_norm else q,
        k_weight if has_norm else k, eps, 1.0 / k_scale, 1.0 / v_scale, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), cos_cache.stride(0), sin_cache.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=num_kv_heads, HALF=half,
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(half), HAS_NORM=has_norm, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_ROW=triton.next_power_of_2(row), FP8=kv_cache.dtype == FP8_KV_DTYPE, PDL=pdl,
        num_warps=4 if row <= 2048 else 8, launch_pdl=pdl,
    )


def store_kvcache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  *, check_indices: bool = True, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Copy k, v `[T, num_kv_heads * head_dim]` into `kv_cache` at `slot_mapping[T]` (slot -1 = skip).

    `check_indices` reads the slots back to validate them (a device synchronisation on GPUs).
    An FP8 (e4m3) cache stores k / k_scale and v / v_scale, saturated at +-448; the attention
    kernels multiply the scales back.
    """
    _check_store(k, v, kv_cache, slot_mapping, check_indices, k_scale, v_scale)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    row = num_kv_heads * head_dim
    pdl = pdl_enabled(k.device)
    _store_kvcache_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), v.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        ROW=row, BLOCK_SIZE=block_size, BLOCK_ROW=triton.next_power_of_2(row), FP8=kv_cache.dtype == FP8_KV_DTYPE,
        PDL=pdl, num_warps=4 if row <= 2048 else 8, launch_pdl=pdl,
    )


def _check_store(k, v, kv_cache, slot_mapping, check_indices: bool, k_scale: float, v_scale: float) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check_index("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32))
    num_tokens = slot_mapping.shape[0]
    check_packed_heads("k", k, num_tokens, num_kv_heads, head_dim)
    check_packed_heads("v", v, num_tokens, num_kv_heads, head_dim)
    require(k.dtype == v.dtype, f"k and v must share a dtype, got {k.dtype} and {v.dtype}")
    check_cache_dtype("k", k, kv_cache)
    check_kv_scales(k_scale, v_scale)
    check_same_device(k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if check_indices:
        check_range("slot_mapping", slot_mapping, -1, num_blocks * block_size)
