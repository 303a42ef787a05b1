"""TritonAttentionBackend end to end: several engine-like steps against causal attention in torch.

Three sequences share one paged cache in shuffled blocks: a chunked prefill, a short prompt, and a
prompt with a prefix-cache hit; then mixed steps and pure decode steps (split-KV included). The
reference attends over contiguous ground-truth K/V, never through the pages.
"""
import pytest
import torch
from corectl.attention import AttentionBatch
from corectl.backends.triton.attention.backend import TritonAttentionBackend
from corectl.backends.triton.reference import causal_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 16, 4
SCALE = HEAD_DIM ** -0.5
TOTAL_LENS = [26, 12, 17]
CACHED_PREFIX = [0, 0, 8]
# Tokens each sequence computes per step; the last two steps are pure decode.
STEPS = [[12, 9, 6], [11, 1, 1], [1, 1, 1], [1, 1, 1]]


class PagedSequences:
    """Ground-truth K/V per sequence plus a paged cache laid out in shuffled blocks."""

    def __init__(self, dtype: torch.dtype):
        blocks_per_seq = [-(-n // BLOCK_SIZE) for n in TOTAL_LENS]
        num_blocks = sum(blocks_per_seq) + 2
        order = torch.randperm(num_blocks).tolist()
        self.tables = [[order.pop() for _ in range(n)] for n in blocks_per_seq]
        self.keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM).to(dtype) for n in TOTAL_LENS]
        self.values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM).to(dtype) for n in TOTAL_LENS]
        self.kv_cache = torch.full(TritonAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS,
                                                                          HEAD_DIM), float("nan"), dtype=dtype)
        self.computed = list(CACHED_PREFIX)
        for i, prefix in enumerate(CACHED_PREFIX):
            slots = self.slots(i, 0, prefix)
            flat = self.kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
            flat[0, slots], flat[1, slots] = self.keys[i][:prefix], self.values[i][:prefix]

    def slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(self.tables[seq])
        return table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def batch(self, counts: list[int]) -> AttentionBatch:
        """The AttentionBatch a model runner would build for this step."""
        seq_lens = [c + n for c, n in zip(self.computed, counts)]
        width = max(len(t) for t in self.tables) + 1
        tables = torch.zeros(len(counts), width, dtype=torch.int32)
        for i, table in enumerate(self.tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        starts = torch.zeros(len(counts) + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(torch.tensor(counts), 0)
        slots = torch.cat([self.slots(i, c, s) for i, (c, s) in enumerate(zip(self.computed, seq_lens))])
        return AttentionBatch(query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                              block_tables=tables, slot_mapping=slots, query_lens_host=list(counts),
                              seq_lens_host=seq_lens, max_query_len=max(counts), max_seq_len=max(seq_lens),
                              block_size=BLOCK_SIZE)

    def new_kv(self, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ks = [self.keys[i][c:c + n] for i, (c, n) in enumerate(zip(self.computed, counts))]
        vs = [self.values[i][c:c + n] for i, (c, n) in enumerate(zip(self.computed, counts))]
        return torch.cat(ks).flatten(1), torch.cat(vs).flatten(1)

    def reference(self, q: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs, row = [], 0
        for i, (c, n) in enumerate(zip(self.computed, counts)):
            q_i = q[row:row + n].view(n, NUM_HEADS, HEAD_DIM)
            outs.append(causal_attention_ref(q_i, self.keys[i][:c + n], self.values[i][:c + n], SCALE).flatten(1))
            row += n
        return torch.cat(outs)


def _backend(dtype):
    return TritonAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), BLOCK_SIZE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_match_causal_attention(dtype, assert_close):
    backend = _backend(dtype)
    seqs = PagedSequences(dtype)
    for step, counts in enumerate(STEPS):
        meta = backend.build_metadata(seqs.batch(counts))
        assert meta.is_pure_decode == (max(counts) == 1)
        if step == len(STEPS) - 1:
            meta.num_splits = 3
        q = torch.randn(sum(counts), NUM_HEADS * HEAD_DIM).to(dtype)
        k, v = seqs.new_kv(counts)
        out = backend.forward(q, k, v, seqs.kv_cache, meta, SCALE)
        assert_close(out, seqs.reference(q, counts))
        seqs.computed = [c + n for c, n in zip(seqs.computed, counts)]


def test_forward_validates_indices_once_per_step():
    backend = _backend(torch.float32)
    seqs = PagedSequences(torch.float32)
    batch = seqs.batch(STEPS[0])
    batch.slot_mapping[3] = seqs.kv_cache.shape[1] * BLOCK_SIZE
    q = torch.randn(sum(STEPS[0]), NUM_HEADS * HEAD_DIM)
    k, v = seqs.new_kv(STEPS[0])
    meta = backend.build_metadata(batch)
    with pytest.raises(ValueError, match="slot_mapping values must lie in"):
        backend.forward(q, k, v, seqs.kv_cache, meta, SCALE)
    assert meta.check_indices
    batch.slot_mapping[3] = 0
    backend.forward(q, k, v, seqs.kv_cache, meta, SCALE)
    assert not meta.check_indices


def test_forward_rejects_wrong_query_rows():
    backend = _backend(torch.float32)
    seqs = PagedSequences(torch.float32)
    meta = backend.build_metadata(seqs.batch(STEPS[0]))
    k, v = seqs.new_kv(STEPS[0])
    with pytest.raises(ValueError, match=r"q must be \[num_tokens, num_heads \* head_dim\] = \[27, 96\]"):
        backend.forward(torch.randn(26, NUM_HEADS * HEAD_DIM), k, v, seqs.kv_cache, meta, SCALE)
