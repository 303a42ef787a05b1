"""Write a step's new keys and values into the paged KV cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import (
    check_index,
    check_kv_cache,
    check_packed_heads,
    check_range,
    check_same_device,
    require,
)


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_vt, stride_kind, stride_blk, stride_tok,
    ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_ROW: tl.constexpr,
):
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
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kind, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  *, check_indices: bool = True) -> None:
    """Copy k, v `[T, num_kv_heads * head_dim]` into `kv_cache` at `slot_mapping[T]` (slot -1 = skip).

    `check_indices` reads the slots back to validate them (a device synchronisation on GPUs).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check_index("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32))
    num_tokens = slot_mapping.shape[0]
    check_packed_heads("k", k, num_tokens, num_kv_heads, head_dim)
    check_packed_heads("v", v, num_tokens, num_kv_heads, head_dim)
    require(k.dtype == kv_cache.dtype and v.dtype == kv_cache.dtype,
            f"k, v and kv_cache must share a dtype, got {k.dtype}, {v.dtype}, {kv_cache.dtype}")
    check_same_device(k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if check_indices:
        check_range("slot_mapping", slot_mapping, -1, num_blocks * block_size)
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), v.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        ROW=row, BLOCK_SIZE=block_size, BLOCK_ROW=triton.next_power_of_2(row),
        num_warps=4 if row <= 2048 else 8,
    )
