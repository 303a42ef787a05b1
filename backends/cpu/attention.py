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

Rows do not depend on the batch (greedy output alone equals output among other requests and after
a prefix-cache hit, tests/backends/cpu/test_batch_invariance.py): torch's CPU flash kernel rounds a
row differently when its valid keys reach the vector tail of the key length, and when a block of
queries holds a single row (a GEMV). So every step pads its key length to a multiple of KEY_ALIGN
under an explicit mask (also for one fresh prompt, which an `is_causal` call would otherwise serve
on its own K/V), and pads the query rows of a prefill to an even count, never one row left over.
On that torch path a decode row in a step that also prefills (chunked prefill beside decodes) takes
the padded path instead of the grouped one, and soft-capped or sink layers spell the math out with
matmuls: neither is covered.

fp32 layers without soft-capping, sinks or chunks, in steps without bidirectional spans, skip all
of that where the C kernels build (`fused_ops.paged_attention`: the cache writes and every query
row's attention in one call, each row by the same operations whether it decodes or prefills, alone
or batched); the torch path below serves the rest and is what the fused one was checked against.

`--kv-cache-dtype float16` keeps K and V in fp16 whatever the model's dtype: half an fp32 cache's bytes
(twice the tokens in the same memory, half the reads of a decode step). The fused attention rounds
each new row to fp16 as it writes it and widens rows back to fp32 as it reads them; the torch path
casts the same way around its writes and gathers.

Sliding-window layers narrow the step's mask to each query's window (built once per step and
window); soft-capped layers (Gemma 2) and layers with attention sinks (gpt-oss: a per-head logit
joins the softmax's denominator) spell the attention out, since SDPA can do neither. Chunked
local layers (Llama 4) narrow the mask to each query's chunk, like windows. A batch with
bidirectional spans (an image's tokens in Gemma 3) widens each query's causal edge to its span's
end (`query_key_ends`) in every mask.

Latent attention (`forward_latent`, DeepSeek's MLA) gathers one row per context position from the
one-part cache, shared by every head as key (and its first `value_dim` numbers as value), through
the same indices and masks; a decode step groups all heads on that one row, like GQA.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from corectl import envs
from corectl.attention import AttentionBackend, AttentionBatch, query_key_ends

from .fused_ops import KV_DTYPES, fused_library, paged_attention

# Key lengths are padded to a multiple of this (a multiple of every vector width of the CPU kernels).
KEY_ALIGN = 64


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor
    key_index: torch.Tensor | None        # [B * Lmax]: cache slot of every padded context position
    mask: torch.Tensor                    # [B, 1, Qmax, Lmax] bool
    query_index: torch.Tensor | None      # [B, Qmax]: packed-token row of each padded query (None: decode)
    token_index: torch.Tensor | None      # [T]: padded row of each packed token (None: decode)
    num_seqs: int
    max_query_len: int
    max_seq_len: int                      # Lmax: the longest context, padded to KEY_ALIGN
    # [B, Qmax] context position of each padded query (padding rows repeat their sequence's last
    # one) and [B] context lengths: what the masks of windowed layers are built from.
    query_pos: torch.Tensor
    seq_lens: torch.Tensor
    # [B, Qmax] first context position each padded query does not see (its position + 1, or its
    # bidirectional span's end); None: query_pos + 1 everywhere.
    key_end: torch.Tensor | None = None
    # [2 * B * Lmax]: key_index into a layer's cache seen as [2 * slots] rows, keys then values;
    # made by the first layer of the step (the metadata does not know the cache's size).
    kv_index: torch.Tensor | None = None
    # (window, chunk) -> mask, built by the first layer with that window or chunk in the step
    window_masks: dict[tuple[int | None, int | None], torch.Tensor] = field(default_factory=dict)
    # For the fused attention (fused_ops.paged_attention; None where it cannot serve the step): the
    # [B, max_blocks] int32 block tables, and per packed row its sequence and the end of its keys
    fused: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    block_size: int = 0
    # The whole-layer call's per-step arguments (fused_layer.py), made by the step's first fused layer
    fused_step: object = None

    def mask_for(self, sliding_window: int | None, attention_chunk: int | None = None) -> torch.Tensor:
        """The attention mask of a layer: `mask`, narrowed to each query's window or chunk when it
        has one."""
        if sliding_window is None and attention_chunk is None:
            return self.mask
        key = (sliding_window, attention_chunk)
        mask = self.window_masks.get(key)
        if mask is None:
            cols = torch.arange(self.max_seq_len)[None, None, :]
            pos = self.query_pos[:, :, None]
            mask = _visible(cols, self.query_pos, self.key_end) & (cols < self.seq_lens[:, None, None])
            if sliding_window is not None:
                mask &= cols > pos - sliding_window
            if attention_chunk is not None:
                mask &= cols >= pos // attention_chunk * attention_chunk
            mask = self.window_masks[key] = mask.unsqueeze(1)
        return mask


def _visible(cols: torch.Tensor, query_pos: torch.Tensor, key_end: torch.Tensor | None) -> torch.Tensor:
    """[B, Qmax, L]: the causal edge of each query, widened to its bidirectional span's end."""
    if key_end is None:
        return cols <= query_pos[:, :, None]
    return cols < key_end[:, :, None]


def _key_index(batch: AttentionBatch, cols: torch.Tensor) -> torch.Tensor:
    # Padding columns past the table read its last block (finite K/V of some request, masked out).
    block_cols = batch.block_tables[:, (cols // batch.block_size).clamp(max=batch.block_tables.shape[1] - 1)].long()
    return (block_cols * batch.block_size + cols % batch.block_size).view(-1)


def _key_len(max_seq_len: int) -> int:
    return -(-max_seq_len // KEY_ALIGN) * KEY_ALIGN


def _decode_metadata(batch: AttentionBatch, cols: torch.Tensor) -> SDPAMetadata:
    s_lens = torch.tensor(batch.seq_lens_host)
    mask = (cols[None, :] < s_lens[:, None]).view(len(s_lens), 1, 1, -1)
    return SDPAMetadata(batch.slot_mapping, _key_index(batch, cols), mask, None, None,
                        batch.num_seqs, 1, len(cols), query_pos=(s_lens - 1)[:, None], seq_lens=s_lens)


def _fused_rows(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(block tables, each packed row's sequence, the end of each row's keys) for the fused attention,
    or None where it cannot serve: no kernel (or CORECTL_FUSED_KERNELS=0), or bidirectional spans
    (whose windows the torch path measures from the query's position, not its keys' end)."""
    if (not envs.fused_kernels_enabled() or fused_library() is None or batch.block_tables.dtype != torch.int32
            or batch.bidirectional_spans):
        return None
    q_lens, s_lens = batch.query_lens_host, batch.seq_lens_host
    seqs = torch.arange(batch.num_seqs)
    if batch.is_pure_decode:
        return batch.block_tables.contiguous(), seqs, torch.tensor(s_lens)
    ends = [s - q + i + 1 for q, s in zip(q_lens, s_lens) for i in range(q)]
    return batch.block_tables.contiguous(), seqs.repeat_interleave(torch.tensor(q_lens)), torch.tensor(ends)


def _padded_metadata(batch: AttentionBatch, cols: torch.Tensor) -> SDPAMetadata:
    q_lens, s_lens = batch.query_lens_host, batch.seq_lens_host
    b, q_max = batch.num_seqs, batch.max_query_len + batch.max_query_len % 2
    q_lens_t = torch.tensor(q_lens)
    s_lens_t = torch.tensor(s_lens)
    rows = torch.arange(q_max)
    starts = batch.query_start_loc[:-1].long()
    query_index = (starts[:, None] + rows[None, :]).clamp(max=sum(q_lens) - 1)
    valid_q = rows[None, :] < q_lens_t[:, None]
    token_index = (torch.arange(b)[:, None] * q_max + rows[None, :])[valid_q]
    # Padding rows take their sequence's last position, so they see keys (never a fully masked row).
    query_pos = torch.minimum((s_lens_t - q_lens_t)[:, None] + rows[None, :], (s_lens_t - 1)[:, None])
    ends = query_key_ends(batch)
    # Padding rows keep their causal edge: a span of another sequence could leave them no key.
    key_end = None if ends is None else torch.where(valid_q, torch.tensor(ends)[query_index], query_pos + 1)
    mask = _visible(cols[None, None, :], query_pos, key_end) & (cols[None, None, :] < s_lens_t[:, None, None])
    return SDPAMetadata(
        slot_mapping=batch.slot_mapping,
        key_index=_key_index(batch, cols),
        mask=mask.unsqueeze(1),
        query_index=query_index,
        token_index=token_index,
        num_seqs=b,
        max_query_len=q_max,
        max_seq_len=len(cols),
        query_pos=query_pos,
        seq_lens=s_lens_t,
        key_end=key_end,
    )


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            soft_cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., heads, rows, D] with as many or fewer (grouped) key heads; soft-capped scores
    and sinks (`sinks` shaped [heads, rows or 1, 1] to broadcast against the scores), which SDPA
    cannot take, go through the same math spelled out, scores and softmax in fp32."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=keys.shape[-3] != q.shape[-3])
    group = q.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    kv_cache_dtypes = ("auto", "float16")
    supports_sinks = True
    supports_chunked_attention = True

    def build_metadata(self, batch: AttentionBatch, check_indices: bool = True) -> SDPAMetadata:
        # Indices are never read back here, so there is nothing to skip.
        cols = torch.arange(_key_len(batch.max_seq_len))
        meta = _decode_metadata(batch, cols) if batch.is_pure_decode else _padded_metadata(batch, cols)
        meta.fused, meta.block_size = _fused_rows(batch), batch.block_size
        return meta

    def forward(self, q, k, v, kv_cache, meta: SDPAMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                attention_chunk: int | None = None) -> torch.Tensor:
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if (meta.fused is not None and logits_soft_cap is None and sinks is None and attention_chunk is None
                and q.dtype == torch.float32 and kv_cache.dtype in KV_DTYPES and kv_cache.is_contiguous()):
            tables, seqs, ends = meta.fused
            return paged_attention(q, k, v, kv_cache, meta.slot_mapping, tables, meta.block_size, seqs, ends,
                                   h, hk, d, sliding_window, scale)
        per_head = None if sinks is None else sinks.view(h, 1, 1)
        k = k.view(-1, hk, d).to(kv_cache.dtype)
        v = v.view(-1, hk, d).to(kv_cache.dtype)
        key_cache, value_cache = kv_cache[0].view(-1, hk, d), kv_cache[1].view(-1, hk, d)
        key_cache.index_copy_(0, meta.slot_mapping, k)
        value_cache.index_copy_(0, meta.slot_mapping, v)
        # Keys outside a window are read and given no weight (blocks freed by the KV manager still
        # hold finite K/V of some request), so windowed layers share the step's one gather.
        mask = meta.mask_for(sliding_window, attention_chunk)
        b = meta.num_seqs
        rows = kv_cache.view(-1, hk, d)
        if meta.kv_index is None:
            meta.kv_index = torch.cat((meta.key_index, meta.key_index + rows.shape[0] // 2))
        # One gather along dim 0 for both (index_select along dim 1 of [2, slots] is ~20% slower).
        pages = rows.index_select(0, meta.kv_index).view(2, b, meta.max_seq_len, hk, d).to(q.dtype)
        keys, values = pages[0].transpose(1, 2), pages[1].transpose(1, 2)
        if meta.query_index is None:
            grouped = q.view(b, hk, h // hk, d)
            out = _attend(grouped, keys, values, mask, scale, logits_soft_cap,
                          sinks=None if sinks is None else sinks.view(hk, h // hk, 1))
            return out.reshape(b, h * d)
        queries = q.view(-1, h, d)[meta.query_index].transpose(1, 2)
        out = _attend(queries, keys, values, mask, scale, logits_soft_cap, sinks=per_head)
        out = out.transpose(1, 2).reshape(b * meta.max_query_len, h * d)
        return out[meta.token_index]

    def forward_latent(self, q, rows, kv_cache, meta: SDPAMetadata, scale: float, *, value_dim: int) -> torch.Tensor:
        # One gathered row per context position serves every head as key, its first value_dim numbers as value.
        h, d, b = self.num_heads, self.head_dim, meta.num_seqs
        cache = kv_cache.view(-1, d)
        cache.index_copy_(0, meta.slot_mapping, rows.to(cache.dtype))
        keys = cache.index_select(0, meta.key_index).view(b, 1, meta.max_seq_len, d).to(q.dtype)
        values = keys[..., :value_dim]
        if meta.query_index is None:
            return _attend(q.view(b, 1, h, d), keys, values, meta.mask, scale, None).view(b, h, value_dim)
        out = _attend(q[meta.query_index].transpose(1, 2), keys, values, meta.mask, scale, None)
        return out.transpose(1, 2).reshape(b * meta.max_query_len, h, value_dim)[meta.token_index]
