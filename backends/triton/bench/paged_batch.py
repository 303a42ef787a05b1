"""Random paged-attention inputs with known contents, for the kernel tests and the benchmark.

Each sequence gets a random context of keys/values kept contiguous (the ground truth) and scattered
into randomly permuted cache blocks; every cache slot that holds no context is NaN, so a kernel
reading a wrong slot or a stale page produces NaN instead of a plausible number.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import causal_attention_ref


@dataclass
class PagedBatch:
    q: torch.Tensor                 # [T, Hq * D] new tokens' queries
    k: torch.Tensor                 # [T, Hk * D] new tokens' keys
    v: torch.Tensor                 # [T, Hk * D]
    kv_cache: torch.Tensor          # [2, num_blocks, block_size, Hk, D]
    block_tables: torch.Tensor      # [B, width] int32, padded with 0
    seq_lens: torch.Tensor          # [B] int32
    query_start_loc: torch.Tensor   # [B + 1] int32
    slot_mapping: torch.Tensor      # [T] int64
    keys: list[torch.Tensor]        # per sequence [seq_len, Hk, D], whole context
    values: list[torch.Tensor]
    query_lens: list[int]

    @property
    def seq_lens_list(self) -> list[int]:
        return [k.shape[0] for k in self.keys]


def random_paged_batch(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                       *, store_new_tokens: bool = False, spare_blocks: int = 3) -> PagedBatch:
    """A batch whose sequence i has seq_lens[i] tokens of context, the last query_lens[i] of them new.

    With `store_new_tokens` the new tokens' K/V are already in the cache (as after store_kvcache);
    otherwise their slots are NaN like every other unwritten slot.
    """
    if len(seq_lens) != len(query_lens) or any(q > s for q, s in zip(query_lens, seq_lens)):
        raise ValueError(f"need one query length <= seq_len per sequence, got {query_lens} for {seq_lens}")
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks).tolist()
    width = max(needed, default=0) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                          device=device)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    keys, values, slots, q_rows = [], [], [], []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        blocks = [order.pop() for _ in range(needed[i])]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.arange(seq_len)
        seq_slots = (tables[i, positions // block_size].long() * block_size + positions % block_size).to(device)
        kv = _randn((2, seq_len, num_kv_heads, head_dim), dtype, device)
        written = seq_len if store_new_tokens else seq_len - query_len
        flat[:, seq_slots[:written]] = kv[:, :written]
        keys.append(kv[0])
        values.append(kv[1])
        slots.append(seq_slots[seq_len - query_len:])
        q_rows.append(_randn((query_len, num_heads * head_dim), dtype, device))
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    new_k = torch.cat([k[k.shape[0] - n:] for k, n in zip(keys, query_lens)]).reshape(-1, num_kv_heads * head_dim)
    new_v = torch.cat([v[v.shape[0] - n:] for v, n in zip(values, query_lens)]).reshape(-1, num_kv_heads * head_dim)
    return PagedBatch(
        q=torch.cat(q_rows), k=new_k, v=new_v, kv_cache=kv_cache, block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc=starts.to(device),
        slot_mapping=torch.cat(slots), keys=keys, values=values, query_lens=list(query_lens),
    )


def contiguous_attention_ref(batch: PagedBatch, scale: float, **masking) -> torch.Tensor:
    """Causal attention of the batch's queries over the contiguous ground-truth contexts, fp32 [T, Hq * D];
    `masking`: `sliding_window` and `logits_soft_cap` as `causal_attention_ref` takes them."""
    head_dim = batch.kv_cache.shape[-1]
    outs = []
    start = 0
    for keys, values, query_len in zip(batch.keys, batch.values, batch.query_lens):
        q = batch.q[start:start + query_len].view(query_len, -1, head_dim)
        outs.append(causal_attention_ref(q, keys, values, scale, **masking).reshape(query_len, -1))
        start += query_len
    return torch.cat(outs)


def poison_outside_windows(batch: PagedBatch, window: int) -> None:
    """Overwrite with NaN every cached key and value that no query of its sequence may see under a
    sliding window of `window` tokens, as if its block had gone back to the pool and been reused: a
    kernel that reads one (even to multiply it by zero) returns NaN."""
    block_size = batch.kv_cache.shape[2]
    for i, (seq_len, query_len) in enumerate(zip(batch.seq_lens_list, batch.query_lens)):
        first_seen = max(seq_len - query_len - window + 1, 0)
        positions = torch.arange(first_seen)
        blocks = batch.block_tables[i, positions // block_size].long()
        batch.kv_cache[:, blocks, positions % block_size] = float("nan")


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)
