"""Bidirectional spans (an image's tokens in Gemma 3) in the prefill kernel against the torch
reference, under the interpreter: a query inside a span sees the span's later keys too, with and
without a sliding window; spans cross query tiles (32 rows here) and cache blocks, and sequences
without spans stay causal beside them."""
import pytest
import torch
from corectl.attention import AttentionBatch, query_key_ends
from corectl.backends.triton.attention.prefill_attention import paged_prefill_attention
from corectl.backends.triton.bench.paged_batch import random_paged_batch
from corectl.backends.triton.reference import causal_attention_ref

SCALE = 0.3
SEQ_LENS, QUERY_LENS = [13, 90, 140, 66], [13, 70, 33, 1]
# Context positions [start, end) per sequence, each inside that sequence's new tokens.
SPANS = [[(2, 9)], [(25, 61), (70, 72)], [], [(65, 66)]]


def _key_ends(batch) -> torch.Tensor:
    attn = AttentionBatch(batch.query_start_loc, batch.seq_lens, batch.block_tables, torch.zeros(0), QUERY_LENS,
                          SEQ_LENS, max(QUERY_LENS), max(SEQ_LENS), 8, bidirectional_spans=SPANS)
    return torch.tensor(query_key_ends(attn), dtype=torch.int32)


def _reference(batch, spans, **masking) -> torch.Tensor:
    head_dim = batch.kv_cache.shape[-1]
    outs, start = [], 0
    for keys, values, query_len, seq_spans in zip(batch.keys, batch.values, batch.query_lens, spans):
        q = batch.q[start:start + query_len].view(query_len, -1, head_dim)
        outs.append(causal_attention_ref(q, keys, values, SCALE, bidirectional_spans=seq_spans, **masking)
                    .reshape(query_len, -1))
        start += query_len
    return torch.cat(outs)


@pytest.mark.parametrize("sliding_window", [None, 16])
def test_prefill_sees_the_later_keys_of_its_span(sliding_window, assert_close):
    batch = random_paged_batch(SEQ_LENS, QUERY_LENS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                               dtype=torch.float32, store_new_tokens=True)
    out = paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                  SCALE, max_query_len=70, sliding_window=sliding_window,
                                  query_key_end=_key_ends(batch))
    assert_close(out, _reference(batch, SPANS, sliding_window=sliding_window))
    # The spans change the answer: causal attention alone is not what the kernel computed.
    causal = _reference(batch, [[]] * len(SPANS), sliding_window=sliding_window)
    assert not torch.allclose(out.float(), causal, atol=1e-3)


def test_reference_spans_are_transformers_blockwise_mask():
    """The reference's mask is transformers' Gemma 3 composition: (causal or same block) and window."""
    from transformers.masking_utils import blockwise_overlay, sliding_window_overlay

    ids = torch.tensor([[-1, -1, 0, 0, 0, 0, -1, 1, 1, -1]])
    q, k, v = torch.randn(10, 2, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    block, window = blockwise_overlay(ids), sliding_window_overlay(3)
    visible = torch.tensor([[bool((j <= i or block(0, 0, i, j)) and window(0, 0, i, j)) for j in range(10)]
                            for i in range(10)])
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    got = causal_attention_ref(q, k, v, SCALE, sliding_window=3, bidirectional_spans=[(2, 6), (7, 9)])
    torch.testing.assert_close(got, expected)
