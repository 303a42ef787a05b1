"""Attention sinks (gpt-oss) in the decode and prefill kernels against the torch reference, under the
interpreter: a per-head logit joins each softmax's denominator, once per head whatever the number of
decode splits, with and without a sliding window."""
import pytest
import torch
from corectl.backends.triton.attention.decode_attention import paged_decode_attention
from corectl.backends.triton.attention.prefill_attention import paged_prefill_attention
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, random_paged_batch
from corectl.backends.triton.reference import causal_attention_ref

SCALE = 0.3
SINKS = torch.tensor([2.0, -1.0, 0.5, 4.0])


def _batch(seq_lens, query_lens):
    return random_paged_batch(seq_lens, query_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                              dtype=torch.float32, store_new_tokens=True)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_sinks(num_splits, window, assert_close):
    batch = _batch([5, 70, 150], [1, 1, 1])
    out = paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE,
                                 max_seq_len=150, num_splits=num_splits, sliding_window=window, sinks=SINKS)
    assert_close(out, contiguous_attention_ref(batch, SCALE, sliding_window=window, sinks=SINKS))


@pytest.mark.parametrize("window", [None, 8])
def test_prefill_sinks(window, assert_close):
    batch = _batch([13, 90, 66], [13, 20, 1])
    out = paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                  SCALE, max_query_len=20, sliding_window=window, sinks=SINKS)
    assert_close(out, contiguous_attention_ref(batch, SCALE, sliding_window=window, sinks=SINKS))


def test_sinks_change_the_result_as_transformers_computes_them():
    """The reference is transformers' eager gpt-oss attention (sink column, softmax, dropped), and
    sinks change its output: a kernel ignoring them fails the comparisons above."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, SINKS, False
    expected, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], mask, SCALE)
    torch.testing.assert_close(causal_attention_ref(q, k, v, SCALE, sinks=SINKS), expected[0])
    assert not torch.allclose(causal_attention_ref(q, k, v, SCALE), expected[0], atol=1e-3)


def test_rejects_sinks_of_the_wrong_shape():
    batch = _batch([5], [1])
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, SCALE, max_seq_len=5,
                               sinks=SINKS[:2])
