"""A split decode in one launch (its last split program per row group and KV head combines) gives
the same bits as the decode kernel followed by the combine kernel (CORECTL_DECODE_ONE_LAUNCH=0),
and leaves its tickets zeroed, so a second launch over the same buffer (a graph replay) does too.

Cases cover GQA groups, row groups with padding rows, contexts shorter than their splits (empty
splits), a whole padding row, sinks with a soft cap, and a sliding window.
"""
import pytest
import torch
from corectl.backends.triton.attention.decode_attention import paged_decode_attention
from corectl.backends.triton.bench.paged_batch import random_paged_batch

SCALE = 0.3


def _row_groups(batch, rows: int):
    """Random queries, each sequence's table under `rows` consecutive rows ending at its last position;
    a padding row (seq_len 0) where a sequence is shorter than the group."""
    seq_lens = torch.tensor([max(length - r, 0) if r < length else 0
                             for length in batch.seq_lens_list for r in reversed(range(rows))], dtype=torch.int32)
    q = torch.randn(seq_lens.shape[0], batch.q.shape[1], dtype=batch.q.dtype)
    return q, batch.block_tables.repeat_interleave(rows, 0), seq_lens


CASES = {
    # splits, heads, kv heads, context lengths, rows per group, keyword arguments
    "gqa3-empty-splits": (3, 6, 2, [141, 3, 0], 1, {}),
    "mha-many-splits": (7, 2, 2, [40, 300], 1, {}),
    "row-groups": (2, 4, 1, [150, 1, 70], 2, {}),
    "sinks-softcap": (4, 4, 2, [90, 5], 1, {"logits_soft_cap": 5.0, "sinks": True}),
    "window": (3, 2, 1, [200, 20], 1, {"sliding_window": 66}),
}


@pytest.mark.parametrize("case", CASES)
def test_one_launch_equals_two_launches_bit_for_bit(case, monkeypatch):
    splits, heads, kv_heads, lens, rows, extra = CASES[case]
    batch = random_paged_batch(lens, [min(1, n) for n in lens], num_heads=heads, num_kv_heads=kv_heads, head_dim=16,
                               block_size=8, dtype=torch.bfloat16, store_new_tokens=True)
    q, tables, seq_lens = _row_groups(batch, rows)
    if extra.pop("sinks", False):
        extra["sinks"] = torch.randn(heads)

    def decode(tickets=None):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        return paged_decode_attention(q, batch.kv_cache, tables, seq_lens, SCALE, max_seq_len=max(lens),
                                      num_splits=splits, out=out, rows_per_seq=rows, tickets=tickets, **extra)

    monkeypatch.setenv("CORECTL_DECODE_ONE_LAUNCH", "0")
    two_launches = decode()
    assert not two_launches.isnan().any()
    monkeypatch.setenv("CORECTL_DECODE_ONE_LAUNCH", "1")
    tickets = torch.zeros(16, dtype=torch.int32)
    for _ in range(2):
        assert torch.equal(decode(tickets), two_launches)
        assert not tickets.any(), "the last split must hand its ticket back"
    # Too few tickets for the grid: the launch counts on zeros of its own.
    assert torch.equal(decode(tickets[:1]), two_launches)
