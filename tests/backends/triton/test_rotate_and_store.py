"""The rotary embedding and the KV store in one launch (`rotate_and_store_kvcache`) against the two
kernels it replaces run in sequence: the same bits in q, in the cache (bf16, fp32 and FP8 caches,
padding slots skipped), Qwen3's per-head norms included, and k left as it came."""
import pytest
import torch
from corectl.backends.triton.attention.kv_cache_store import rotate_and_store_kvcache, store_kvcache
from corectl.backends.triton.elementwise.rotary import qk_norm_rotary, rotary_embedding

NUM_BLOCKS, BLOCK_SIZE, Q_HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 6, 4, 4, 2, 16, 64


def _tables(dtype):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _step(dtype, num_tokens=7):
    """A packed qkv output, positions, slots with two padding tokens."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(num_tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[[1, 4]] = -1
    return qkv, positions, slots


def _views(qkv):
    """q [T, Hq, D], k [T, Hk, D], v [T, Hk * D]: views of `qkv`, as the attention layers take them."""
    q, k, v = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(-1, Q_HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), v


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("norms", [False, True], ids=["rotary", "qk-norm-rotary"])
def test_one_launch_gives_the_bits_of_rotary_then_store(dtype, cache_dtype, norms):
    cos, sin = _tables(dtype)
    weights = (torch.rand(HEAD_DIM).to(dtype) + 0.5, torch.rand(HEAD_DIM).to(dtype) + 0.5) if norms else (None, None)
    scales = dict(k_scale=0.5, v_scale=2.0) if cache_dtype == torch.float8_e4m3fn else {}
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(cache_dtype)
    qkv, positions, slots = _step(dtype)
    fused_qkv, fused_cache = qkv.clone(), cache.clone()
    # The reference: the two kernels the layer ran before.
    q, k, v = _views(qkv)
    if norms:
        qk_norm_rotary(positions, q, k, *weights, 1e-6, cos, sin)
    else:
        rotary_embedding(positions, q, k, cos, sin)
    store_kvcache(k.flatten(1), v, cache, slots, **scales)
    fq, fk, fv = _views(fused_qkv)
    k_before = fk.clone()
    rotate_and_store_kvcache(positions, fq, fk, fv, fused_cache, slots, cos, sin, *weights, 1e-6, **scales)
    assert torch.equal(fq, q)
    assert torch.equal(fused_cache.float(), cache.float())
    assert torch.equal(fk, k_before)


def test_heads_whose_width_is_no_power_of_two():
    """Phi-3's 96-wide heads, say: masked halves and rows (here 3 KV heads of 24)."""
    q_heads, kv_heads, head_dim, num_tokens = 6, 3, 24, 5
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    emb = torch.arange(MAX_POS).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((emb, emb), dim=-1).cos(), torch.cat((emb, emb), dim=-1).sin()
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(num_tokens, q_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads * head_dim, generator=gen)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen)
    slots = torch.tensor([3, -1, 0, 9, 5])
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    reference_q, reference_k, fused_cache = q.clone(), k.clone(), cache.clone()
    rotary_embedding(positions, reference_q, reference_k, cos, sin)
    store_kvcache(reference_k.flatten(1), v, cache, slots)
    rotate_and_store_kvcache(positions, q, k, v, fused_cache, slots, cos, sin)
    assert torch.equal(q, reference_q) and torch.equal(fused_cache, cache)


def test_refuses_a_partial_rotation_and_mismatched_weights():
    cos, sin = _tables(torch.float32)
    qkv, positions, slots = _step(torch.float32)
    q, k, v = _views(qkv)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="the fused store rotates whole heads"):
        rotate_and_store_kvcache(positions, q, k, v, cache, slots, cos[:, :8], sin[:, :8])
    with pytest.raises(ValueError, match=r"k_weight must be torch.float32 \[16\]"):
        rotate_and_store_kvcache(positions, q, k, v, cache, slots, cos, sin, torch.ones(HEAD_DIM), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="slot_mapping values must lie in"):
        rotate_and_store_kvcache(positions, q, k, v, cache, slots + 100, cos, sin)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_a_model_through_the_triton_backend_decodes_the_same_bits_fused(qk_norm, monkeypatch):
    """Llama and Qwen3 layers (random weights, the Triton layer kernels, fp32) over the Triton
    backend: a prefill step and a decode step give the same logits and caches with the rotation
    fused into the store (decode steps, the captured ones on a GPU) as with the layer's own rotary
    kernel before it."""
    from corectl.attention import AttentionBatch, ForwardContext
    from corectl.backends.triton.attention.backend import TritonAttentionBackend
    from corectl.backends.triton.layer_kernels import triton_layer_kernels
    from corectl.models.kernels import install_layer_kernels
    from corectl.models.llama import LlamaForCausalLM
    from corectl.models.qwen import Qwen3ForCausalLM
    from corectl.worker.worker import build_model
    from transformers import LlamaConfig

    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                     max_position_embeddings=MAX_POS)
    model = build_model(Qwen3ForCausalLM if qk_norm else LlamaForCausalLM, hf, torch.float32, "cpu", MAX_POS)
    for param in model.parameters():
        param.data.normal_(0.0, 0.3)
    install_layer_kernels(model, triton_layer_kernels())
    backend = TritonAttentionBackend(Q_HEADS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), BLOCK_SIZE)
    steps = [([5, 9, 2, 7, 1], 0), ([3], 5)]  # (new tokens, cached before them) of one sequence

    from corectl.backends.triton.attention import backend as backend_module

    fused_calls = []

    def counted(*args, **kwargs):
        fused_calls.append(kwargs)
        rotate_and_store_kvcache(*args, **kwargs)

    monkeypatch.setattr(backend_module, "rotate_and_store_kvcache", counted)

    def run(fused: bool):
        monkeypatch.setattr(TritonAttentionBackend, "fuses_rotary",
                            lambda self, meta: fused and meta.is_pure_decode)
        caches = [torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)) for _ in range(2)]
        logits = []
        for tokens, cached in steps:
            n, total = len(tokens), cached + len(tokens)
            batch = AttentionBatch(
                query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([total], dtype=torch.int32),
                block_tables=torch.tensor([[2, 0]], dtype=torch.int32),
                slot_mapping=torch.tensor([(2 if p < BLOCK_SIZE else 0) * BLOCK_SIZE + p % BLOCK_SIZE
                                           for p in range(cached, total)]),
                query_lens_host=[n], seq_lens_host=[total], max_query_len=n, max_seq_len=total, block_size=BLOCK_SIZE)
            ctx = ForwardContext(backend, backend.build_metadata(batch), caches)
            hidden = model(torch.tensor(tokens), torch.arange(cached, total), ctx)
            logits.append(model.compute_logits(hidden))
        return logits, caches

    fused_logits, fused_caches = run(True)
    assert len(fused_calls) == 2  # every layer of the decode step
    logits, caches = run(False)
    assert len(fused_calls) == 2
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, logits))
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, caches))
    assert caches[0].abs().sum() > 0
