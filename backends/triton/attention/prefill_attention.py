"""Prefill/extend attention over the paged cache: variable query lengths, causal, cached prefixes.

The new tokens' K/V must already be in the pages (store_kvcache runs first), so every key is read
from the cache: a chunked prefill or a prefix-cache hit is the same code as a cold prefill.

Grid (query tile, KV head). A tile holds BLOCK_Q tokens of one sequence times the GROUP query heads
of one KV head (BLOCK_M = BLOCK_Q * GROUP rows, padded to a power of two), so K/V tiles are shared
by the whole group, which keeps decode rows in a mixed batch cheap. Tiles are numbered
`query_start_loc[i] // BLOCK_Q + i + local_tile`: the grid size then depends only on T and B
(not on the longest query), and each program finds its sequence by binary search.

Sliding windows (`sliding_window`): a tile starts at the key tile holding its first row's first
visible key, masks the keys up to where every row's window has begun, then runs unmasked; no key
before the first row's window is read. Soft-capping (`logits_soft_cap`) and sinks (`sinks`) are
compile-time variants.

Bidirectional spans (`query_key_end`, an image's tokens in Gemma 3): each row's last visible key
is max(its position, its key end - 1), and a tile walks keys up to its rows' largest key end; the
window's lower edge still comes from each row's own position.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import (
    attention_output,
    check_index,
    check_kv_cache,
    check_packed_heads,
    check_range,
    check_cache_dtype,
    check_kv_scales,
    check_same_device,
    check_window_and_cap,
    require,
)
from .paged_softmax import attend_paged, check_sinks, dot_dtype, fold_sinks, head_block, local_attention, score_scale

PREFILL_BLOCK_N = 64


@triton.jit
def _find_sequence(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest i with query_start[i] // BLOCK_Q + i <= tile."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def query_tile(query_start_ptr, seq_lens_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """(sequence, its first packed query row, its query length, this tile's index among the
    sequence's tiles, its cached prefix length) of query tile `tile`; the tile is empty when
    local * BLOCK_Q >= q_len (sequences round their tiles up)."""
    seq = _find_sequence(query_start_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)
    prefix = tl.load(seq_lens_ptr + seq) - q_len
    return seq, q_start, q_len, local, prefix


# The batch size and the block-table width change every step: specializing on them (Triton does
# for integers divisible by 16) would compile variants at first use while serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_table", "window"])
def _prefill_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, query_start_ptr, out_ptr, sinks_ptr, key_end_ptr, qk_scale,
    v_scale, window, num_seqs, stride_qt, stride_ot, stride_kind, stride_blk, stride_tok, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, CHUNKED: tl.constexpr,
    BIDIRECTIONAL: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, q_start, q_len, local, prefix = query_tile(query_start_ptr, seq_lens_ptr, num_seqs, tile, BLOCK_Q)
    if local * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token = local * BLOCK_Q + offs_m // GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (token < q_len)
    d_mask = offs_d < HEAD_DIM
    row_mask = m_mask[:, None] & d_mask[None, :]
    head_offs = (kv_head * GROUP + offs_m % GROUP)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head_offs, mask=row_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    q_pos = prefix + token
    q_last = q_pos
    if BIDIRECTIONAL:
        # A row inside a span also sees its span's later keys, all of them this step's tokens.
        key_end = tl.load(key_end_ptr + q_start + token, mask=m_mask, other=0)
        q_last = tl.maximum(q_pos, key_end - 1)

    k_base = cache_ptr + kv_head * HEAD_DIM
    v_base = k_base + stride_kind
    table_row = table_ptr + seq * stride_table
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys up to the tile's first token are visible to all its rows; past its last token, to none.
    first_pos = prefix + local * BLOCK_Q
    bulk_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    hi = prefix + tl.minimum((local + 1) * BLOCK_Q, q_len)
    if SLIDING:
        # Row r sees keys from q_pos[r] - window + 1 (CHUNKED: from its chunk's start, `window`
        # being the chunk length): none of the tile's rows sees a key before key_lo (its first
        # row's edge), all of them see the keys from head_end (its last row's).
        if CHUNKED:
            q_first = q_pos // window * window
            key_lo = first_pos // window * window
            last_first = (hi - 1) // window * window
        else:
            q_first = q_pos - window + 1
            key_lo = tl.maximum(first_pos - window + 1, 0)
            last_first = tl.maximum(hi - window, 0)
        head_end = tl.minimum(tl.cdiv(last_first, BLOCK_N) * BLOCK_N, hi)
        acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, q_last, q_first, k_base, v_base, table_row,
                                     key_lo // BLOCK_N * BLOCK_N, head_end, key_lo, qk_scale, stride_blk,
                                     stride_tok, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, True, SOFT_CAP)
    else:
        q_first = tl.zeros([BLOCK_M], dtype=tl.int32)
        key_lo = 0
        head_end = 0
    bulk_end = tl.maximum(bulk_end, head_end)
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, q_last, q_first, k_base, v_base, table_row, head_end, bulk_end,
                                 key_lo, qk_scale, stride_blk, stride_tok, offs_d, d_mask,
                                 BLOCK_SIZE, BLOCK_N, DOT_DTYPE, False, SOFT_CAP)
    if BIDIRECTIONAL:
        # After the window's edges, which the rows' own positions set: the tail runs to the span ends.
        hi = tl.maximum(hi, tl.max(key_end, 0))
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, q_last, q_first, k_base, v_base, table_row, bulk_end, hi,
                                 key_lo, qk_scale, stride_blk, stride_tok, offs_d, d_mask,
                                 BLOCK_SIZE, BLOCK_N, DOT_DTYPE, True, SOFT_CAP)
    if HAS_SINKS:
        acc, m_i, l_i = fold_sinks(acc, m_i, l_i, sinks_ptr, kv_head * GROUP + offs_m % GROUP, m_mask)
    out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head_offs, out.to(out_ptr.dtype.element_ty),
             mask=row_mask)


def prefill_block_m(group: int, max_query_len: int) -> int:
    """Rows per program: small for decode-like batches, larger to reuse K/V tiles in long prefills."""
    rows = 16 if max_query_len * group <= 64 else 64
    return max(rows, triton.next_power_of_2(group))


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                            max_query_len: int, out: torch.Tensor | None = None,
                            check_indices: bool = True, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0, sinks: torch.Tensor | None = None,
                            attention_chunk: int | None = None,
                            query_key_end: torch.Tensor | None = None, fixed_tiles: bool = False) -> torch.Tensor:
    """Causal attention of T packed new tokens over their sequences' paged context.

    q: [T, num_heads * head_dim]; query_start_loc: int32 [B + 1]; seq_lens: int32 [B] (cached
    prefix + new tokens); block_tables: int32 [B, max_blocks]; max_query_len: a host bound on the
    query lengths that only picks tile sizes. `check_indices` reads the index tensors back to
    validate them (a GPU synchronisation). Returns `out` [T, num_heads * head_dim].
    `sliding_window`, `logits_soft_cap` and the FP8 cache's `k_scale`, `v_scale` as in
    `paged_decode_attention`: no key before the window of a tile's first token is read.
    `sinks` [num_heads] and `attention_chunk` as in `paged_decode_attention`. `query_key_end`
    int32 [T] (`corectl.attention.query_key_ends`): the first context position each token does
    not see, past its own inside a bidirectional span, never past its sequence's end.
    `fixed_tiles`: the query tile depends on the heads per KV head only, never on `max_query_len`,
    so a row's result is the same bits whatever the step's other queries (`--batch-invariant`).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check_index("block_tables", block_tables, 2, (torch.int32,))
    check_index("seq_lens", seq_lens, 1, (torch.int32,))
    check_index("query_start_loc", query_start_loc, 1, (torch.int32,))
    num_seqs, table_width = block_tables.shape
    require(seq_lens.shape[0] == num_seqs and query_start_loc.shape[0] == num_seqs + 1,
            f"block_tables has {num_seqs} rows, so seq_lens needs {num_seqs} entries and query_start_loc "
            f"{num_seqs + 1}; got {seq_lens.shape[0]} and {query_start_loc.shape[0]}")
    require(q.dim() == 2 and q.shape[1] % (head_dim * num_kv_heads) == 0,
            f"q must be [num_tokens, num_heads * {head_dim}] with num_heads a multiple of {num_kv_heads}, "
            f"got shape {tuple(q.shape)}")
    num_tokens, num_heads = q.shape[0], q.shape[1] // head_dim
    check_packed_heads("q", q, num_tokens, num_heads, head_dim)
    check_cache_dtype("q", q, kv_cache)
    check_kv_scales(k_scale, v_scale)
    require(max_query_len >= 1, f"max_query_len must be >= 1, got {max_query_len}")
    check_window_and_cap(sliding_window, logits_soft_cap)
    sinks = check_sinks(sinks, num_heads, q)
    local = local_attention(sliding_window, attention_chunk)
    out = attention_output(out, q)
    check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens,
                      query_start_loc=query_start_loc, out=out)
    if query_key_end is not None:
        check_index("query_key_end", query_key_end, 1, (torch.int32,))
        require(query_key_end.shape[0] == num_tokens and query_key_end.device == q.device,
                f"query_key_end needs one entry per token ({num_tokens}) on {q.device}")
    if check_indices:
        _check_prefill_indices(block_tables, seq_lens, query_start_loc, num_blocks, num_tokens,
                               table_width * block_size, max_query_len)
    if num_tokens == 0:
        return out
    _launch_prefill(q, kv_cache, block_tables, seq_lens, query_start_loc, out, scale,
                    1 if fixed_tiles else max_query_len, local, logits_soft_cap, k_scale, v_scale, sinks, query_key_end)
    return out


def _check_prefill_indices(block_tables, seq_lens, query_start_loc, num_blocks, num_tokens,
                           max_context, max_query_len) -> None:
    check_range("block_tables", block_tables, 0, num_blocks)
    starts = query_start_loc.tolist()
    require(starts[0] == 0 and starts[-1] == num_tokens,
            f"query_start_loc must run from 0 to the number of tokens ({num_tokens}), got {starts[0]}..{starts[-1]}")
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    require(min(query_lens, default=0) >= 0, f"query_start_loc must be non-decreasing, got {starts}")
    require(max(query_lens, default=0) <= max_query_len,
            f"a query of {max(query_lens)} tokens exceeds max_query_len={max_query_len}")
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens.tolist())):
        require(query_len <= seq_len <= max_context,
                f"sequence {i}: seq_len {seq_len} must be at least its {query_len} new tokens and at most "
                f"{max_context} (block_tables width x block_size)")


def _launch_prefill(q, kv_cache, block_tables, seq_lens, query_start_loc, out, scale, max_query_len,
                    local, soft_cap, k_scale, v_scale, sinks, query_key_end) -> None:
    num_seqs = block_tables.shape[0]
    span, sliding, chunked = local
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    group = q.shape[1] // head_dim // num_kv_heads
    block_m = prefill_block_m(group, max_query_len)
    block_q = block_m // group
    num_tiles = q.shape[0] // block_q + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out, q if sinks is None else sinks,
        seq_lens if query_key_end is None else query_key_end, score_scale(scale * k_scale, soft_cap), v_scale,
        span,
        num_seqs,
        q.stride(0), out.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=head_block(head_dim),
        BLOCK_N=PREFILL_BLOCK_N, BLOCK_SIZE=kv_cache.shape[2], DOT_DTYPE=dot_dtype(q.dtype, q.device),
        SLIDING=sliding, SOFT_CAP=float(soft_cap or 0.0), HAS_SINKS=sinks is not None, CHUNKED=chunked,
        BIDIRECTIONAL=query_key_end is not None, num_warps=4, num_stages=2,
    )
