"""Paged latent attention (absorbed MLA) against the causal torch reference: decode unsplit and split,
and a prefill step with cached prefixes beside a decode row. Contexts sit in shuffled blocks and
every slot outside them is NaN; rows are rank + rope wide, the values their first `rank` numbers."""
import pytest
import torch
from corectl.attention import AttentionBatch
from corectl.backends.cpu.attention import TorchSDPABackend
from corectl.backends.triton.attention.backend import TritonAttentionBackend
from corectl.backends.triton.attention.latent_attention import FUSED_SPLITS, LatentConfig, paged_latent_attention
from corectl.backends.triton.bench.paged_batch import random_paged_batch
from corectl.backends.triton.reference import causal_attention_ref

RANK, ROPE, HEADS, SCALE = 32, 16, 20, 0.2


def _latent_batch(seq_lens, query_lens, dtype, rope=ROPE):
    batch = random_paged_batch(seq_lens, query_lens, num_heads=HEADS, num_kv_heads=1, head_dim=RANK + rope,
                               block_size=4, dtype=dtype, store_new_tokens=True)
    return batch, batch.kv_cache[:1], batch.q.view(-1, HEADS, RANK + rope)


def _reference(batch, q):
    outs, start = [], 0
    for keys, query_len in zip(batch.keys, batch.query_lens):
        outs.append(causal_attention_ref(q[start:start + query_len], keys, keys[..., :RANK], SCALE))
        start += query_len
    return torch.cat(outs)


@pytest.mark.parametrize("dtype, num_splits", [(torch.float32, 1), (torch.bfloat16, 3)])
def test_decode_matches_reference(dtype, num_splits, assert_close):
    seq_lens = [45, 3, 0, 18]
    batch, cache, q = _latent_batch(seq_lens, [1, 1, 0, 1], dtype)
    # A padding row (length 0, as a CUDA graph pads a batch) takes a query row of its own.
    q = torch.cat((q[:2], torch.randn(1, HEADS, RANK + ROPE).to(dtype), q[2:]))
    out = paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, SCALE, rank=RANK,
                                 max_seq_len=max(seq_lens), num_splits=num_splits)
    rows = [0, 1, 3]
    assert_close(out[rows], _reference(batch, q[rows]), roundings=2)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("block_h", [16, 4])
def test_split_decodes_combine_in_their_last_program_and_leave_the_tickets_zeroed(block_h, assert_close):
    """One tickets buffer through decodes split 5 and 2 ways (1 or 5 head blocks a token, a padding
    row, a context shorter than its splits): every launch combines and hands the tickets back zeroed;
    too few tickets for the launch are replaced by its own. Past FUSED_SPLITS a combine launch follows."""
    seq_lens = [61, 3, 0, 30]
    batch, cache, q = _latent_batch(seq_lens, [1, 1, 0, 1], torch.float32)
    q = torch.cat((q[:2], torch.randn(1, HEADS, RANK + ROPE), q[2:]))
    rows, tickets = [0, 1, 3], torch.zeros(32, dtype=torch.int32)
    for splits, buffer in ((5, tickets), (2, tickets), (3, tickets[:3]), (FUSED_SPLITS + 1, tickets)):
        out = paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, SCALE, rank=RANK,
                                     max_seq_len=max(seq_lens), num_splits=splits,
                                     config=LatentConfig(block_h=block_h), tickets=buffer)
        assert_close(out[rows], _reference(batch, q[rows]))
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert not tickets.any()


# Prefill tiles of 2 tokens x 16 heads (the default), and of 8 tokens x 4 heads (5 head blocks).
@pytest.mark.parametrize("config", [None, LatentConfig(block_h=4, rows=32)])
def test_prefill_with_cached_prefix_matches_reference(config, assert_close):
    # A rope width of 8 (the tiny parity configs') is narrower than its block: masked loads throughout.
    batch, cache, q = _latent_batch([29, 6, 40], [9, 6, 1], torch.float32, rope=8)
    out = paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE,
                                 rank=RANK, max_seq_len=40, config=config)
    assert_close(out, _reference(batch, q))


def test_refuses_a_two_part_cache():
    batch = random_paged_batch([5], [1], num_heads=2, num_kv_heads=1, head_dim=RANK + ROPE, block_size=4,
                               dtype=torch.float32)
    with pytest.raises(ValueError, match="latent kv_cache must be"):
        paged_latent_attention(batch.q.view(1, 2, -1), batch.kv_cache, batch.block_tables, batch.seq_lens, None,
                               SCALE, rank=RANK, max_seq_len=5)


def _step(tables: torch.Tensor, done: list[int], counts: list[int], block: int) -> AttentionBatch:
    """The AttentionBatch of a step computing counts[i] tokens of sequence i after its done[i] (0: absent)."""
    live = [i for i, n in enumerate(counts) if n]
    ends = [done[i] + counts[i] for i in live]
    positions = [torch.arange(done[i], end) for i, end in zip(live, ends)]
    slots = torch.cat([tables[i, pos // block].long() * block + pos % block for i, pos in zip(live, positions)])
    starts = torch.tensor([0, *torch.tensor([counts[i] for i in live]).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionBatch(query_start_loc=starts, seq_lens=torch.tensor(ends, dtype=torch.int32),
                          block_tables=tables[live], slot_mapping=slots, query_lens_host=[counts[i] for i in live],
                          seq_lens_host=ends, max_query_len=max(counts), max_seq_len=max(ends), block_size=block)


def test_both_backends_store_rows_and_attend_through_prefill_mixed_and_decode_steps(assert_close):
    """TritonAttentionBackend and TorchSDPABackend, each on its own one-part cache, through the steps a
    chunked prefill beside a short prompt takes: rows stored at the step's slots, then attended."""
    width, block = RANK + ROPE, 4
    rows = [torch.randn(n, width) for n in (14, 7)]
    tables = torch.randperm(8).to(torch.int32).view(2, 4)
    backends = [cls(HEADS, 1, width, torch.float32, torch.device("cpu"), block)
                for cls in (TritonAttentionBackend, TorchSDPABackend)]
    # Unwritten slots are NaN for the kernel, which must not read them; the CPU path reads padding
    # columns and masks them, finite as an engine's zeroed cache is.
    caches = [torch.full(TritonAttentionBackend.kv_cache_shape(8, block, 1, width, parts=1), fill)
              for fill in (float("nan"), 0.0)]
    done = [0, 0]
    for counts in ([9, 6], [4, 1], [1, 0]):
        batch = _step(tables, done, counts, block)
        live = [i for i, n in enumerate(counts) if n]
        new = torch.cat([rows[i][done[i]:done[i] + counts[i]] for i in live])
        q = torch.randn(new.shape[0], HEADS, width)
        expected, first = [], 0
        for i in live:
            context = rows[i][:done[i] + counts[i], None]
            expected.append(causal_attention_ref(q[first:first + counts[i]], context, context[..., :RANK], SCALE))
            first, done[i] = first + counts[i], done[i] + counts[i]
        for backend, cache in zip(backends, caches):
            out = backend.forward_latent(q, new, cache, backend.build_metadata(batch), SCALE, value_dim=RANK)
            assert_close(out, torch.cat(expected))


def test_a_decode_step_chooses_the_latent_splits_once_for_all_its_layers(monkeypatch):
    """Every layer of an eager decode step reads the splits its first layer chose (they depend on the
    step alone), rather than choosing again a layer."""
    from corectl.backends.triton.attention import backend as backend_module

    width, block = RANK + ROPE, 4
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    backend = TritonAttentionBackend(HEADS, 1, width, torch.float32, torch.device("cpu"), block)
    chosen = []
    choose = backend_module.choose_decode_splits
    monkeypatch.setattr(backend_module, "choose_decode_splits", lambda *a, **k: chosen.append(a) or choose(*a, **k))
    meta = backend.build_metadata(_step(tables, [5, 3], [1, 1], block))
    before = len(chosen)
    outs = []
    for _ in range(3):  # three layers, each with its own cache
        cache = torch.randn(TritonAttentionBackend.kv_cache_shape(8, block, 1, width, parts=1))
        outs.append(backend.forward_latent(torch.randn(2, HEADS, width), torch.randn(2, width), cache, meta, SCALE,
                                           value_dim=RANK))
    assert len(chosen) == before + 1 and meta.latent_splits is not None
    assert all(out.shape == (2, HEADS, RANK) and torch.isfinite(out).all() for out in outs)
