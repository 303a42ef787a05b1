"""Chunked local attention (Llama 4) in the decode and prefill kernels against the torch reference,
under the interpreter. Keys before the chunk of each sequence's first query are NaN: no query may
see them, so a kernel that reads one (even to give it no weight) fails. Chunks of 8 and 24 tokens
against 64-key tiles cross tile and block edges at several offsets."""
import pytest
import torch
from corectl.backends.triton.attention.decode_attention import paged_decode_attention
from corectl.backends.triton.attention.prefill_attention import paged_prefill_attention
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, random_paged_batch
from corectl.backends.triton.reference import causal_attention_ref

SCALE = 0.3


def _batch(seq_lens, query_lens, chunk):
    batch = random_paged_batch(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                               dtype=torch.float32, store_new_tokens=True)
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        positions = torch.arange((seq_len - query_len) // chunk * chunk)
        blocks = batch.block_tables[i, positions // 8].long()
        batch.kv_cache[:, blocks, positions % 8] = float("nan")
    return batch


@pytest.mark.parametrize("chunk", [8, 24])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_chunks(chunk, num_splits, assert_close):
    batch = _batch([5, 24, 25, 150], [1, 1, 1, 1], chunk)
    out = paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE,
                                 max_seq_len=150, num_splits=num_splits, attention_chunk=chunk)
    assert_close(out, contiguous_attention_ref(batch, SCALE, attention_chunk=chunk))


@pytest.mark.parametrize("chunk", [8, 24])
def test_prefill_chunks(chunk, assert_close):
    batch = _batch([13, 90, 140, 66], [13, 70, 33, 1], chunk)
    out = paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                  SCALE, max_query_len=70, attention_chunk=chunk)
    assert_close(out, contiguous_attention_ref(batch, SCALE, attention_chunk=chunk))


def test_reference_chunks_are_transformers_chunks():
    """The reference's mask is transformers' chunked causal mask (Llama 4)."""
    from transformers.masking_utils import chunked_overlay

    q, k, v = torch.randn(20, 2, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    visible = torch.tensor([[bool(chunked_overlay(8, torch.zeros(1, dtype=torch.long))(0, 0, i, j)) and j <= i for j in range(20)] for i in range(20)])
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(causal_attention_ref(q, k, v, SCALE, attention_chunk=8), expected)


def test_rejects_a_chunk_with_a_window():
    batch = _batch([5], [1], 8)
    with pytest.raises(ValueError, match="attention_chunk must be a positive number of tokens, without a sliding"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE, max_seq_len=5,
                               attention_chunk=8, sliding_window=4)
