"""Paged attention on CPU with torch: gather each sequence's K/V pages, then one batched SDPA call.

The pages of K and V are gathered with one `index_select` over a flat slot index built once per
step (advanced indexing with a 2-D index is ~6x slower). Every sequence in the step is padded to
the longest query and context; a boolean mask keeps each query to its own causal prefix. Padded
query rows attend to key 0 so no row is fully masked (SDPA would return NaN); their outputs are
dropped when unpadding.

A pure-decode step needs no query padding, and its query heads are grouped by the KV head they
share: SDPA then sees `num_heads / num_kv_heads` query rows per KV head instead of one row per
query head, which torch's CPU flash kernel runs 3-5x faster in bf16 (16 sequences x 160 keys:
1.5 ms one row per head, 0.4 ms grouped) and without expanding K/V for GQA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from corectl.attention import AttentionBackend, AttentionBatch


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor
    key_index: torch.Tensor | None        # [B * Lmax]: cache slot of every padded context position
    mask: torch.Tensor | None             # [B, 1, Qmax, Lmax] bool, None when nothing is padded
    query_index: torch.Tensor | None      # [B, Qmax]: packed-token row of each padded query (None: decode)
    token_index: torch.Tensor | None      # [T]: padded row of each packed token (None: decode)
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    fresh_single_prefill: bool            # one sequence, no cached prefix: attend to the new K/V directly
    # [2 * B * Lmax]: key_index into a layer's cache seen as [2 * slots] rows, keys then values;
    # made by the first layer of the step (the metadata does not know the cache's size).
    kv_index: torch.Tensor | None = None


def _key_index(batch: AttentionBatch, cols: torch.Tensor) -> torch.Tensor:
    block_cols = batch.block_tables[:, cols // batch.block_size].long()
    return (block_cols * batch.block_size + cols % batch.block_size).view(-1)


def _decode_metadata(batch: AttentionBatch, cols: torch.Tensor) -> SDPAMetadata:
    s_lens = batch.seq_lens_host
    mask = None
    if min(s_lens) != batch.max_seq_len:
        mask = (cols[None, :] < torch.tensor(s_lens)[:, None]).view(len(s_lens), 1, 1, -1)
    return SDPAMetadata(batch.slot_mapping, _key_index(batch, cols), mask, None, None,
                        batch.num_seqs, 1, batch.max_seq_len, False)


def _padded_metadata(batch: AttentionBatch, cols: torch.Tensor) -> SDPAMetadata:
    q_lens, s_lens = batch.query_lens_host, batch.seq_lens_host
    b, q_max = batch.num_seqs, batch.max_query_len
    q_lens_t = torch.tensor(q_lens)
    s_lens_t = torch.tensor(s_lens)
    rows = torch.arange(q_max)
    starts = batch.query_start_loc[:-1].long()
    query_index = (starts[:, None] + rows[None, :]).clamp(max=sum(q_lens) - 1)
    valid_q = rows[None, :] < q_lens_t[:, None]
    token_index = (torch.arange(b)[:, None] * q_max + rows[None, :])[valid_q]
    query_pos = (s_lens_t - q_lens_t)[:, None] + rows[None, :]
    mask = (cols[None, None, :] <= query_pos[:, :, None]) & (cols[None, None, :] < s_lens_t[:, None, None])
    needs_mask = q_max > 1 or len(set(s_lens)) > 1
    return SDPAMetadata(
        slot_mapping=batch.slot_mapping,
        key_index=_key_index(batch, cols),
        mask=mask.unsqueeze(1) if needs_mask else None,
        query_index=query_index,
        token_index=token_index,
        num_seqs=b,
        max_query_len=q_max,
        max_seq_len=batch.max_seq_len,
        fresh_single_prefill=False,
    )


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, batch: AttentionBatch, check_indices: bool = True) -> SDPAMetadata:
        # Indices are never read back here, so there is nothing to skip.
        if batch.num_seqs == 1 and batch.query_lens_host[0] == batch.seq_lens_host[0]:
            return SDPAMetadata(batch.slot_mapping, None, None, None, None, 1, batch.max_query_len,
                                batch.max_seq_len, True)
        cols = torch.arange(batch.max_seq_len)
        if batch.is_pure_decode:
            return _decode_metadata(batch, cols)
        return _padded_metadata(batch, cols)

    def forward(self, q, k, v, kv_cache, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        k = k.view(-1, hk, d)
        v = v.view(-1, hk, d)
        key_cache, value_cache = kv_cache[0].view(-1, hk, d), kv_cache[1].view(-1, hk, d)
        key_cache.index_copy_(0, meta.slot_mapping, k)
        value_cache.index_copy_(0, meta.slot_mapping, v)
        if meta.fresh_single_prefill:
            out = F.scaled_dot_product_attention(
                q.view(1, -1, h, d).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                v.unsqueeze(0).transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True,
            )
            return out.transpose(1, 2).reshape(-1, h * d)
        b = meta.num_seqs
        rows = kv_cache.view(-1, hk, d)
        if meta.kv_index is None:
            meta.kv_index = torch.cat((meta.key_index, meta.key_index + rows.shape[0] // 2))
        # One gather along dim 0 for both (index_select along dim 1 of [2, slots] is ~20% slower).
        pages = rows.index_select(0, meta.kv_index).view(2, b, meta.max_seq_len, hk, d)
        keys, values = pages[0].transpose(1, 2), pages[1].transpose(1, 2)
        if meta.query_index is None:
            grouped = q.view(b, hk, h // hk, d)
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.mask, scale=scale)
            return out.reshape(b, h * d)
        queries = q.view(-1, h, d)[meta.query_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * meta.max_query_len, h * d)
        return out[meta.token_index]
