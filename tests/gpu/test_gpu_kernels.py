"""The Triton kernels at real model sizes on the GPU, against their torch references, in bf16."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl.backends.triton.bench.kernels import SMOLLM2, W6, Shapes, check_correctness  # noqa: E402
from corectl.backends.triton.attention.decode_attention import (  # noqa: E402
    choose_decode_splits,
    paged_decode_attention,
)
from corectl.backends.triton.reference import paged_attention_ref  # noqa: E402

QWEN3_06B = Shapes(num_seqs=32, context=2048, num_heads=16, num_kv_heads=8, head_dim=128, block_size=16,
                   hidden=1024, intermediate=3072)
# Relative L2 error of a bf16 kernel against an fp32 reference: a few bf16 roundings (2**-8 each).
REL_TOL = 1e-2


@pytest.mark.parametrize("shapes", [W6, QWEN3_06B, SMOLLM2], ids=["llama3-8b", "qwen3-0.6b", "smollm2"])
def test_kernels_match_references_at_model_sizes(shapes):
    torch.manual_seed(0)
    results = check_correctness(shapes, "cuda")
    for name, error in results:
        print(f"{name:<32} relative error {error:.2e}")
    failed = [name for name, error in results if not error < REL_TOL]
    assert not failed, f"kernels off their references: {failed}"
    assert dict(results)["store_kvcache"] == 0.0


def _random_decode_inputs(seq_lens, width, num_blocks, block_size, generator):
    """Block tables of distinct random blocks for each row (0 past its blocks); seq_lens as given."""
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    blocks = torch.randperm(num_blocks - 1, generator=generator) + 1
    used = 0
    for row, seq_len in enumerate(seq_lens):
        needed = -(-seq_len // block_size)
        tables[row, :needed] = blocks[used:used + needed].to(torch.int32)
        used += needed
    return tables, torch.tensor(seq_lens, dtype=torch.int32)


def test_decode_kernel_replays_in_a_cuda_graph():
    """One capture at a bucket's shape serves every later step: new lengths, new blocks, padding
    rows of length 0, all through the same tensors."""
    bucket, max_len, heads, kv_heads, head_dim, block_size = 16, 4096, 32, 8, 128, 16
    width = max_len // block_size
    num_blocks = bucket * width + 1
    device, scale = torch.device("cuda"), head_dim ** -0.5
    generator = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device).to(torch.bfloat16)
    q = torch.zeros(bucket, heads * head_dim, dtype=torch.bfloat16, device=device)
    tables = torch.zeros(bucket, width, dtype=torch.int32, device=device)
    seq_lens = torch.zeros(bucket, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    splits = choose_decode_splits(bucket, kv_heads, max_len, device)

    def decode():
        paged_decode_attention(q, kv_cache, tables, seq_lens, scale, max_seq_len=max_len, num_splits=splits,
                               out=out, check_indices=False)

    decode()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    for num_seqs in (bucket, 9, 1):
        lens = torch.randint(1, max_len + 1, (num_seqs,), generator=generator).tolist()
        lens[0] = max_len
        step_tables, step_lens = _random_decode_inputs(lens + [0] * (bucket - num_seqs), width, num_blocks,
                                                       block_size, generator)
        tables.copy_(step_tables)
        seq_lens.copy_(step_lens)
        q.copy_(torch.randn(bucket, heads * head_dim, generator=generator).to(torch.bfloat16))
        graph.replay()
        expected = paged_attention_ref(q[:num_seqs], kv_cache, tables[:num_seqs], seq_lens[:num_seqs],
                                       torch.arange(num_seqs + 1, dtype=torch.int32, device=device), scale)
        error = ((out[:num_seqs].float() - expected.float()).norm() / expected.float().norm()).item()
        assert error < REL_TOL, f"{num_seqs} rows: relative error {error:.2e}"
        assert torch.equal(out[num_seqs:], torch.zeros_like(out[num_seqs:]))


# (N, K) of the layers the rule was read off (llama3-8b, qwen3-0.6b) and of shapes it was not
# (qwen3-14b's qkv and down, gemma-2-9b's o and LM head, llama-3.2-3b's gate_up).
DENSE_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (4096, 1024),
                (1024, 3072), (151936, 1024), (7168, 5120), (5120, 17408), (3584, 4096), (256000, 3584),
                (16384, 3072)]


def _dense_cases():
    from corectl.backends.triton.gemm.gemv_configs import dense_decode_config

    return [(n, k, m) for n, k in DENSE_SHAPES for m in (1, 2, 4, 8) if dense_decode_config(m, n, k) is not None]


@pytest.mark.parametrize("n,k,m", _dense_cases())
def test_dense_decode_gemv_matches_f_linear_where_the_rule_takes_it(n, k, m):
    """(shape, batch) cases the dense GEMV takes from cuBLAS: the layer's kernel (`dense_linear`) at
    the rule's config against the fp32 product to bf16 rounding, the gated form (where the rule
    takes it) against silu_and_mul then the product, and a CUDA-graph replay on new inputs giving
    the eager bits."""
    from corectl.backends.triton.elementwise.activation import silu_and_mul
    from corectl.backends.triton.layer_kernels import triton_layer_kernels

    linear = triton_layer_kernels().dense_linear
    weight = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = linear(x, weight, None, False)
    assert out is not None
    ref = x.float() @ weight.float().t()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2 ** -8
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    gated = linear(gate_up, weight, None, True)
    if gated is not None:
        ref = silu_and_mul(gate_up).float() @ weight.float().t()
        assert ((gated.float() - ref).norm() / ref.norm()).item() < 2 ** -8
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear(x, weight, None, False)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, linear(x, weight, None, False))
