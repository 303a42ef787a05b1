"""Sliding-window and soft-capped attention in the decode and prefill kernels against the torch references.

Every cached key no query of its sequence may see is NaN (`poison_outside_windows`), as if its block
had been returned to the pool and reused: a kernel that reads one fails. The key tiles are 64 keys
wide, so windows here cross tile and block edges at several offsets.
"""
import pytest
import torch
from corectl.backends.triton.attention.decode_attention import paged_decode_attention
from corectl.backends.triton.attention.prefill_attention import paged_prefill_attention
from corectl.backends.triton.reference import causal_attention_ref, paged_attention_ref
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, poison_outside_windows, random_paged_batch

SCALE = 0.3


def _decode(batch, num_splits, **masking):
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    return paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE,
                                  max_seq_len=max(batch.seq_lens_list), num_splits=num_splits, out=out, **masking)


def _prefill(batch, **masking):
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    return paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   batch.query_start_loc, SCALE, max_query_len=max(batch.query_lens), out=out,
                                   **masking)


# Contexts around the window: shorter than it, equal, one past, and several key tiles past it.
DECODE_SEQ_LENS = [5, 20, 21, 150, 203]


@pytest.mark.parametrize("window", [1, 20, 64, 70, 500])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window(window, num_splits, assert_close):
    batch = random_paged_batch(DECODE_SEQ_LENS, [1] * 5, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                               dtype=torch.float32, store_new_tokens=True)
    poison_outside_windows(batch, window)
    out = _decode(batch, num_splits, sliding_window=window)
    assert_close(out, contiguous_attention_ref(batch, SCALE, sliding_window=window))


def test_decode_window_bf16(assert_close):
    batch = random_paged_batch([130, 9], [1, 1], num_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
                               dtype=torch.bfloat16, store_new_tokens=True)
    poison_outside_windows(batch, 77)
    assert_close(_decode(batch, 2, sliding_window=77), contiguous_attention_ref(batch, SCALE, sliding_window=77))


PREFILL_CASES = {
    # name: (seq_lens, query_lens)
    "cold_prefills": ([13, 90, 140], [13, 90, 140]),
    "chunks_after_cached_prefixes": ([150, 75, 200], [20, 70, 33]),
    "mixed_with_decodes": ([140, 11, 66], [1, 11, 1]),
}


@pytest.mark.parametrize("window", [1, 8, 66, 100, 1000])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_window(case, window, assert_close):
    seq_lens, query_lens = PREFILL_CASES[case]
    batch = random_paged_batch(seq_lens, query_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=torch.float32, store_new_tokens=True)
    poison_outside_windows(batch, window)
    out = _prefill(batch, sliding_window=window)
    assert_close(out, contiguous_attention_ref(batch, SCALE, sliding_window=window))
    paged = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, SCALE, sliding_window=window)
    assert_close(out, paged)


def test_window_changes_the_result():
    """The comparisons above would pass for a kernel ignoring windows only if the window changed nothing."""
    batch = random_paged_batch([90], [1], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                               dtype=torch.float32, store_new_tokens=True)
    windowed = _decode(batch, 1, sliding_window=30)
    assert not torch.allclose(windowed, _decode(batch, 1), atol=1e-3)


@pytest.mark.parametrize("window", [None, 40])
def test_soft_cap_decode_and_prefill(window, assert_close):
    batch = random_paged_batch([70, 130], [70, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                               dtype=torch.float32, store_new_tokens=True)
    batch.q *= 8  # scores far past the cap, so capping matters
    masking = dict(sliding_window=window, logits_soft_cap=5.0)
    expected = contiguous_attention_ref(batch, SCALE, **masking)
    assert_close(_prefill(batch, **masking), expected)
    decode = random_paged_batch([130, 3], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                                dtype=torch.float32, store_new_tokens=True)
    decode.q *= 8
    assert_close(_decode(decode, 2, **masking), contiguous_attention_ref(decode, SCALE, **masking))
    assert not torch.allclose(expected, contiguous_attention_ref(batch, SCALE, sliding_window=window), atol=1e-3)


def test_reference_window_is_transformers_convention():
    """A window of W: position p sees p - W < j <= p (W keys, its own included), as transformers masks it."""
    keys = torch.zeros(6, 1, 4)
    values = torch.arange(6, dtype=torch.float32)[:, None, None].expand(6, 1, 4)
    out = causal_attention_ref(torch.zeros(6, 1, 4), keys, values, 1.0, sliding_window=2)
    # Equal scores: each position averages its visible values.
    assert out[:, 0, 0].tolist() == [0.0, 0.5, 1.5, 2.5, 3.5, 4.5]


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_rejects_bad_windows_and_caps(bad):
    batch = random_paged_batch([9], [1], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                               dtype=torch.float32, store_new_tokens=True)
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens"):
        _decode(batch, 1, sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens"):
        _prefill(batch, sliding_window=bad)
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        _decode(batch, 1, logits_soft_cap=min(bad, 0))
