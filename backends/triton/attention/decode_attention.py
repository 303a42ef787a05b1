"""Paged decode attention: one query token per sequence, split-KV for long contexts.

Grid (sequence, KV head, split): each program holds all query heads of one KV head, so K/V are
read once per KV head, and walks one contiguous partition of the context. A verify step of
speculative decoding (k + 1 rows a request, in a CUDA graph) runs as groups of rows sharing a block
table (`rows_per_seq`): one program holds every row's heads, so a request's K/V is read once per
step instead of once per row, and each row masks the keys past its own position. With one split it
writes the output directly; with several, each writes a partial output and its log-sum-exp and a
second kernel combines them.

CUDA-graph contract: the launch depends on host values only through `num_splits` (a grid
dimension and compile-time constant) and the tensor shapes. Sequence lengths and block tables are
read from tensors, so they may change between replays while `num_splits`, the batch size, the
block-table width and the tensors' storage stay fixed. Splits past a sequence's end are empty and
combine to nothing; a sequence of length 0 (graph padding) yields zeros.

Sliding windows: the splits share out only the keys from the window's first tile on, the first
of which is masked at the window's edge; a layer's window is a kernel argument fixed per layer,
so a captured graph replays it like the scale.

Sinks (gpt-oss: a logit per head joining the softmax's denominator) fold into the softmax state
once per head: by the decode kernel with one split, by the combine kernel with several.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

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
from ..pdl import grid_dependency, pdl_enabled
from .paged_softmax import (
    LOG2E,
    attend_paged,
    check_sinks,
    dot_dtype,
    fold_sinks,
    head_block,
    local_attention,
    score_scale,
)

_LOG2E = tl.constexpr(LOG2E)  # kernels read globals only as constexpr
# Fewest keys worth a program of its own: below this the combine step costs more than it saves.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
DECODE_BLOCK_N = 64


class DecodeConfig(NamedTuple):
    """One decode launch: keys per tile, warps per program, tiles in flight (software pipelining)."""
    block_n: int = DECODE_BLOCK_N
    num_warps: int = 4
    num_stages: int = 3


# Unsplit launches over an FP8 cache: half the bytes per key make the default's tiles too few to
# hide latency. H100 sweep (benchmarks/decode_sweep.py, 2026-11-26), FP8 against the default: 256
# sequences of 512-640 keys 160 against 213 us (FP8_LARGE_BATCH; FP8_UNSPLIT 180), qwen3-0.6b's
# 256 x 100-1100 207 against 233, 64 x 4096 288 (FP8_UNSPLIT; FP8_LARGE_BATCH 323) against 325.
# Split launches (small batches) and bf16 caches (at 91% of copy bandwidth already on the first
# case) keep the default.
FP8_UNSPLIT = DecodeConfig(32, 4, 3)
FP8_LARGE_BATCH = DecodeConfig(32, 2, 2)
LARGE_BATCH = 128


def decode_config(cache_dtype: torch.dtype, splits: int, num_seqs: int) -> DecodeConfig:
    """The launch for a cache dtype, split count and batch (each fixed per captured graph)."""
    if cache_dtype != torch.float8_e4m3fn or splits > 1:
        return DecodeConfig()
    return FP8_LARGE_BATCH if num_seqs >= LARGE_BATCH else FP8_UNSPLIT


# The block-table width changes every eager step (see the prefill kernel); a layer's window is fixed.
@triton.jit(do_not_specialize=["stride_table", "window"])
def _decode_kernel(
    q_ptr, cache_ptr, table_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, order_ptr, qk_scale, v_scale,
    window, stride_qt, stride_ot, stride_kind, stride_blk, stride_tok, stride_table, num_heads,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    CHUNKED: tl.constexpr, PDL: tl.constexpr, HAS_ORDER: tl.constexpr,
):
    grid_dependency(PDL)
    # The KV heads of one row group run side by side (they read the same cache rows), and the
    # groups in `order` when given: longest context first, so the long programs do not trail.
    kv_head = tl.program_id(0)
    group_id = tl.program_id(1)
    if HAS_ORDER:
        group_id = tl.load(order_ptr + group_id)
    split = tl.program_id(2)
    # Tile row m is query head (m % GROUP) of decode row (m // GROUP) of this program's ROWS rows,
    # which share one block table (`rows_per_seq`).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < GROUP * ROWS
    d_mask = offs_d < HEAD_DIM
    rows = group_id * ROWS + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_len = tl.load(seq_lens_ptr + rows, mask=m_mask, other=0)
    real = row_len > 0
    max_len = tl.max(row_len, 0)
    # Keys below the shortest real row's length are visible to every real row (unmasked bulk).
    min_len = tl.min(tl.where(real, row_len, max_len), 0)
    # A row sees keys [row_first, row_len): its window's, its chunk's (CHUNKED: `window` is the chunk
    # length), or the whole context.
    if CHUNKED:
        row_first = tl.maximum(row_len - 1, 0) // window * window
    elif SLIDING:
        row_first = tl.maximum(row_len - window, 0)
    else:
        row_first = tl.zeros([BLOCK_M], dtype=tl.int32)
    first = tl.min(tl.where(real, row_first, max_len), 0)
    first_max = tl.max(tl.where(real, row_first, 0), 0)
    start = first // BLOCK_N * BLOCK_N
    # Splits share the keys from the window's first tile on, in whole tiles, so only the tiles at
    # the windows' edges and the last (ragged) need masks.
    split_len = tl.cdiv(tl.cdiv(max_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, max_len)
    head_end = tl.where(lo < first_max, tl.minimum(tl.cdiv(first_max, BLOCK_N) * BLOCK_N, hi), lo)

    row_offs = rows[:, None] * stride_qt + heads[:, None] * HEAD_DIM + offs_d[None, :]
    row_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + row_offs, mask=row_mask, other=0.0).to(DOT_DTYPE)
    q_pos = row_len - 1

    k_base = cache_ptr + kv_head * HEAD_DIM
    v_base = k_base + stride_kind
    table_row = table_ptr + group_id * ROWS * stride_table
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bulk_end = head_end + tl.maximum(tl.minimum(hi, min_len) - head_end, 0) // BLOCK_N * BLOCK_N
    if SLIDING:
        acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, q_pos, row_first, k_base, v_base, table_row, lo, head_end,
                                     first, qk_scale, stride_blk, stride_tok, offs_d, d_mask,
                                     BLOCK_SIZE, BLOCK_N, DOT_DTYPE, True, SOFT_CAP)
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, q_pos, row_first, k_base, v_base, table_row, head_end, bulk_end,
                                 first, qk_scale, stride_blk, stride_tok, offs_d, d_mask,
                                 BLOCK_SIZE, BLOCK_N, DOT_DTYPE, False, SOFT_CAP)
    acc, m_i, l_i = attend_paged(acc, m_i, l_i, q, q_pos, row_first, k_base, v_base, table_row, bulk_end, hi,
                                 first, qk_scale, stride_blk, stride_tok, offs_d, d_mask,
                                 BLOCK_SIZE, BLOCK_N, DOT_DTYPE, True, SOFT_CAP)
    if HAS_SINKS and NUM_SPLITS == 1:
        acc, m_i, l_i = fold_sinks(acc, m_i, l_i, sinks_ptr, heads, m_mask)
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (v_scale / safe_l)[:, None]
    if NUM_SPLITS == 1:
        out_offs = rows[:, None] * stride_ot + heads[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part_rows = (rows * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + part_rows, lse, mask=m_mask)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, stride_ot, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row0 = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    parts = tl.load(part_out_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_compute_units(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter runs programs one after another: more programs only add work.
    return 1


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_compute_units: int,
                      small_grids_in_two: bool = True) -> int:
    """Split until there are about two programs per SM (two fit in shared memory at the default
    tile), keeping MIN_KEYS_PER_SPLIT keys per split; with `small_grids_in_two`, in two at least
    while the unsplit grid has at most four programs an SM. Measured at 4096 keys: batch 1 runs 2x
    faster with 16 splits (H100); batch 64 (512 programs) 17% faster in two than unsplit, and 64 or
    32 ragged contexts of 100-4096 keys 14% and 25% (H200, benchmarks/decode_order_sweep.py); 128
    sequences and more run best unsplit. A verify step's groups of k + 1 rows split so ran 7%
    slower (W11 at batch 64, H200): they keep the two-per-SM rule, as does the latent (MLA)
    kernel, not measured split so. `num_seqs` counts row groups."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = 2 * num_compute_units // programs
    if small_grids_in_two and programs <= 4 * num_compute_units:
        wanted = max(wanted, 2)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(wanted, by_length, MAX_SPLITS))


def choose_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                         small_grids_in_two: bool = True) -> int:
    return decode_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_compute_units(torch.device(device)),
                             small_grids_in_two)


def longest_first_pays(num_groups: int, num_kv_heads: int, num_splits: int, device: torch.device) -> bool:
    """Whether starting the row groups longest first can shorten a launch: only where the grid has
    more programs than run at once (about two an SM). A grid of one wave gains nothing and would
    wait on the order's load before its first (batch 1: 4% slower, W11 on an H200)."""
    return num_groups * num_kv_heads * num_splits > 2 * _num_compute_units(torch.device(device))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, max_seq_len: int,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           check_indices: bool = True, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, config: DecodeConfig | None = None,
                           sinks: torch.Tensor | None = None, attention_chunk: int | None = None,
                           rows_per_seq: int = 1, order: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (the token's own K/V included).

    q: [B, num_heads * head_dim]; block_tables: int32 [B, max_blocks]; seq_lens: int32 [B], the
    context length including the new token; max_seq_len: a host bound on seq_lens that picks the
    number of splits unless `num_splits` is given. Returns `out` [B, num_heads * head_dim].
    `check_indices` reads block tables and lengths back to validate them (a GPU synchronisation).
    `sliding_window` W: the token at position p sees keys p - W < j <= p only, and no key before
    that is read (its block may be back in the pool); None sees the whole context.
    `logits_soft_cap` c: scores become c * tanh(score / c) (Gemma 2); None leaves them.
    An FP8 (e4m3) `kv_cache` holds keys / k_scale and values / v_scale (`store_kvcache`): the
    scales fold into the score scale and the output, so the tiles are only widened as they load.
    `config` overrides the launch's tile, warps and stages (a benchmark's sweep).
    `sinks` [num_heads]: head h's softmax denominator gains exp(sinks[h]) (gpt-oss); None: no sinks.
    `attention_chunk` C: the token at p sees keys C * (p // C) <= j <= p only (Llama 4's local
    layers; not with a window), read like a window's.
    `rows_per_seq` R > 1: rows come in groups of R consecutive rows over one block table (the first
    row's; a verify step's tokens of one request, each row's seq_len ending at its own position, a
    padding row's 0), and each group's K/V is read once for all its rows. B must be a multiple of R;
    splits count groups.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check_index("block_tables", block_tables, 2, (torch.int32,))
    check_index("seq_lens", seq_lens, 1, (torch.int32,))
    num_seqs, table_width = block_tables.shape
    require(seq_lens.shape[0] == num_seqs,
            f"seq_lens has {seq_lens.shape[0]} entries but block_tables has {num_seqs} rows")
    require(q.dim() == 2 and q.shape[1] % (head_dim * num_kv_heads) == 0,
            f"q must be [num_seqs, num_heads * {head_dim}] with num_heads a multiple of {num_kv_heads}, "
            f"got shape {tuple(q.shape)}")
    num_heads = q.shape[1] // head_dim
    check_packed_heads("q", q, num_seqs, num_heads, head_dim)
    check_cache_dtype("q", q, kv_cache)
    check_kv_scales(k_scale, v_scale)
    require(max_seq_len >= 0, f"max_seq_len must be >= 0, got {max_seq_len}")
    require(rows_per_seq >= 1 and num_seqs % rows_per_seq == 0,
            f"rows_per_seq must be >= 1 and divide the {num_seqs} rows, got {rows_per_seq}")
    check_window_and_cap(sliding_window, logits_soft_cap)
    if order is not None:
        check_index("order", order, 1, (torch.int32,))
        require(order.shape[0] == num_seqs // rows_per_seq,
                f"order has {order.shape[0]} entries for {num_seqs // rows_per_seq} row groups")
    sinks = check_sinks(sinks, num_heads, q)
    local = local_attention(sliding_window, attention_chunk)
    splits = num_splits if num_splits is not None else choose_decode_splits(
        num_seqs // rows_per_seq, num_kv_heads, max_seq_len, q.device, small_grids_in_two=rows_per_seq == 1)
    require(1 <= splits <= MAX_SPLITS, f"num_splits must lie in [1, {MAX_SPLITS}], got {splits}")
    out = attention_output(out, q)
    check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, out=out,
                      **({} if order is None else {"order": order}))
    if check_indices:
        if order is not None:
            check_range("order", order, 0, num_seqs // rows_per_seq)
        check_range("block_tables", block_tables, 0, num_blocks)
        check_range("seq_lens", seq_lens, 0, table_width * block_size + 1)
    if num_seqs == 0:
        return out
    _launch_decode(q, kv_cache, block_tables, seq_lens, out, scale, num_heads // num_kv_heads, rows_per_seq,
                   splits, local, logits_soft_cap, k_scale, v_scale,
                   config or decode_config(kv_cache.dtype, splits, num_seqs // rows_per_seq), sinks, order)
    return out


def _launch_decode(q, kv_cache, block_tables, seq_lens, out, scale, group, rows, splits, local, soft_cap,
                   k_scale, v_scale, cfg: DecodeConfig, sinks: torch.Tensor | None,
                   order: torch.Tensor | None) -> None:
    span, sliding, chunked = local
    num_seqs = q.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    num_heads = num_kv_heads * group
    block_d = head_block(head_dim)
    pdl = pdl_enabled(q.device)
    if splits == 1:
        # The partial buffers are compiled out with one split; `out` stands in for their pointers.
        part_out = part_lse = out
    else:
        part_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(num_kv_heads, num_seqs // rows, splits)](
        q, kv_cache, block_tables, seq_lens, out, part_out, part_lse, q if sinks is None else sinks,
        seq_lens if order is None else order,
        score_scale(scale * k_scale, soft_cap), v_scale,
        span,
        q.stride(0), out.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0), num_heads,
        GROUP=group, ROWS=rows, HEAD_DIM=head_dim, BLOCK_M=max(16, triton.next_power_of_2(group * rows)),
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n, BLOCK_SIZE=kv_cache.shape[2], NUM_SPLITS=splits,
        DOT_DTYPE=dot_dtype(q.dtype, q.device), SLIDING=sliding, SOFT_CAP=float(soft_cap or 0.0),
        HAS_SINKS=sinks is not None, CHUNKED=chunked, PDL=pdl, HAS_ORDER=order is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    if splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, q if sinks is None else sinks, out.stride(0), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            HAS_SINKS=sinks is not None, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
