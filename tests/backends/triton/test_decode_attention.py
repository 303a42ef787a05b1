"""Paged decode attention against torch references, split-KV included.

Contexts live in shuffled, non-contiguous blocks; every cache slot outside a context is NaN.
"""
import numpy as np
import pytest
import torch
from corectl.attention import longest_first
from corectl.backends.triton.attention.decode_attention import (
    MAX_SPLITS,
    decode_num_splits,
    longest_first_pays,
    paged_decode_attention,
)
from corectl.backends.triton.reference import paged_attention_ref
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, random_paged_batch

SCALE = 0.25


def _decode(batch, num_splits=None, max_seq_len=None):
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    max_seq_len = max(batch.seq_lens_list) if max_seq_len is None else max_seq_len
    return paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE,
                                  max_seq_len=max_seq_len, num_splits=num_splits, out=out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_reference(dtype, num_splits, assert_close):
    seq_lens = [141, 3, 17]
    batch = random_paged_batch(seq_lens, [1, 1, 1], num_heads=6, num_kv_heads=2, head_dim=32, block_size=4,
                               dtype=dtype, store_new_tokens=True)
    out = _decode(batch, num_splits)
    assert_close(out, contiguous_attention_ref(batch, SCALE))
    paged = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, SCALE)
    assert_close(out, paged, roundings=2)


def test_many_splits_of_long_and_short_contexts(assert_close):
    """More splits than some sequences have keys: the empty splits must drop out of the combine."""
    batch = random_paged_batch([130, 2], [1, 1], num_heads=4, num_kv_heads=1, head_dim=16, block_size=16,
                               dtype=torch.float32, store_new_tokens=True)
    assert_close(_decode(batch, num_splits=5), contiguous_attention_ref(batch, SCALE))


def test_head_dim_not_a_power_of_two(assert_close):
    batch = random_paged_batch([9, 20], [1, 1], num_heads=6, num_kv_heads=2, head_dim=24, block_size=4,
                               dtype=torch.bfloat16, store_new_tokens=True)
    assert_close(_decode(batch, num_splits=2), contiguous_attention_ref(batch, SCALE))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_zero_length_rows_yield_zeros(num_splits, assert_close):
    """CUDA-graph padding rows have seq_len 0: they must produce zeros, not NaN, and leave others intact."""
    batch = random_paged_batch([12, 12], [1, 1], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=torch.float32, store_new_tokens=True)
    expected = contiguous_attention_ref(batch, SCALE)
    batch.seq_lens[1] = 0
    out = _decode(batch, num_splits)
    assert_close(out[0], expected[0])
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_longest_first_order_changes_no_bit(num_splits):
    """The order only changes when each row's programs start, not what they compute."""
    batch = random_paged_batch([7, 141, 3, 60, 141], [1] * 5, num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=4, dtype=torch.float32, store_new_tokens=True)
    order = torch.from_numpy(longest_first(batch.seq_lens.numpy()))
    assert order.tolist() == [1, 4, 3, 0, 2]
    plain = _decode(batch, num_splits)
    ordered = paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE,
                                     max_seq_len=141, num_splits=num_splits, order=order)
    assert torch.equal(ordered, plain)


def test_the_order_is_read_only_where_the_grid_outnumbers_what_runs_at_once():
    # The interpreter counts one compute unit: two programs run "at once".
    assert not longest_first_pays(1, 2, 1, torch.device("cpu"))
    assert longest_first_pays(3, 1, 1, torch.device("cpu"))


def test_longest_first_ranks_row_groups_by_their_longest_row():
    seq_lens = np.array([5, 6, 0, 0, 9, 8, 9, 10], dtype=np.int32)
    assert longest_first(seq_lens).tolist() == [7, 4, 6, 5, 1, 0, 2, 3]
    assert longest_first(seq_lens, rows_per_seq=2).tolist() == [3, 2, 0, 1]
    assert longest_first(np.zeros(0, dtype=np.int32)).tolist() == []


def test_rejects_an_order_that_is_not_a_permutation_of_the_groups():
    batch = _small_batch()
    args = (batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE)
    with pytest.raises(ValueError, match="order must be int32"):
        paged_decode_attention(*args, max_seq_len=9, order=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="order has 1 entries for 2 row groups"):
        paged_decode_attention(*args, max_seq_len=9, order=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"order values must lie in \[0, 2\)"):
        paged_decode_attention(*args, max_seq_len=9, order=torch.tensor([0, 2], dtype=torch.int32))


def test_split_choice_follows_batch_and_context():
    assert decode_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=4096, num_compute_units=132) == 16
    # 512 programs: two splits (four programs an SM), 1,024: none.
    assert decode_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=4096, num_compute_units=132) == 2
    assert decode_num_splits(num_seqs=32, num_kv_heads=8, max_seq_len=4096, num_compute_units=132) == 2
    assert decode_num_splits(num_seqs=128, num_kv_heads=8, max_seq_len=4096, num_compute_units=132) == 1
    assert decode_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=300, num_compute_units=132) == 1
    # Verify steps' row groups keep the two-per-SM rule.
    assert decode_num_splits(64, 8, 4096, 132, small_grids_in_two=False) == 1
    assert decode_num_splits(num_seqs=4, num_kv_heads=8, max_seq_len=32768, num_compute_units=132) == 8
    assert decode_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100_000, num_compute_units=132) == 33
    assert decode_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=4096, num_compute_units=132) == 1
    assert decode_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100, num_compute_units=132) == 1
    assert decode_num_splits(num_seqs=4, num_kv_heads=2, max_seq_len=10**6, num_compute_units=1000) == MAX_SPLITS


def _small_batch():
    return random_paged_batch([9, 5], [1, 1], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                              dtype=torch.float32, store_new_tokens=True)


def test_rejects_out_of_range_indices():
    batch = _small_batch()
    num_blocks = batch.kv_cache.shape[1]
    batch.block_tables[1, 0] = num_blocks
    with pytest.raises(ValueError, match=rf"block_tables values must lie in \[0, {num_blocks}\)"):
        _decode(batch)
    batch = _small_batch()
    capacity = batch.block_tables.shape[1] * 4
    batch.seq_lens[0] = capacity + 1
    with pytest.raises(ValueError, match=rf"seq_lens values must lie in \[0, {capacity + 1}\)"):
        _decode(batch)


def test_rejects_wrong_shapes_and_dtypes():
    batch = _small_batch()
    args = (batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE)
    with pytest.raises(ValueError, match="q must be \\[num_seqs, num_heads \\* 16\\] with num_heads a multiple of 2"):
        paged_decode_attention(batch.q[:, :80], *args, max_seq_len=9)
    with pytest.raises(ValueError, match=r"q must be \[num_tokens, num_heads \* head_dim\] = \[2, 96\]"):
        paged_decode_attention(batch.q[:1], *args, max_seq_len=9)
    with pytest.raises(ValueError, match="q and kv_cache must share a dtype"):
        paged_decode_attention(batch.q.bfloat16(), *args, max_seq_len=9)
    with pytest.raises(ValueError, match="block_tables must be int32, got torch.int64"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables.long(), batch.seq_lens, SCALE,
                               max_seq_len=9)
    with pytest.raises(ValueError, match="seq_lens has 1 entries but block_tables has 2 rows"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens[:1], SCALE,
                               max_seq_len=9)
    with pytest.raises(ValueError, match=rf"num_splits must lie in \[1, {MAX_SPLITS}\], got 0"):
        paged_decode_attention(batch.q, *args, max_seq_len=9, num_splits=0)


def test_unsplit_fp8_launches_take_the_measured_tiles():
    from corectl.backends.triton.attention.decode_attention import FP8_LARGE_BATCH, FP8_UNSPLIT, DecodeConfig, decode_config

    assert decode_config(torch.float8_e4m3fn, 1, 64) == FP8_UNSPLIT != DecodeConfig()
    assert decode_config(torch.float8_e4m3fn, 1, 256) == FP8_LARGE_BATCH != FP8_UNSPLIT
    assert decode_config(torch.float8_e4m3fn, 8, 1) == decode_config(torch.bfloat16, 1, 256) == DecodeConfig()
