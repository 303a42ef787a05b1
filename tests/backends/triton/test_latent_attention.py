"""Paged latent attention (absorbed MLA) against the causal torch reference: decode unsplit and split,
and a prefill step with cached prefixes beside a decode row. Contexts sit in shuffled blocks and
every slot outside them is NaN; rows are rank + rope wide, the values their first `rank` numbers."""
import pytest
import torch
from corectl.backends.triton.attention.latent_attention import paged_latent_attention
from corectl.backends.triton.bench.paged_batch import random_paged_batch
from corectl.backends.triton.reference import causal_attention_ref

RANK, ROPE, HEADS, SCALE = 32, 16, 20, 0.2


def _latent_batch(seq_lens, query_lens, dtype):
    batch = random_paged_batch(seq_lens, query_lens, num_heads=HEADS, num_kv_heads=1, head_dim=RANK + ROPE,
                               block_size=4, dtype=dtype, store_new_tokens=True)
    return batch, batch.kv_cache[:1], batch.q.view(-1, HEADS, RANK + ROPE)


def _reference(batch, q):
    outs, start = [], 0
    for keys, query_len in zip(batch.keys, batch.query_lens):
        outs.append(causal_attention_ref(q[start:start + query_len], keys, keys[..., :RANK], SCALE))
        start += query_len
    return torch.cat(outs)


@pytest.mark.parametrize("dtype, num_splits", [(torch.float32, 1), (torch.bfloat16, 3)])
def test_decode_matches_reference(dtype, num_splits, assert_close):
    seq_lens = [77, 3, 0, 18]
    batch, cache, q = _latent_batch(seq_lens, [1, 1, 0, 1], dtype)
    # A padding row (length 0, as a CUDA graph pads a batch) takes a query row of its own.
    q = torch.cat((q[:2], torch.randn(1, HEADS, RANK + ROPE).to(dtype), q[2:]))
    out = paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, SCALE, rank=RANK,
                                 max_seq_len=max(seq_lens), num_splits=num_splits)
    rows = [0, 1, 3]
    assert_close(out[rows], _reference(batch, q[rows]), roundings=2)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_prefill_with_cached_prefix_matches_reference(assert_close):
    batch, cache, q = _latent_batch([29, 6, 40], [9, 6, 1], torch.float32)
    out = paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE,
                                 rank=RANK, max_seq_len=40)
    assert_close(out, _reference(batch, q))


def test_refuses_a_two_part_cache():
    batch = random_paged_batch([5], [1], num_heads=2, num_kv_heads=1, head_dim=RANK + ROPE, block_size=4,
                               dtype=torch.float32)
    with pytest.raises(ValueError, match="latent kv_cache must be"):
        paged_latent_attention(batch.q.view(1, 2, -1), batch.kv_cache, batch.block_tables, batch.seq_lens, None,
                               SCALE, rank=RANK, max_seq_len=5)
