"""The inner loop both attention kernels share: online softmax over key tiles gathered from pages.

A program holds BLOCK_M query rows (query heads of one KV head, for one or several tokens) and
walks keys [lo, hi) of one sequence in tiles of BLOCK_N, looking each key's page up in the block
table, so each K/V tile is read once for all the rows sharing that KV head (GQA).

Numerics: K/V are loaded in the cache dtype and widened to fp32 at once; scores, softmax and the
accumulator stay fp32. The dot products run at `DOT_PRECISION`: tf32 on NVIDIA for 16-bit inputs
is exact for Q.K^T (bf16 and fp16 values are representable in tf32) and keeps the probabilities
at 10 mantissa bits for P.V, more than the bf16 that FlashAttention rounds them to; fp32 inputs
use "ieee" so fp32 models stay fp32-exact. Scores live in the log2 domain (exp2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def attend_paged(
    acc, m_i, l_i, q, q_pos, k_base, v_base, table_row, lo, hi, qk_scale,
    stride_blk, stride_tok, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold keys [lo, hi) into (acc, m_i, l_i); key j is visible to row r when j <= q_pos[r].

    q: [BLOCK_M, BLOCK_D] fp32, unscaled; qk_scale = softmax scale * log2(e).
    m_i must start finite (e.g. -1e30) so fully masked rows never compute inf - inf.
    """
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        page = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = page * stride_blk + (offs_n % BLOCK_SIZE) * stride_tok
        kv_offs = rows[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def dot_precision(dtype: torch.dtype) -> str:
    """tf32 where the target has it and inputs are 16-bit (exact products, see module doc)."""
    if dtype == torch.float32 or torch.version.hip is not None:
        return "ieee"
    return "tf32"


def head_block(head_dim: int) -> int:
    """tl.dot needs every dimension >= 16; head dims that are not powers of two are masked."""
    return max(16, triton.next_power_of_2(head_dim))
