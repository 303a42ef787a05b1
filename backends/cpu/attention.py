"""Paged attention on CPU with torch: gather each sequence's K/V pages, then one batched SDPA call.

The pages are gathered with one `index_select` over a flat slot index built once per step
(advanced indexing with a 2-D index is ~6x slower). Every sequence in the step is padded to the
longest query and context; a boolean mask keeps each query to its own causal prefix. Padded
query rows attend to key 0 so no row is fully masked (SDPA would return NaN); their outputs are
dropped when unpadding. A pure-decode step needs no query padding at all.

Decode runs SDPA in fp32 even for bf16 models: torch's CPU flash kernel is 2-5x slower in bf16
for a single query row (batch 16 x 160 keys: 1.5 ms bf16, 0.33 ms with the casts included).
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

    def build_metadata(self, batch: AttentionBatch) -> SDPAMetadata:
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
        shape = (meta.num_seqs, meta.max_seq_len, hk, d)
        keys = key_cache.index_select(0, meta.key_index).view(shape).transpose(1, 2)
        values = value_cache.index_select(0, meta.key_index).view(shape).transpose(1, 2)
        if meta.query_index is None:
            return self._decode(q.view(-1, h, 1, d), keys, values, meta.mask, scale)
        queries = q.view(-1, h, d)[meta.query_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(meta.num_seqs * meta.max_query_len, h * d)
        return out[meta.token_index]

    def _decode(self, queries, keys, values, mask, scale: float) -> torch.Tensor:
        dtype = queries.dtype
        if dtype != torch.float32:
            queries, keys, values = queries.float(), keys.float(), values.float()
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.reshape(out.shape[0], -1).to(dtype)
