"""store_kvcache against its torch reference: pages written at the slots, nothing else touched."""
import pytest
import torch
from corectl.backends.triton.attention.kv_cache_store import store_kvcache
from corectl.backends.triton.reference import store_kvcache_ref

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 5, 4, 2, 16


def _random_cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)


def _random_slots(num_tokens: int, num_padding: int) -> torch.Tensor:
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_padding]] = -1
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writes_slots_and_skips_padding(dtype):
    num_tokens = 9
    k = torch.randn(num_tokens, KV_HEADS * HEAD_DIM).to(dtype)
    v = torch.randn(num_tokens, KV_HEADS * HEAD_DIM).to(dtype)
    cache = _random_cache(dtype)
    slots = _random_slots(num_tokens, num_padding=2)
    expected = store_kvcache_ref(k, v, cache, slots)
    store_kvcache(k, v, cache, slots)
    assert torch.equal(cache, expected)


def test_reads_k_and_v_from_a_packed_qkv_projection():
    num_tokens, q_width, kv_width = 6, 3 * KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width)
    k, v = qkv[:, q_width:q_width + kv_width], qkv[:, q_width + kv_width:]
    cache = _random_cache(torch.float32)
    slots = _random_slots(num_tokens, num_padding=0).to(torch.int32)
    expected = store_kvcache_ref(k, v, cache, slots)
    store_kvcache(k, v, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("bad_slot, message", [
    (NUM_BLOCKS * BLOCK_SIZE, r"slot_mapping values must lie in \[-1, 20\)"),
    (-2, r"slot_mapping values must lie in \[-1, 20\)"),
])
def test_rejects_out_of_range_slots(bad_slot, message):
    k = torch.randn(3, KV_HEADS * HEAD_DIM)
    slots = torch.tensor([0, bad_slot, 5])
    with pytest.raises(ValueError, match=message):
        store_kvcache(k, k.clone(), _random_cache(torch.float32), slots)


def test_rejects_wrong_shapes_and_dtypes():
    cache = _random_cache(torch.float32)
    k = torch.randn(3, KV_HEADS * HEAD_DIM)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, num_heads \* head_dim\] = \[3, 32\]"):
        store_kvcache(k[:, :16], k, cache, slots)
    with pytest.raises(ValueError, match="k and kv_cache must share a dtype"):
        store_kvcache(k.bfloat16(), k.bfloat16(), cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64, int32"):
        store_kvcache(k, k, cache, slots.float())
    with pytest.raises(ValueError, match=r"kv_cache must be \[2, num_blocks, block_size, num_kv_heads, head_dim\]"):
        store_kvcache(k, k, torch.cat([cache, cache]), slots)
    with pytest.raises(ValueError, match="kv_cache must have 5 dimensions"):
        store_kvcache(k, k, cache[0], slots)
