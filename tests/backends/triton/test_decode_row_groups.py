"""The decode kernel's row groups (`rows_per_seq`): a verify step's k + 1 rows of a request attend
together over one block table, each causally up to its own position, against the torch reference.

Requests draft different numbers of tokens, so groups carry padding rows (seq_len 0) after their
real rows, and a whole group of padding stands for graph padding; cached slots outside every
context are NaN, so a row that reads past its request's keys fails.
"""
import pytest
import torch
from corectl.backends.triton.attention.decode_attention import paged_decode_attention
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, poison_outside_windows, random_paged_batch

SCALE = 0.3
ROWS = 4


def _grouped(batch, rows: int):
    """The batch's query rows laid out `rows` to a request (padding rows after each request's
    tokens, then one all-padding group), with each row's own seq_len, and where its real rows went."""
    num_groups = len(batch.query_lens) + 1
    q = torch.zeros(num_groups * rows, batch.q.shape[1], dtype=batch.q.dtype)
    seq_lens = torch.zeros(num_groups * rows, dtype=torch.int32)
    tables = torch.zeros(num_groups * rows, batch.block_tables.shape[1], dtype=torch.int32)
    real, start = [], 0
    for i, (seq_len, query_len) in enumerate(zip(batch.seq_lens_list, batch.query_lens)):
        at = torch.arange(i * rows, i * rows + query_len)
        q[at] = batch.q[start:start + query_len]
        seq_lens[at] = torch.arange(seq_len - query_len + 1, seq_len + 1, dtype=torch.int32)
        tables[i * rows:(i + 1) * rows] = batch.block_tables[i]
        real.append(at)
        start += query_len
    return q, seq_lens, tables, torch.cat(real)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_groups_match_causal_attention(num_splits, dtype, assert_close):
    batch = random_paged_batch([150, 7, 70], [4, 1, 3], num_heads=6, num_kv_heads=2, head_dim=32,
                               block_size=4, dtype=dtype, store_new_tokens=True)
    q, seq_lens, tables, real = _grouped(batch, ROWS)
    out = paged_decode_attention(q, batch.kv_cache, tables, seq_lens, SCALE, max_seq_len=150,
                                 num_splits=num_splits, rows_per_seq=ROWS)
    assert_close(out[real], contiguous_attention_ref(batch, SCALE))
    padding = torch.ones(out.shape[0], dtype=torch.bool)
    padding[real] = False
    assert torch.isfinite(out[padding]).all()
    assert torch.equal(out[-ROWS:], torch.zeros_like(out[-ROWS:])), "an all-padding group attends to nothing"


@pytest.mark.parametrize("window", [3, 64, 66])
def test_row_groups_under_a_sliding_window(window, assert_close):
    """Rows of one request start their windows at different keys, across a tile edge at 66."""
    batch = random_paged_batch([200, 131], [4, 2], num_heads=4, num_kv_heads=1, head_dim=16, block_size=8,
                               dtype=torch.float32, store_new_tokens=True)
    poison_outside_windows(batch, window)
    q, seq_lens, tables, real = _grouped(batch, ROWS)
    out = paged_decode_attention(q, batch.kv_cache, tables, seq_lens, SCALE, max_seq_len=200, num_splits=2,
                                 rows_per_seq=ROWS, sliding_window=window)
    assert_close(out[real], contiguous_attention_ref(batch, SCALE, sliding_window=window))


def test_row_groups_give_the_rows_one_row_per_program_gives():
    """Grouping changes which program reads a row's keys, not what the row attends to."""
    batch = random_paged_batch([90, 33], [3, 4], num_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=torch.float32, store_new_tokens=True)
    q, seq_lens, tables, real = _grouped(batch, ROWS)
    sinks = torch.randn(8)
    grouped = paged_decode_attention(q, batch.kv_cache, tables, seq_lens, SCALE, max_seq_len=90,
                                     num_splits=1, rows_per_seq=ROWS, sinks=sinks)
    alone = paged_decode_attention(q, batch.kv_cache, tables, seq_lens, SCALE, max_seq_len=90,
                                   num_splits=1, sinks=sinks)
    torch.testing.assert_close(grouped[real], alone[real], rtol=1e-5, atol=1e-5)


def test_rows_must_fill_whole_groups():
    batch = random_paged_batch([9, 5], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=torch.float32, store_new_tokens=True)
    with pytest.raises(ValueError, match="rows_per_seq must be >= 1 and divide the 2 rows"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE,
                               max_seq_len=9, rows_per_seq=3)
