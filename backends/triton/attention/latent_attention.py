"""Paged multi-head latent attention (DeepSeek's MLA, absorbed form) over a one-part latent cache.

The cache holds one row of RANK + ROPE numbers per token (`corectl.attention.KVCacheLayout` with
one part): the normalized latent c_kv and the rotated key part shared by every head. A query head
arrives already multiplied into the latent space, [q_latent | q_rope], so its score against a key
is q_latent . c_kv + q_rope . k_rope and its output is the softmax-weighted sum of the c_kv parts:
the row is read once and serves as key and value for every head (the model applies W_UV after).

Grid (query tile, head block, split): a program holds the heads of one head block for the query
tokens of its tile (rows = tokens x heads) and walks one contiguous partition of the keys they
see, in tiles of BLOCK_N, looking each key's page up in the block table, so a key tile is read once
for all of them. A decode step (one token per sequence, tile = sequence) splits long contexts like
`decode_attention`; with up to FUSED_SPLITS splits the last split program of a tile to finish (an
atomic ticket per tile and head block) combines the partial outputs, so the step is one launch,
past it the decode kernel's combine launch does. A prefill or mixed
step takes tiles of several tokens of one sequence, numbered and found as the prefill kernel's
(`query_tile`), unsplit, each row masked at its own position: a chunked prefill or a
prefix-cache hit is the same code. vLLM expands the latent into per-head K/V for prefill instead,
which costs fewer FLOPs per key on long prompts (nope + rope against rank + rope per head).

Numerics as `paged_softmax` (fp32 scores, softmax and accumulator; DOT_DTYPE operands; log2 domain).
Sequence lengths and block tables come from tensors, so a decode launch with fixed batch, table
width and split count replays in a CUDA graph; padding rows (length 0) produce zeros.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..checks import check_float, check_index, check_range, check_same_device, require
from .decode_attention import MAX_SPLITS, _combine_splits_kernel, choose_decode_splits
from .prefill_attention import query_tile
from .paged_softmax import LOG2E, dot_dtype, head_block


# Up to this many splits the last split program of a sequence combines them (one launch); past it
# that one program's serial pass over the partials would cost more than a combine launch spread
# over the heads (a batch-1 decode graph splits by the model's max length, up to MAX_SPLITS ways).
FUSED_SPLITS = 8


class LatentConfig(NamedTuple):
    """One launch: heads per program, keys per tile, warps, tiles in flight, and for prefill the
    rows (query tokens x heads) a program holds, so each key tile serves several tokens."""
    block_h: int = 16
    # H100, V2-Lite's shape at 64 x 4096 (`bench kernels`, three calls on 2026-11-27): 4 warps beat
    # 8 in two calls of three (79.0 / 70.1% and 60.2 / 50.8% of copy bandwidth), lost in one.
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    rows: int = 16


# Prefill and mixed steps: 64 rows (four tokens of 16 heads at V2-Lite's shape) quarter the key
# reads of one token a program; the 64 x 512 fp32 accumulator wants 8 warps. H100, 4 x 2048 causal
# (two calls on 2026-11-27): 183 TFLOP/s against 91-93 with 32 rows.
PREFILL = LatentConfig(num_warps=8, rows=64)


@triton.jit
def _attend_latent(acc, m_i, l_i, q_c, q_r, q_pos, row_base, table_row, lo, hi, qk_scale, stride_blk, stride_tok,
                   offs_r, offs_p, r_mask, p_mask, RANK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, MASKED: tl.constexpr, EVEN: tl.constexpr):
    """Fold keys [lo, hi) into (acc, m_i, l_i). MASKED: row r sees key j < hi when j <= q_pos[r];
    unmasked, every row sees every key and hi - lo is a whole number of tiles. EVEN: rank and rope
    are their blocks' widths, so unmasked tiles load without masks (the bulk of a long context at
    real shapes, 512 + 64)."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = offs_n < hi
            page = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        else:
            n_mask = offs_n >= 0
            page = tl.load(table_row + offs_n // BLOCK_SIZE).to(tl.int64)
        rows = row_base + (page * stride_blk + (offs_n % BLOCK_SIZE) * stride_tok)[:, None]
        if MASKED or not EVEN:
            c = tl.load(rows + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
            pe = tl.load(rows + RANK + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        else:
            c = tl.load(rows + offs_r[None, :])
            pe = tl.load(rows + RANK + offs_p[None, :])
        c = c.to(DOT_DTYPE)
        pe = pe.to(DOT_DTYPE)
        s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
        s = (s + tl.dot(q_r, tl.trans(pe), input_precision="ieee")) * qk_scale
        if MASKED:
            s = tl.where(n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


# The batch size and the block-table width change every eager step: no specialization on them.
@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _latent_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, query_start_ptr, out_ptr, part_out_ptr, part_lse_ptr, tickets_ptr, qk_scale,
    num_seqs, num_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_blk, stride_tok, stride_table,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FUSED_COMBINE: tl.constexpr, DOT_DTYPE: tl.constexpr, DECODE: tl.constexpr,
    EVEN: tl.constexpr,
):
    # Row m is head (m % HEADS) of this program's head block for query token (m // HEADS) of its tile.
    tile = tl.program_id(0)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    # The tile's keys: [0, seen); its first row's position, first_pos: all its rows see keys <= it.
    if DECODE:
        seq = tile
        q_start = tile
        seen = tl.load(seq_lens_ptr + seq)
        first_pos = seen - 1
        token = offs_m // HEADS
        q_pos = first_pos + token
        m_mask = token < 1
    else:
        seq, q_start, q_len, local, prefix = query_tile(query_start_ptr, seq_lens_ptr, num_seqs, tile, BLOCK_Q)
        if local * BLOCK_Q >= q_len:
            return
        seen = prefix + tl.minimum((local + 1) * BLOCK_Q, q_len)
        first_pos = prefix + local * BLOCK_Q
        token = local * BLOCK_Q + offs_m // HEADS
        q_pos = prefix + token
        m_mask = (offs_m < BLOCK_Q * HEADS) & (token < q_len)
    heads = tl.program_id(1) * HEADS + offs_m % HEADS
    m_mask = m_mask & (heads < num_heads)
    # Splits (decode) share the keys out in whole tiles, the last one ragged.
    split_len = tl.cdiv(tl.cdiv(seen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seen)
    bulk_end = tl.maximum(lo, tl.minimum(hi, (first_pos + 1) // BLOCK_N * BLOCK_N))

    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    q_rows = q_ptr + (q_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0).to(DOT_DTYPE)
    q_r = tl.load(q_rows + RANK + offs_p[None, :], mask=m_mask[:, None] & p_mask[None, :], other=0.0).to(DOT_DTYPE)

    table_row = table_ptr + seq * stride_table
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_latent(acc, m_i, l_i, q_c, q_r, q_pos, cache_ptr, table_row, lo, bulk_end, qk_scale,
                                   stride_blk, stride_tok, offs_r, offs_p, r_mask, p_mask,
                                   RANK, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, False, EVEN)
    acc, m_i, l_i = _attend_latent(acc, m_i, l_i, q_c, q_r, q_pos, cache_ptr, table_row, bulk_end, hi, qk_scale,
                                   stride_blk, stride_tok, offs_r, offs_p, r_mask, p_mask,
                                   RANK, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, True, EVEN)
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    row_mask = m_mask[:, None] & r_mask[None, :]
    dst = out_ptr + (q_start + token)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_r[None, :]
    if NUM_SPLITS == 1:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        first_row = (seq * num_heads + heads) * NUM_SPLITS
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + first_row + split, lse, mask=m_mask)
        if FUSED_COMBINE:
            # A row that saw no key (an empty split past a short context) stores its -inf only: this
            # combine never reads its output.
            tl.store(part_out_ptr + (first_row + split)[:, None] * RANK + offs_r[None, :], out,
                     mask=row_mask & (l_i > 0.0)[:, None])
            # The last of the splits to finish combines them: every thread's stores precede the
            # ticket (barrier, then a release at GPU scope), and the ticket goes back to 0.
            tl.debug_barrier()
            ticket = tickets_ptr + tile * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                _combine_splits(part_out_ptr, part_lse_ptr, dst, first_row, m_mask, offs_r, r_mask, RANK,
                                NUM_SPLITS, BLOCK_M, BLOCK_R)
                tl.store(ticket, 0)
        else:
            tl.store(part_out_ptr + (first_row + split)[:, None] * RANK + offs_r[None, :], out, mask=row_mask)


@triton.jit
def _combine_splits(part_out_ptr, part_lse_ptr, dst, first_row, m_mask, offs_r, r_mask, RANK: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """The softmax-weighted sum of a program's rows over every split into `dst`. Loads bypass L1
    (other SMs wrote them during this launch); a split's rows are read only where it saw keys."""
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + first_row + s, mask=m_mask, other=float("-inf"), cache_modifier=".cg")
        top = tl.maximum(top, lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + first_row + s, mask=m_mask, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp2(lse - top)
        seen = (m_mask & (lse > float("-inf")))[:, None] & r_mask[None, :]
        part = tl.load(part_out_ptr + (first_row + s)[:, None] * RANK + offs_r[None, :], mask=seen, other=0.0,
                       cache_modifier=".cg")
        acc += part * weight[:, None]
        total += weight
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(dst, out.to(dst.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


def check_latent_cache(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """The one-part layout of corectl.attention; returns (num_blocks, block_size, row width)."""
    check_float("kv_cache", kv_cache, 5)
    require(kv_cache.shape[0] == 1 and kv_cache.shape[3] == 1,
            f"a latent kv_cache must be [1, num_blocks, block_size, 1, rank + rope], got {tuple(kv_cache.shape)}")
    return kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[4]


def paged_latent_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None, scale: float, *,
                           rank: int, max_seq_len: int, num_splits: int | None = None,
                           out: torch.Tensor | None = None, check_indices: bool = True,
                           config: LatentConfig | None = None, tickets: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA of T packed query tokens over their sequences' paged latent rows (module doc).

    q: [T, num_heads, rank + rope] (any token stride, heads packed); kv_cache: [1, num_blocks,
    block_size, 1, rank + rope], the new tokens' rows already stored; block_tables int32 [B, width];
    seq_lens int32 [B], context length after this step. `query_start_loc` int32 [B + 1] for a
    prefill or mixed step; None for a decode step (token i is sequence i's last position), the only
    kind that splits (`num_splits`, else chosen from `max_seq_len`). Returns `out` [T, num_heads, rank].
    `check_indices` reads the index tensors back to validate them (a GPU synchronisation).
    `tickets`: int32 zeros that a decode split at most FUSED_SPLITS ways counts its finished splits
    on (T x head blocks of them) and leaves zeroed; a caller decoding repeatedly (the backend, CUDA
    graphs) keeps them; None, or too few, allocates them.
    """
    num_blocks, block_size, width = check_latent_cache(kv_cache)
    require(0 < rank < width, f"rank must lie in (0, {width}), got {rank}")
    check_float("q", q, 3)
    require(q.shape[2] == width and q.stride(1) == width,
            f"q must be [num_tokens, num_heads, {width}] with heads packed, got {tuple(q.shape)} strides {q.stride()}")
    require(q.dtype == kv_cache.dtype, f"q ({q.dtype}) must match the cache's dtype ({kv_cache.dtype})")
    check_index("block_tables", block_tables, 2, (torch.int32,))
    check_index("seq_lens", seq_lens, 1, (torch.int32,))
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_seqs, table_width = block_tables.shape
    require(seq_lens.shape[0] == num_seqs, f"seq_lens has {seq_lens.shape[0]} entries, block_tables {num_seqs} rows")
    decode = query_start_loc is None
    if decode:
        require(num_tokens == num_seqs, f"a decode step has one token per sequence: {num_tokens} for {num_seqs}")
    else:
        check_index("query_start_loc", query_start_loc, 1, (torch.int32,))
        require(query_start_loc.shape[0] == num_seqs + 1, f"query_start_loc needs {num_seqs + 1} entries")
    splits = 1 if not decode else num_splits or choose_decode_splits(num_seqs, 1, max_seq_len, q.device)
    require(1 <= splits <= MAX_SPLITS and (decode or splits == 1),
            f"num_splits must lie in [1, {MAX_SPLITS}] (1 unless decoding), got {splits}")
    shape = (num_tokens, num_heads, rank)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    require(tuple(out.shape) == shape and out.dtype == q.dtype and out.stride()[1:] == (rank, 1),
            f"out must be {q.dtype} {list(shape)} with packed heads, got {out.dtype} {tuple(out.shape)}")
    check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, out=out)
    if check_indices:
        check_range("block_tables", block_tables, 0, num_blocks)
        check_range("seq_lens", seq_lens, 0, table_width * block_size + 1)
        if not decode:
            check_range("query_start_loc", query_start_loc, 0, num_tokens + 1)
    if num_tokens:
        launch_latent(q, kv_cache, block_tables, seq_lens, query_start_loc, out, scale, rank, splits,
                      config or (LatentConfig() if query_start_loc is None else PREFILL), tickets)
    return out


def _split_buffers(q: torch.Tensor, rank: int, splits: int, head_blocks: int, tickets: torch.Tensor | None,
                   fused: bool):
    """(partial outputs, their log-sum-exps, tickets) of a decode split `splits` ways."""
    num_tokens, num_heads, _ = q.shape
    part_out = torch.empty((num_tokens, num_heads, splits, rank), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
    if not fused:
        return part_out, part_lse, part_lse
    if tickets is None or tickets.numel() < num_tokens * head_blocks:
        return part_out, part_lse, torch.zeros(num_tokens * head_blocks, dtype=torch.int32, device=q.device)
    require(tickets.dtype == torch.int32 and tickets.device == q.device and tickets.is_contiguous(),
            f"tickets must be contiguous int32 zeros on {q.device}, got {tickets.dtype} on {tickets.device}")
    return part_out, part_lse, tickets


def launch_latent(q, kv_cache, block_tables, seq_lens, query_start_loc, out, scale, rank, splits, cfg: LatentConfig,
                  tickets: torch.Tensor | None = None):
    """One launch on checked inputs (`paged_latent_attention`); returns what Triton's launch returns
    (on a GPU, the compiled kernel: `bench kernels` reads its registers and shared memory)."""
    num_tokens, num_heads, width = q.shape
    rope, decode = width - rank, query_start_loc is None
    heads = min(cfg.block_h, triton.next_power_of_2(num_heads))
    block_q = 1 if decode else max(1, cfg.rows // heads)
    head_blocks = triton.cdiv(num_heads, heads)
    fused = 1 < splits <= FUSED_SPLITS
    part_out, part_lse, tickets = (out, out, seq_lens) if splits == 1 else _split_buffers(q, rank, splits,
                                                                                         head_blocks, tickets, fused)
    # Prefill tiles are numbered as the prefill kernel's: the grid depends only on T and B.
    tiles = num_tokens if decode else num_tokens // block_q + block_tables.shape[0]
    kernel = _latent_kernel[(tiles, head_blocks, splits)](
        q, kv_cache, block_tables, seq_lens, seq_lens if decode else query_start_loc, out,
        part_out, part_lse, tickets, scale * LOG2E, block_tables.shape[0], num_heads, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
        RANK=rank, ROPE=rope, BLOCK_R=head_block(rank), BLOCK_P=head_block(rope), HEADS=heads, BLOCK_Q=block_q,
        BLOCK_M=max(16, block_q * heads), BLOCK_N=cfg.block_n, BLOCK_SIZE=kv_cache.shape[2], NUM_SPLITS=splits,
        FUSED_COMBINE=fused, DOT_DTYPE=dot_dtype(q.dtype, q.device), DECODE=decode,
        EVEN=head_block(rank) == rank and head_block(rope) == rope,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1 and not fused:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out, out.stride(0), num_heads,
            HEAD_DIM=rank, BLOCK_D=head_block(rank), NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            HAS_SINKS=False, PDL=False, num_warps=4,
        )
    return kernel
