"""LoRA expand: out += (xa @ B[slot].T) * scale[slot] for every token with an adapter slot.

`out` is one slice of a base projection's output (q, k or v of a packed qkv; any strides along
rows), `b` the matching rows of the stacked B [S, N, R]. Gathered form (decode, CUDA graphs): one
program per (token, output block); base tokens (slot -1) leave their row untouched. Segment form
(prefill and mixed steps): one program per (segment, row block, output block), `tl.dot` over the
rank. The sum is formed in fp32 and rounded once into `out`'s dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from corectl.lora.punica import LoRASegments

from ..checks import check_float, check_same_device, require
from .checks import check_slots
from .segments import segment_tile

_GATHER_BLOCK_N = 128
# Elements of one program's B tile: 64 registers a thread at 4 warps.
_TILE_ELEMENTS = 8192
_SEGMENT_BLOCK_M = 16
_SEGMENT_BLOCK_N = 64


@triton.jit
def _expand_gathered_kernel(xa_ptr, b_ptr, scales_ptr, slots_ptr, out_ptr, N, R, stride_xt, stride_bs, stride_bn,
                            stride_ot, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        xa = tl.load(xa_ptr + token * stride_xt + r, mask=r < R, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        delta = tl.sum(b * xa[None, :], axis=1) * tl.load(scales_ptr + slot)
        out = out_ptr + token * stride_ot + n
        y = tl.load(out, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out, (y + delta).to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _expand_segment_kernel(xa_ptr, b_ptr, scales_ptr, starts_ptr, lens_ptr, seg_slots_ptr, out_ptr, N, R,
                           stride_xt, stride_bs, stride_bn, stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_R: tl.constexpr):
    rows, in_segment, slot, live = segment_tile(starts_ptr, lens_ptr, seg_slots_ptr, BLOCK_M)
    if live:
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        xa = tl.load(xa_ptr + rows[:, None] * stride_xt + r[None, :], mask=in_segment[:, None] & (r[None, :] < R),
                     other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                     mask=(n[None, :] < N) & (r[:, None] < R), other=0.0).to(tl.float32)
        delta = tl.dot(xa, bt) * tl.load(scales_ptr + slot)
        mask = in_segment[:, None] & (n[None, :] < N)
        out = out_ptr + rows[:, None] * stride_ot + n[None, :]
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (y + delta).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand(xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, token_slots: torch.Tensor,
                segments: LoRASegments | None, out: torch.Tensor, check_indices: bool = False) -> None:
    """out [T, N] += (xa [T, R] @ b[slot] [N, R].T) * scales[slot] for rows with a slot >= 0, in place.
    xa, b and out may be column/row slices of larger tensors (their last dimension contiguous)."""
    check_float("xa", xa, 2)
    check_float("b", b, 3)
    check_float("out", out, 2)
    check_float("scales", scales, 1)
    require(scales.dtype == torch.float32, f"scales must be float32, got {scales.dtype}")
    require(b.shape[0] == scales.shape[0], f"b has {b.shape[0]} slots, scales {scales.shape[0]}")
    require(b.shape[2] == xa.shape[1], f"b has rank {b.shape[2]}, xa {xa.shape[1]}")
    require(out.shape == (xa.shape[0], b.shape[1]), f"out must be {(xa.shape[0], b.shape[1])}, got {tuple(out.shape)}")
    check_same_device(xa=xa, b=b, scales=scales, token_slots=token_slots, out=out)
    num_tokens, rank = xa.shape
    n_out = out.shape[1]
    check_slots(token_slots, num_tokens, b.shape[0], segments, check_indices)
    if not (num_tokens and rank and n_out):
        return
    if segments is None:
        block_r = triton.next_power_of_2(rank)
        block_n = min(_GATHER_BLOCK_N, max(16, _TILE_ELEMENTS // block_r), triton.next_power_of_2(n_out))
        _expand_gathered_kernel[(num_tokens, triton.cdiv(n_out, block_n))](
            xa, b, scales, token_slots, out, n_out, rank, xa.stride(0), b.stride(0), b.stride(1), out.stride(0),
            BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)
        return
    if not segments.num_segments or not segments.max_len:
        return
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = max(16, min(_SEGMENT_BLOCK_N, _TILE_ELEMENTS // block_r, triton.next_power_of_2(n_out)))
    grid = (segments.num_segments, triton.cdiv(segments.max_len, _SEGMENT_BLOCK_M), triton.cdiv(n_out, block_n))
    _expand_segment_kernel[grid](
        xa, b, scales, segments.starts, segments.lens, segments.slots, out, n_out, rank, xa.stride(0), b.stride(0),
        b.stride(1), out.stride(0), BLOCK_M=_SEGMENT_BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)
