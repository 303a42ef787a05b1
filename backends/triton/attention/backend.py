"""The attention backend of the CUDA and ROCm platforms, built on the shared Triton kernels.

Each layer's forward stores the new K/V into the pages, then attends with the decode kernel
(pure-decode batches) or the prefill/extend kernel (anything else, including mixed batches).
Latent attention (`forward_latent`, DeepSeek's MLA) stores each token's one row and runs
`latent_attention`, split over the context when the step is pure decode.

CUDA graphs (decode): a captured forward replays the same launches, so what the launches read
from the host must not change between replays: the batch size (pad it to the graph's bucket), the
block-table width, `num_splits` (pick it for the bucket with `max_seq_len` = the model's max length),
the softmax scale, each layer's window and soft cap (fixed per layer) and the storage of every
metadata tensor. What changes per step goes through
those tensors, copied in before replay: `seq_lens` (0 for padding rows, which then produce zeros),
`block_tables`, `slot_mapping` (-1 for padding rows, which store nothing). Build capture metadata
with `check_indices=False`: index validation reads tensors back, which a capture forbids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from corectl.attention import AttentionBackend, AttentionBatch, Rotation, query_key_ends
from corectl.errors import ConfigError

from ..checks import FP8_KV_DTYPE, check_packed_heads, require
from .decode_attention import choose_decode_splits, longest_first_pays, paged_decode_attention
from .kv_cache_store import rotate_and_store_kvcache, store_kvcache
from .latent_attention import paged_latent_attention
from .prefill_attention import paged_prefill_attention

LATENT_TICKETS = 1 << 14


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64, -1 = skip
    block_tables: torch.Tensor        # [B, max_blocks] int32
    seq_lens: torch.Tensor            # [B] int32
    query_start_loc: torch.Tensor     # [B + 1] int32
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    is_pure_decode: bool
    num_splits: int                   # decode only; fixed per captured graph
    # Prefill tiles chosen by the model alone, every step through the prefill kernel (`batch_invariant`).
    fixed_tiles: bool
    rows_per_seq: int                 # decode only: rows sharing a block table (AttentionBatch)
    # [T] int32: each token's first unseen context position, where the batch has bidirectional
    # spans (prefill only: a decode token's span, if any, is itself).
    query_key_end: torch.Tensor | None = None
    # Validate index tensors on the first layer's forward of the step, then trust them.
    check_indices: bool = True
    # Decode only: the order the row groups' programs start in (AttentionBatch.decode_order).
    decode_order: torch.Tensor | None = None
    # Decode only: the latent kernel's splits, chosen by its first layer and kept for the step's others.
    latent_splits: int | None = None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_graph_capture = True
    # FP8 caches are read and written by the kernels themselves (scales 1.0: no calibrated ones yet).
    kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")
    supports_sinks = True
    supports_chunked_attention = True
    # `--batch-invariant` (the CUDA worker sets it): a row's attention must not depend on the other
    # rows of its step. The decode kernel splits the context by the batch's size and runs other
    # tiles than the prefill kernel, which a decode row in a mixed step (or a one-token prefill
    # chunk) would take instead; so every step runs the prefill kernel, its query tile fixed by the
    # model's heads per KV head. Its key tiles are BLOCK_N-aligned context positions wherever a
    # query tile starts, and a key a row does not see contributes exact zeros, so a row's sums run
    # over the same tiles in the same order alone, in any batch, and after any cached prefix.
    batch_invariant = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 block_size: int):
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device, block_size)
        # Split MLA decodes count their finished splits here and leave it zeroed (`paged_latent_attention`'s
        # tickets), so a step, and its CUDA graph, zeroes nothing per layer; made here, never inside a
        # capture. A step of more than 16k decode rows x head blocks zeroes its own.
        self.latent_tickets = torch.zeros(LATENT_TICKETS, dtype=torch.int32, device=device)

    def build_metadata(self, batch: AttentionBatch, check_indices: bool = True) -> TritonAttentionMetadata:
        require(batch.block_size == self.block_size,
                f"batch block_size {batch.block_size} differs from the backend's {self.block_size}")
        num_tokens = sum(batch.query_lens_host)
        # One token for every sequence: the decode kernel maps query row i to sequence i.
        pure_decode = batch.is_pure_decode and num_tokens == batch.num_seqs and not self.batch_invariant
        splits, order = 1, None
        if pure_decode:
            splits, ordered = self._decode_launch(batch.num_seqs // batch.rows_per_seq, batch.rows_per_seq,
                                                  batch.max_seq_len)
            order = batch.decode_order if ordered else None
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            num_tokens=num_tokens,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            is_pure_decode=pure_decode,
            num_splits=splits,
            fixed_tiles=self.batch_invariant,
            rows_per_seq=batch.rows_per_seq if pure_decode else 1,
            query_key_end=None if pure_decode else _key_ends(batch, self.device),
            check_indices=check_indices,
            decode_order=order,
        )

    def uses_decode_order(self, num_groups: int, rows_per_seq: int, max_seq_len: int) -> bool:
        if self.batch_invariant:  # every step runs the prefill kernel
            return False
        return self._decode_launch(num_groups, rows_per_seq, max_seq_len)[1]

    def _decode_launch(self, num_groups: int, rows_per_seq: int, max_seq_len: int) -> tuple[int, bool]:
        """A pure-decode batch's (split count, whether its row groups start longest first)."""
        splits = choose_decode_splits(num_groups, self.num_kv_heads, max_seq_len, self.device,
                                      small_grids_in_two=rows_per_seq == 1)
        return splits, longest_first_pays(num_groups, self.num_kv_heads, splits, self.device)

    def fuses_rotary(self, meta: TritonAttentionMetadata) -> bool:
        # Decode steps replay captured graphs, where a launch fewer a layer is all gain. Prefill
        # steps run attention eagerly between piecewise graphs, where the fused launch's host work
        # (the rotary kernel's, which the graphs held) cost more than the launch saves (W3's
        # prefill step 30% slower on an H200). Piecewise captures are prefill-shaped (16 tokens
        # and up), so their replays never carry a rotation.
        return meta.is_pure_decode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonAttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                attention_chunk: int | None = None, rotation: Rotation | None = None) -> torch.Tensor:
        check_packed_heads("q", q, meta.num_tokens, self.num_heads, self.head_dim)
        check = meta.check_indices
        if rotation is None:
            store_kvcache(k, v, kv_cache, meta.slot_mapping, check_indices=check)
        else:
            rotate_and_store_kvcache(rotation.positions, q.view(-1, self.num_heads, self.head_dim),
                                     k.view(-1, self.num_kv_heads, self.head_dim), v, kv_cache, meta.slot_mapping,
                                     rotation.cos, rotation.sin, rotation.q_norm, rotation.k_norm, rotation.norm_eps,
                                     check_indices=check)
        if meta.is_pure_decode:
            out = paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=meta.max_seq_len, num_splits=meta.num_splits, check_indices=check,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                attention_chunk=attention_chunk, rows_per_seq=meta.rows_per_seq, order=meta.decode_order,
            )
        else:
            out = paged_prefill_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                max_query_len=meta.max_query_len, check_indices=check,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                attention_chunk=attention_chunk, query_key_end=meta.query_key_end, fixed_tiles=meta.fixed_tiles,
            )
        meta.check_indices = False
        return out

    def forward_latent(self, q: torch.Tensor, rows: torch.Tensor, kv_cache: torch.Tensor,
                       meta: TritonAttentionMetadata, scale: float, *, value_dim: int) -> torch.Tensor:
        if kv_cache.dtype == FP8_KV_DTYPE:
            raise ConfigError("kv_cache_dtype", "multi-head latent attention keeps its latent cache in the model's "
                              "dtype; use --kv-cache-dtype auto")
        check = meta.check_indices
        # The one-part cache seen as keys and values at the same address (stride 0): each row is stored once.
        store_kvcache(rows, rows, kv_cache.expand(2, -1, -1, -1, -1), meta.slot_mapping, check_indices=check)
        splits = meta.num_splits if not meta.is_pure_decode else self._latent_splits(meta)
        out = paged_latent_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens, None if meta.is_pure_decode else meta.query_start_loc,
            scale, rank=value_dim, max_seq_len=meta.max_seq_len, num_splits=splits, check_indices=check,
            tickets=self.latent_tickets)
        meta.check_indices = False
        return out

    def _latent_splits(self, meta: TritonAttentionMetadata) -> int:
        # The latent kernel keeps the two-per-SM split rule: small grids in two were measured on
        # the paged decode kernel only.
        if meta.latent_splits is None:
            meta.latent_splits = choose_decode_splits(meta.num_tokens, 1, meta.max_seq_len, self.device,
                                                      small_grids_in_two=False)
        return meta.latent_splits


def _key_ends(batch: AttentionBatch, device: torch.device) -> torch.Tensor | None:
    ends = query_key_ends(batch)
    return None if ends is None else torch.tensor(ends, dtype=torch.int32, device=device)
