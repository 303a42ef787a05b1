"""FP8 (e4m3) KV cache in the Triton kernels against the torch references: the store divides by the
per-tensor scales and saturates, decode and prefill read the e4m3 values back times the scales.

The references read the same e4m3 cache, so kernel and reference differ only by fp32 rounding;
that the cache is lossy is measured once, against the full-precision attention."""
import pytest
import torch
from corectl.backends.triton.attention.decode_attention import paged_decode_attention
from corectl.backends.triton.attention.kv_cache_store import store_kvcache
from corectl.backends.triton.attention.prefill_attention import paged_prefill_attention
from corectl.backends.triton.reference import paged_attention_ref, store_kvcache_ref
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, random_paged_batch

FP8 = torch.float8_e4m3fn
SCALE = 0.3
K_SCALE, V_SCALE = 0.05, 0.02


def _to_fp8(batch, k_scale=K_SCALE, v_scale=V_SCALE):
    """The batch's cache as an FP8 cache would hold it (NaN slots stay NaN)."""
    scales = torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    return (batch.kv_cache.float() / scales).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_scales_and_saturates(dtype):
    cache = torch.zeros(2, 6, 4, 2, 16, dtype=FP8)
    k = (torch.randn(5, 32) * 10).to(dtype)
    v = (torch.randn(5, 32) * 10).to(dtype)
    k[0, :4] = 1e4  # past 448 * k_scale: saturates instead of overflowing
    slots = torch.tensor([3, 0, -1, 22, 9])
    expected = store_kvcache_ref(k, v, cache, slots, k_scale=2.0, v_scale=0.5)
    store_kvcache(k, v, cache, slots, k_scale=2.0, v_scale=0.5)
    assert torch.equal(cache.float(), expected.float())
    assert cache.view(2, -1, 32)[0, 3, :4].float().tolist() == [448.0] * 4


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 30])
def test_decode_reads_fp8(num_splits, window, assert_close):
    batch = random_paged_batch([141, 3, 70], [1, 1, 1], num_heads=6, num_kv_heads=2, head_dim=32, block_size=8,
                               dtype=torch.float32, store_new_tokens=True)
    cache = _to_fp8(batch)
    out = paged_decode_attention(batch.q, cache, batch.block_tables, batch.seq_lens, SCALE, max_seq_len=141,
                                 num_splits=num_splits, sliding_window=window, k_scale=K_SCALE, v_scale=V_SCALE)
    expected = paged_attention_ref(batch.q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE,
                                   sliding_window=window, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_reads_fp8(dtype, assert_close):
    batch = random_paged_batch([90, 21, 40], [25, 21, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=dtype, store_new_tokens=True)
    cache = _to_fp8(batch)
    out = paged_prefill_attention(batch.q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE,
                                  max_query_len=25, k_scale=K_SCALE, v_scale=V_SCALE)
    expected = paged_attention_ref(batch.q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE,
                                   k_scale=K_SCALE, v_scale=V_SCALE)
    assert_close(out, expected, roundings=2)


def test_fp8_cache_stays_near_full_precision():
    """The whole path, store then decode, against attention over the unquantized K/V: e4m3 keeps
    3 mantissa bits, so outputs move by a few percent, and the scales must not be dropped."""
    batch = random_paged_batch([60, 33], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                               dtype=torch.float32)
    cache = torch.zeros(batch.kv_cache.shape, dtype=FP8)
    flat = batch.kv_cache.view(2, -1, 32)
    context = torch.cat([torch.arange(s) for s in batch.seq_lens_list])
    rows = torch.cat([(batch.block_tables[i, torch.arange(s) // 4].long() * 4 + torch.arange(s) % 4)
                      for i, s in enumerate(batch.seq_lens_list)])
    keys = torch.cat([k.reshape(-1, 32) for k in batch.keys])
    values = torch.cat([v.reshape(-1, 32) for v in batch.values])
    assert context.numel() == rows.numel() == flat[0, rows].shape[0]
    store_kvcache(keys, values, cache, rows, k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_decode_attention(batch.q, cache, batch.block_tables, batch.seq_lens, SCALE, max_seq_len=60,
                                 k_scale=K_SCALE, v_scale=V_SCALE)
    exact = contiguous_attention_ref(batch, SCALE)
    error = ((out - exact).norm() / exact.norm()).item()
    assert error < 0.1
    unscaled = paged_decode_attention(batch.q, cache, batch.block_tables, batch.seq_lens, SCALE, max_seq_len=60)
    assert ((unscaled - exact).norm() / exact.norm()).item() > 0.5
