"""The inner loop both attention kernels share: online softmax over key tiles gathered from pages.

A program holds BLOCK_M query rows (query heads of one KV head, for one or several tokens) and
walks keys [lo, hi) of one sequence in tiles of BLOCK_N, looking each key's page up in the block
table, so each K/V tile is read once for all the rows sharing that KV head (GQA).

Each program first walks, with masks, the keys at the lower edge of a sliding window (none
without one), then the keys every row sees (no masks: the bulk of a long context), then the ragged
or causal edge with masks. Tiles wholly before a window are never visited: a windowed layer reads
at most `window + tile` keys per row, whatever the context length.

Numerics: scores, softmax and the accumulator are fp32. The dots take DOT_DTYPE operands with fp32
accumulation: on a GPU that is the cache dtype (bf16/fp16 tensor cores; Q and K enter exactly, the
probabilities are rounded to it for P.V, as in FlashAttention), fp32 for fp32 models ("ieee", so they
stay fp32-exact); in the interpreter, which computes no 16-bit arithmetic, everything is widened to
fp32 as it is loaded. Scores live in the log2 domain (exp2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # kernels read globals only as constexpr


@triton.jit
def attend_paged(
    acc, m_i, l_i, q, q_pos, q_first, k_base, v_base, table_row, lo, hi, key_lo, qk_scale,
    stride_blk, stride_tok, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, MASKED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """Fold keys [lo, hi) into (acc, m_i, l_i).

    MASKED: key j is visible to row r when q_first[r] <= j <= q_pos[r] and j < hi, and only keys
    in [key_lo, hi) are read (key_lo <= every q_first: keys before it may sit in blocks already
    returned to the pool). Unmasked, the caller guarantees that every key of [lo, hi) is visible
    to every row and that hi - lo is a whole number of tiles. q: [BLOCK_M, BLOCK_D] in DOT_DTYPE,
    unscaled; qk_scale = scale * log2(e), or just scale with SOFT_CAP > 0, which caps each score
    s at SOFT_CAP * tanh(s / SOFT_CAP) (Gemma 2). m_i must start finite (e.g. -1e30) so fully
    masked rows never compute inf - inf.
    """
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = (offs_n < hi) & (offs_n >= key_lo)
            page = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            page = tl.load(table_row + offs_n // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_mask[None, :]
        kv_offs = (page * stride_blk + (offs_n % BLOCK_SIZE) * stride_tok)[:, None] + offs_d[None, :]
        k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if SOFT_CAP > 0:
            # tanh(x) = 1 - 2 / (e^2x + 1), exact at both ends in fp32 (e^2x -> inf gives 1, -> 0 gives -1)
            s = (SOFT_CAP * _LOG2E) * (1.0 - 2.0 / (tl.exp2(s * (2.0 * _LOG2E / SOFT_CAP)) + 1.0))
        if MASKED:
            visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] >= q_first[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def fold_sinks(acc, m_i, l_i, sinks_ptr, heads, head_mask):
    """Add each row's sink (a logit, in natural units, of a key with a zero value: gpt-oss) to the
    softmax state (acc, m_i, l_i) of `attend_paged`: the denominator gains exp(sink)."""
    sink = tl.load(sinks_ptr + heads, mask=head_mask, other=-1.0e30).to(tl.float32) * _LOG2E
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], m_new, l_i * alpha + tl.exp2(sink - m_new)


def local_attention(sliding_window: int | None, attention_chunk: int | None) -> tuple[int, bool, bool]:
    """(span, SLIDING, CHUNKED) of a launch: the kernels read one span argument, a window's or a
    chunk's length, and give every row a first visible key (SLIDING, true for both kinds) from it."""
    if attention_chunk is not None:
        if not (isinstance(attention_chunk, int) and attention_chunk >= 1) or sliding_window is not None:
            raise ValueError(f"attention_chunk must be a positive number of tokens, without a sliding window; got "
                             f"{attention_chunk!r} with sliding_window={sliding_window!r}")
        return attention_chunk, True, True
    return sliding_window or 0, sliding_window is not None, False


def check_sinks(sinks: torch.Tensor | None, num_heads: int, q: torch.Tensor) -> torch.Tensor | None:
    """The sinks as the kernels read them: fp32 [num_heads], contiguous, on q's device."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (num_heads,) or sinks.device != q.device:
        raise ValueError(f"sinks must be [{num_heads}] (one per query head) on {q.device}, got "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    return sinks.float().contiguous()


def score_scale(scale: float, logits_soft_cap: float | None) -> float:
    """What `attend_paged` multiplies the dot products by (see its docstring)."""
    return scale if logits_soft_cap else scale * LOG2E


def dot_dtype(dtype: torch.dtype, device: torch.device):
    """Operand type of the attention dots (see the module doc)."""
    if device.type == "cpu" or dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def head_block(head_dim: int) -> int:
    """tl.dot needs every dimension >= 16; head dims that are not powers of two are masked."""
    return max(16, triton.next_power_of_2(head_dim))
