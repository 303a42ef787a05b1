"""Prefill/extend attention over the paged cache against torch references.

Covers cold prefills, prefix-cache hits, chunked prefills and decode rows in one launch, with
contexts in shuffled blocks and NaN in every slot that holds no context.
"""
import pytest
import torch
from corectl.backends.triton.attention.prefill_attention import (
    paged_prefill_attention,
    prefill_block_m,
)
from corectl.backends.triton.reference import paged_attention_ref
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, random_paged_batch

SCALE = 0.3


def _prefill(batch):
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    return paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   batch.query_start_loc, SCALE, max_query_len=max(batch.query_lens), out=out)


CASES = {
    # name: (seq_lens, query_lens)
    "cold_prefill": ([13, 7, 22], [13, 7, 22]),
    "prefix_hits": ([21, 30, 9], [5, 14, 9]),
    "mixed_chunks_and_decodes": ([26, 11, 40, 6], [1, 11, 8, 1]),
    "long_query_wide_tiles": ([50, 33], [45, 30]),
    # Contexts past two key tiles, so the unmasked bulk loop runs before the causal edge.
    "long_contexts": ([150, 75], [20, 70]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, dtype, assert_close):
    seq_lens, query_lens = CASES[case]
    batch = random_paged_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=dtype, store_new_tokens=True)
    out = _prefill(batch)
    assert_close(out, contiguous_attention_ref(batch, SCALE))
    if dtype == torch.float32:
        paged = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                    batch.query_start_loc, SCALE)
        assert_close(out, paged)


def test_cases_cover_both_tile_heights():
    """Keep the cases above honest if the tile heuristic changes: short and tall tiles both run."""
    assert {prefill_block_m(group=3, max_query_len=max(q)) for _, q in CASES.values()} == {16, 64}
    assert prefill_block_m(group=32, max_query_len=1) == 32


@pytest.mark.parametrize("block_size, head_dim, heads", [(16, 32, (4, 4)), (4, 24, (8, 1)), (16, 16, (6, 2))])
def test_block_sizes_head_dims_and_group_sizes(block_size, head_dim, heads, assert_close):
    batch = random_paged_batch([35, 4, 18], [9, 4, 2], num_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16, store_new_tokens=True)
    assert_close(_prefill(batch), contiguous_attention_ref(batch, SCALE))


def test_reads_new_tokens_from_the_pages():
    """The kernel takes no k/v: if store_kvcache has not run, the new tokens' NaN slots show up."""
    batch = random_paged_batch([10, 6], [3, 6], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=torch.float32, store_new_tokens=False)
    assert torch.isnan(_prefill(batch)).all()


def _small_batch():
    return random_paged_batch([9, 5], [3, 5], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                              dtype=torch.float32, store_new_tokens=True)


def _call(batch, max_query_len=5):
    return paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   batch.query_start_loc, SCALE, max_query_len=max_query_len)


def test_rejects_inconsistent_lengths():
    batch = _small_batch()
    with pytest.raises(ValueError, match="a query of 5 tokens exceeds max_query_len=4"):
        _call(batch, max_query_len=4)
    batch.query_start_loc[2] = 7
    with pytest.raises(ValueError, match=r"query_start_loc must run from 0 to the number of tokens \(8\)"):
        _call(batch)
    batch = _small_batch()
    batch.seq_lens[0] = 2
    with pytest.raises(ValueError, match="sequence 0: seq_len 2 must be at least its 3 new tokens"):
        _call(batch)
    batch = _small_batch()
    batch.query_start_loc[1] = 9
    with pytest.raises(ValueError, match="query_start_loc must be non-decreasing"):
        _call(batch)


def test_rejects_out_of_range_blocks_and_bad_shapes():
    batch = _small_batch()
    batch.block_tables[0, 1] = -1
    with pytest.raises(ValueError, match=r"block_tables values must lie in \[0, "):
        _call(batch)
    batch = _small_batch()
    with pytest.raises(ValueError, match=r"block_tables has 2 rows, so seq_lens needs 2 entries and query_start_loc 3"):
        paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc[:2], SCALE, max_query_len=5)
    with pytest.raises(ValueError, match="q must be float32, float16 or bfloat16, got torch.int64"):
        paged_prefill_attention(batch.q.long(), batch.kv_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, SCALE, max_query_len=5)
