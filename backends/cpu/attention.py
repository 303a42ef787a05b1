"""Paged attention on CPU with torch: gather each sequence's K/V pages, then one batched SDPA call.

Every sequence in the step is padded to the longest query and context; a boolean mask keeps each
query to its own causal prefix. Padded query rows attend to key 0 so no row is fully masked (SDPA
would return NaN); their outputs are dropped when unpadding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corectl.attention import AttentionBackend, AttentionBatch


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor
    key_slots: torch.Tensor | None        # [B, Lmax]: cache slot of every context position
    mask: torch.Tensor | None             # [B, 1, Qmax, Lmax] bool, None when nothing is padded
    query_index: torch.Tensor | None      # [B, Qmax]: packed-token row of each padded query
    token_index: torch.Tensor | None      # [T]: padded row of each packed token
    num_seqs: int
    max_query_len: int
    fresh_single_prefill: bool            # one sequence, no cached prefix: attend to the new K/V directly


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, batch: AttentionBatch) -> SDPAMetadata:
        q_lens, s_lens = batch.query_lens_host, batch.seq_lens_host
        b, q_max, s_max = batch.num_seqs, batch.max_query_len, batch.max_seq_len
        fresh = b == 1 and q_lens[0] == s_lens[0]
        if fresh:
            return SDPAMetadata(batch.slot_mapping, None, None, None, None, 1, q_max, True)
        cols = torch.arange(s_max)
        block_cols = batch.block_tables[:, cols // batch.block_size].long()
        key_slots = block_cols * batch.block_size + cols % batch.block_size
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
            key_slots=key_slots,
            mask=mask.unsqueeze(1) if needs_mask else None,
            query_index=query_index,
            token_index=token_index,
            num_seqs=b,
            max_query_len=q_max,
            fresh_single_prefill=False,
        )

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
        keys = key_cache[meta.key_slots].transpose(1, 2)
        values = value_cache[meta.key_slots].transpose(1, 2)
        queries = q.view(-1, h, d)[meta.query_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(meta.num_seqs * meta.max_query_len, h * d)
        return out[meta.token_index]
