"""Write a step's new keys and values into the paged KV cache."""
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
    k = tl.load(k_ptr + token * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs, mask=mask)
    if FP8:
        # Scaled into e4m3's range and saturated there (e4m3fn has no infinity).
        k = _round_to_e4m3(k.to(tl.float32) * k_inv_scale)
        v = _round_to_e4m3(v.to(tl.float32) * v_inv_scale)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kind, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  *, check_indices: bool = True, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Copy k, v `[T, num_kv_heads * head_dim]` into `kv_cache` at `slot_mapping[T]` (slot -1 = skip).

    `check_indices` reads the slots back to validate them (a device synchronisation on GPUs).
    An FP8 (e4m3) cache stores k / k_scale and v / v_scale, saturated at +-448; the attention
    kernels multiply the scales back.
    """
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
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    pdl = pdl_enabled(k.device)
    _store_kvcache_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), v.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        ROW=row, BLOCK_SIZE=block_size, BLOCK_ROW=triton.next_power_of_2(row), FP8=kv_cache.dtype == FP8_KV_DTYPE,
        PDL=pdl, num_warps=4 if row <= 2048 else 8, launch_pdl=pdl,
    )
