"""The CPU backend's sliding windows and soft-capped scores against the torch reference, on its three
paths: a lone fresh prefill, a pure-decode batch (grouped query heads) and a padded mixed batch."""
from __future__ import annotations

import pytest
import torch
from corectl.attention import AttentionBatch
from corectl.backends.cpu.attention import TorchSDPABackend
from corectl.backends.triton.bench.paged_batch import contiguous_attention_ref, random_paged_batch

H, HK, D, BLOCK = 6, 2, 8, 4
SCALE = 0.35
CASES = {
    "fresh_prefill": ([23], [23]),
    "decode": ([5, 17, 30], [1, 1, 1]),
    "mixed": ([30, 9, 14], [6, 9, 1]),
}


def _run(seq_lens, query_lens, window, soft_cap):
    batch = random_paged_batch(seq_lens, query_lens, num_heads=H, num_kv_heads=HK, head_dim=D, block_size=BLOCK,
                               dtype=torch.float32)
    # This backend reads every padded position of its gather (and masks it): unwritten slots hold zeros here.
    batch.kv_cache.nan_to_num_(0.0)
    backend = TorchSDPABackend(H, HK, D, torch.float32, torch.device("cpu"), BLOCK)
    meta = backend.build_metadata(AttentionBatch(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping, query_lens_host=list(query_lens), seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=BLOCK,
    ))
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, SCALE, sliding_window=window,
                          logits_soft_cap=soft_cap)
    return out, contiguous_attention_ref(batch, SCALE, sliding_window=window, logits_soft_cap=soft_cap)


@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 100])
@pytest.mark.parametrize("case", sorted(CASES))
def test_windows_and_soft_cap_match_reference(case, window, soft_cap):
    out, expected = _run(*CASES[case], window, soft_cap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_window_and_cap_change_the_result():
    """Same inputs (same seed) with and without: the comparisons above would not notice a no-op."""
    def run(window, soft_cap):
        torch.manual_seed(0)
        return _run(*CASES["mixed"], window, soft_cap)[0]

    plain = run(None, None)
    assert not torch.allclose(run(5, None), plain, atol=1e-3)
    assert not torch.allclose(run(None, 0.5), plain, atol=1e-3)
