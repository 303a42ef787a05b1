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


# llama3-8b's and mistral-7b's attention heads, a bucket's context bound.
MAX_LEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4096, 32, 8, 128, 16
WIDTH = MAX_LEN // BLOCK_SIZE


class _DecodeGraphInputs:
    """What a captured decode reads, for a bucket of rows: a random bf16 cache of a block table's
    worth of blocks a row, and the query, table and length tensors each step is copied into."""

    def __init__(self, bucket: int):
        self.bucket, self.num_blocks = bucket, bucket * WIDTH + 1
        self.generator = torch.Generator().manual_seed(0)
        shape = (2, self.num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.kv_cache = torch.randn(shape, device="cuda").to(torch.bfloat16)
        self.q = torch.zeros(bucket, HEADS * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.tables = torch.zeros(bucket, WIDTH, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.zeros(bucket, dtype=torch.int32, device="cuda")

    def next_step(self, lens: list[int], rows: int = 1) -> None:
        """New lengths (0: padding), distinct random blocks, each group of `rows` on its first row's table."""
        tables, seq_lens = _random_decode_inputs(lens, WIDTH, self.num_blocks, BLOCK_SIZE, self.generator)
        self.tables.copy_(tables[::rows].repeat_interleave(rows, 0))
        self.seq_lens.copy_(seq_lens)
        self.q.copy_(torch.randn(self.bucket, HEADS * HEAD_DIM, generator=self.generator).to(torch.bfloat16))


def test_decode_kernel_replays_in_a_cuda_graph():
    """One capture at a bucket's shape serves every later step: new lengths, new blocks, padding
    rows of length 0, all through the same tensors."""
    bucket, scale = 16, HEAD_DIM ** -0.5
    x = _DecodeGraphInputs(bucket)
    out = torch.empty_like(x.q)
    splits = choose_decode_splits(bucket, KV_HEADS, MAX_LEN, x.q.device)

    def decode():
        paged_decode_attention(x.q, x.kv_cache, x.tables, x.seq_lens, scale, max_seq_len=MAX_LEN, num_splits=splits,
                               out=out, check_indices=False)

    decode()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    for num_seqs in (bucket, 9, 1):
        lens = torch.randint(1, MAX_LEN + 1, (num_seqs,), generator=x.generator).tolist()
        lens[0] = MAX_LEN
        x.next_step(lens + [0] * (bucket - num_seqs))
        graph.replay()
        expected = paged_attention_ref(x.q[:num_seqs], x.kv_cache, x.tables[:num_seqs], x.seq_lens[:num_seqs],
                                       torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"), scale)
        error = ((out[:num_seqs].float() - expected.float()).norm() / expected.float().norm()).item()
        assert error < REL_TOL, f"{num_seqs} rows: relative error {error:.2e}"
        assert torch.equal(out[num_seqs:], torch.zeros_like(out[num_seqs:]))


@pytest.mark.parametrize("bucket,rows,sinks", [(1, 1, False), (4, 4, False), (8, 1, True)])
def test_one_launch_decode_replays_the_two_launch_bits(bucket, rows, sinks, monkeypatch):
    """A split decode whose last split programs combine (persistent tickets, as the backend's),
    captured and replayed over new lengths, blocks and padding rows (row groups of a verify step;
    sinks with a window), gives the bits of the decode and combine launches, and hands its tickets
    back zeroed after every replay."""
    x = _DecodeGraphInputs(bucket)
    tickets = torch.zeros(1024, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x.q)
    splits = choose_decode_splits(bucket // rows, KV_HEADS, MAX_LEN, x.q.device)
    assert splits > 1
    extra = {"sinks": torch.randn(HEADS, device="cuda"), "sliding_window": 3000} if sinks else {}

    def decode(**buffers):
        return paged_decode_attention(x.q, x.kv_cache, x.tables, x.seq_lens, HEAD_DIM ** -0.5, max_seq_len=MAX_LEN,
                                      num_splits=splits, check_indices=False, rows_per_seq=rows, **extra, **buffers)

    decode(out=out, tickets=tickets)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(out=out, tickets=tickets)
    for step in range(3):
        lens = torch.randint(1, MAX_LEN + 1, (bucket,), generator=x.generator)
        lens[bucket - step:] = 0
        x.next_step(lens.tolist(), rows)
        graph.replay()
        torch.cuda.synchronize()
        assert not tickets.any()
        monkeypatch.setenv("CORECTL_DECODE_ONE_LAUNCH", "0")
        assert torch.equal(out, decode())
        monkeypatch.delenv("CORECTL_DECODE_ONE_LAUNCH")

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
