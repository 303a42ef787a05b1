"""The batch-invariant mode's kernels under the interpreter: the invariant GEMM's rows are the same
bits alone and in batches of other sizes (and close to torch's fp32 product), and the prefill
attention kernel with fixed tiles gives a row the same bits whether it is a decode row, part of a
cold prefill, or a prefill after a cached prefix, in any batch."""
import numpy as np
import pytest
import torch
from corectl.attention import AttentionBatch
from corectl.backends.triton.attention.backend import TritonAttentionBackend
from corectl.backends.triton.attention.prefill_attention import paged_prefill_attention
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, random_paged_batch
from corectl.backends.triton.elementwise.activation import silu_and_mul
from corectl.backends.triton.gemm.invariant import invariant_config, invariant_linear
from corectl.backends.triton.layer_kernels import batch_invariant_layer_kernels

SCALE = 0.3


@pytest.fixture(autouse=True)
def row_invariant_interpreter_dot(monkeypatch):
    """The interpreter's `tl.dot` is one `np.matmul` per tile, and on some CPUs OpenBLAS gives a row
    other bits at another position in the tile (an AMD EPYC's AVX-512 sgemm does; an Intel Xeon's
    does not). A GPU's MMA computes every row of a tile alike, which is what these tests rely on:
    here each row of a tile is multiplied on its own, the same way wherever it sits."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    original = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [np.matmul(row[None, :], b.data, dtype=d.data.dtype) for row in a.data]
        return TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, n, k, bias", [(1, 48, 40, False), (37, 200, 96, True), (130, 64, 72, True)])
def test_rows_alone_equal_rows_in_a_batch(m, n, k, bias, dtype, assert_close):
    weight = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    x = torch.randn(m, k, dtype=dtype)
    # programs=2: each program walks several tiles of the larger batches, as on a GPU's SMs.
    batched = invariant_linear(x, weight, b, programs=2)
    assert_close(batched, torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float()))
    for rows in (slice(0, 1), slice(m // 2, m // 2 + 3), slice(m - 1, m)):
        assert torch.equal(invariant_linear(x[rows], weight, b), batched[rows])
    # The same rows inside a bigger batch of other rows.
    bigger = torch.cat([torch.randn(5, k, dtype=dtype), x, torch.randn(131, k, dtype=dtype)])
    assert torch.equal(invariant_linear(bigger, weight, b)[5:5 + m], batched)


def test_config_never_reads_the_rows():
    assert invariant_config(4096, 4096, torch.bfloat16) == invariant_config(4096, 4096, torch.float16)
    assert invariant_config(8, 64, torch.bfloat16).block_n == 16


def test_layer_kernel_takes_every_dense_linear_gated_too():
    kernels = batch_invariant_layer_kernels()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * 24, generator=g).bfloat16()
    weight = torch.randn(40, 24, generator=g).bfloat16()
    gated = kernels.dense_linear(x, weight, None, True)
    # The fused row-wise activation, then the invariant GEMM (whose closeness to torch is tested above;
    # the interpreter's bf16 casts truncate, so the activation is not compared with torch's here).
    assert torch.equal(gated, invariant_linear(silu_and_mul(x), weight))
    assert torch.equal(kernels.dense_linear(x[:, :24], weight, None, False), invariant_linear(x[:, :24], weight))
    assert torch.equal(kernels.dense_linear(x[1:2], weight, None, True), gated[1:2])


def _attend(batch, rows: slice, seq: int, query_len: int, **masking):
    """Sequence `seq`'s attention as a batch of its own whose last `query_len` tokens are new."""
    seq_len = int(batch.seq_lens[seq])
    start = int(batch.query_start_loc[seq]) + int(batch.query_lens[seq]) - query_len
    q = batch.q[start:start + query_len]
    return paged_prefill_attention(
        q, batch.kv_cache, batch.block_tables[seq:seq + 1], batch.seq_lens[seq:seq + 1],
        torch.tensor([0, query_len], dtype=torch.int32), SCALE, max_query_len=query_len, fixed_tiles=True,
        **masking)[rows]


@pytest.mark.parametrize("masking", [{}, {"sliding_window": 40}])
def test_attention_row_is_the_same_alone_batched_and_after_a_prefix(masking, assert_close):
    seq_lens = [150, 75, 9]
    batch = random_paged_batch(seq_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                               dtype=torch.bfloat16, store_new_tokens=True)
    cold = paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   batch.query_start_loc, SCALE, max_query_len=max(seq_lens), fixed_tiles=True,
                                   **masking)
    assert_close(cold, contiguous_attention_ref(batch, SCALE, **masking))
    first = cold[:150]
    # The last token as a decode row; the last 37 after a 113-token cached prefix (a query tile
    # boundary elsewhere than the cold prefill's); the whole prompt alone.
    assert torch.equal(_attend(batch, slice(None), 0, 1, **masking), first[-1:])
    assert torch.equal(_attend(batch, slice(None), 0, 37, **masking), first[-37:])
    assert torch.equal(_attend(batch, slice(None), 0, 150, **masking), first)


def test_invariant_backend_runs_a_decode_step_through_the_prefill_kernel(assert_close):
    """A pure-decode step (what a decode graph captures), its padding row included, in the mode."""
    seq_lens = [20, 7, 33]
    batch = random_paged_batch(seq_lens, [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                               dtype=torch.bfloat16)
    backend = TritonAttentionBackend(4, 2, 16, torch.bfloat16, torch.device("cpu"), 8)
    backend.batch_invariant = True
    # A graph's padding row: nothing stored (slot -1), no context (seq_len 0).
    lens = torch.tensor([*seq_lens, 0], dtype=torch.int32)
    step = AttentionBatch(
        query_start_loc=torch.arange(5, dtype=torch.int32), seq_lens=lens,
        block_tables=torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:1])]),
        slot_mapping=torch.cat([batch.slot_mapping, torch.tensor([-1])]), query_lens_host=[1] * 4,
        seq_lens_host=lens.tolist(), max_query_len=1, max_seq_len=max(seq_lens), block_size=8)
    meta = backend.build_metadata(step, check_indices=False)
    assert not meta.is_pure_decode and meta.fixed_tiles
    pad = torch.zeros(1, batch.q.shape[1], dtype=batch.q.dtype)
    out = backend.forward(torch.cat([batch.q, pad]), torch.cat([batch.k, pad[:, :32]]),
                          torch.cat([batch.v, pad[:, :32]]), batch.kv_cache, meta, SCALE)
    assert_close(out[:3], contiguous_attention_ref(batch, SCALE))
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert torch.equal(out[1:2], _attend(batch, slice(None), 1, 1))
