"""Eager paged attention, one sequence at a time, as `transformers`' eager attention computes it.

Scores are `q @ k^T * scale`, soft-capped where the layer says, masked causally (and to the layer's
sliding window), softmaxed in fp32, then applied to v. No padding and
no fused kernel, so it is easy to audit and a fair reference for faster backends on the same
paged KV-cache layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from corectl.attention import AttentionBackend, AttentionBatch


@dataclass
class SequenceSlice:
    query_start: int
    query_len: int
    key_slots: torch.Tensor      # [seq_len] cache slot of every context position, in order


@dataclass
class EagerMetadata:
    slot_mapping: torch.Tensor
    sequences: list[SequenceSlice]


class EagerReferenceBackend(AttentionBackend):
    name = "torch_eager"

    def build_metadata(self, batch: AttentionBatch, check_indices: bool = True) -> EagerMetadata:
        # A reference backend trusts its caller's indices: it validates nothing.
        sequences, start = [], 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_host, batch.seq_lens_host)):
            positions = torch.arange(seq_len, device=batch.block_tables.device)
            blocks = batch.block_tables[i, positions // batch.block_size].long()
            sequences.append(SequenceSlice(start, query_len, blocks * batch.block_size + positions % batch.block_size))
            start += query_len
        return EagerMetadata(batch.slot_mapping, sequences)

    def forward(self, q, k, v, kv_cache, meta: EagerMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        hk, d = self.num_kv_heads, self.head_dim
        key_cache, value_cache = kv_cache[0].view(-1, hk, d), kv_cache[1].view(-1, hk, d)
        key_cache.index_copy_(0, meta.slot_mapping, k.view(-1, hk, d))
        value_cache.index_copy_(0, meta.slot_mapping, v.view(-1, hk, d))
        outputs = [
            self._attend(q[seq.query_start:seq.query_start + seq.query_len],
                         key_cache[seq.key_slots], value_cache[seq.key_slots], scale, sliding_window,
                         logits_soft_cap)
            for seq in meta.sequences
        ]
        return torch.cat(outputs)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                window: int | None, soft_cap: float | None) -> torch.Tensor:
        """q: [n, H*D] for the last n of the s context positions; keys, values: [s, Hk, D]."""
        n, s, group = q.shape[0], keys.shape[0], self.num_heads // self.num_kv_heads
        queries = q.view(n, self.num_heads, self.head_dim).transpose(0, 1)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(1, 2)) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        # Query row r sits at context position s - n + r and sees keys up to and including it
        # (and, with a window W, none more than W - 1 before it).
        hidden = torch.ones(n, s, dtype=torch.bool, device=q.device).triu(s - n + 1)
        if window is not None:
            hidden |= torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
