"""The MLA decode case of `corectl bench kernels`: paged latent attention (absorbed DeepSeek MLA) at
batch 64 x context 4096, DeepSeek-V2-Lite's shape (16 heads, latent 512, rope 64), bf16.

Bandwidth counts the bytes that must move: every context's latent rows read once (576 numbers a
token, shared by all heads), the latent queries read and the latent outputs written; it is
compared with a device-to-device copy measured in the same call. The sweep times the split counts
and tile configurations around the default, so a better launch shows itself. Prefill (4 prompts of
2048 tokens, causal) is timed in TFLOP/s of the absorbed form's products, for the rows per program.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LatentShapes:
    num_seqs: int
    context: int
    num_heads: int
    rank: int
    rope: int
    block_size: int


V2_LITE = LatentShapes(num_seqs=64, context=4096, num_heads=16, rank=512, rope=64, block_size=16)
SMALL = LatentShapes(num_seqs=3, context=37, num_heads=5, rank=32, rope=16, block_size=4)
PREFILL_PROMPTS = (4, 2048)
# (heads per program, keys per tile, warps, stages) tried beside the default launch.
SWEEP = ((16, 32, 4, 2), (16, 64, 8, 2), (16, 32, 8, 3), (16, 64, 8, 3), (16, 16, 8, 3), (16, 32, 8, 4),
         (16, 16, 8, 4), (16, 32, 16, 2))


def _latent_batch(s: LatentShapes, seq_lens: list[int], dtype: torch.dtype, device: str):
    """(batch, its one-part cache view, q [B, H, rank + rope]) of random contexts in shuffled blocks."""
    from .paged_batch import random_paged_batch

    batch = random_paged_batch(seq_lens, [1] * len(seq_lens), s.num_heads, 1, s.rank + s.rope, s.block_size, dtype,
                               device, store_new_tokens=True, spare_blocks=0)
    return batch, batch.kv_cache[:1], batch.q.view(len(seq_lens), s.num_heads, s.rank + s.rope)


def check_latent(s: LatentShapes, device: str, dtype: torch.dtype) -> list[tuple[str, float]]:
    """Relative error of the decode kernel, unsplit and split, against the causal torch reference."""
    from ..attention.latent_attention import paged_latent_attention
    from ..reference import causal_attention_ref
    from .measure import rel_error

    scale = (s.rank + s.rope) ** -0.5
    seq_lens = [s.context - 7 * i for i in range(s.num_seqs)]
    batch, cache, q = _latent_batch(s, seq_lens, dtype, device)
    expected = torch.cat([causal_attention_ref(q[i:i + 1], keys, keys[..., :s.rank], scale)
                          for i, keys in enumerate(batch.keys)])
    results = []
    for splits in (1, 4):
        out = paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, scale, rank=s.rank,
                                     max_seq_len=max(seq_lens), num_splits=splits)
        results.append((f"MLA decode, {splits} split(s)", rel_error(out, expected)))
    return results


def bench_latent(s: LatentShapes, dtype: torch.dtype) -> list[tuple[str, float, float]]:
    """(name, median ms, TB/s): the copy ceiling over the latent bytes, then the decode launches."""
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench

    from ..attention.decode_attention import choose_decode_splits
    from ..attention.latent_attention import LatentConfig, paged_latent_attention
    from .measure import bench_copy

    batch, cache, q = _latent_batch(s, [s.context] * s.num_seqs, dtype, "cuda")
    elem = q.element_size()
    latent_bytes = s.num_seqs * s.context * (s.rank + s.rope) * elem
    moved = latent_bytes + q.numel() * elem + s.num_seqs * s.num_heads * s.rank * elem
    scale = (s.rank + s.rope) ** -0.5
    auto = choose_decode_splits(s.num_seqs, 1, s.context, q.device)
    rows = [bench_copy(do_bench, latent_bytes)]
    launches = [(splits, LatentConfig()) for splits in sorted({1, 2, 4, 8, auto})]
    launches += [(auto, LatentConfig(*cfg)) for cfg in SWEEP if LatentConfig(*cfg) != LatentConfig()]
    # Two passes, the second in reverse order: on the H100 a launch measured later in the list ran
    # up to 10 points of copy bandwidth faster than the same launch measured early.
    for number, order in ((1, launches), (2, launches[::-1])):
        for splits, cfg in order:
            def decode(splits=splits, cfg=cfg):
                paged_latent_attention(q, cache, batch.block_tables, batch.seq_lens, None, scale, rank=s.rank,
                                       max_seq_len=s.context, num_splits=splits, check_indices=False, config=cfg)

            label = (f"pass {number}: MLA decode, {splits} split(s){' [auto]' if splits == auto else ''}, "
                     f"h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}")
            try:
                ms = do_bench(decode, warmup=50, rep=300, return_mode="median")
            except OutOfResources as error:  # a tile that does not fit the SM's shared memory or registers
                print(f"  {label}: {error}")
                continue
            rows.append((label, ms, moved / ms / 1e9))
    rows.append(bench_copy(do_bench, latent_bytes))
    return rows


def bench_latent_prefill(s: LatentShapes, dtype: torch.dtype) -> list[tuple[str, float, float]]:
    """(name, median ms, TFLOP/s) of causal prefills of PREFILL_PROMPTS over an empty prefix."""
    from triton.testing import do_bench

    from ..attention.latent_attention import PREFILL, paged_latent_attention
    from .paged_batch import random_paged_batch

    count, length = PREFILL_PROMPTS
    width = s.rank + s.rope
    batch = random_paged_batch([length] * count, [length] * count, s.num_heads, 1, width, s.block_size, dtype,
                               "cuda", store_new_tokens=True, spare_blocks=0)
    q = batch.q.view(-1, s.num_heads, width)
    # Each query of position p meets p + 1 keys: a score (width) and an output (rank) product per head.
    flops = 2 * count * length * (length + 1) // 2 * s.num_heads * (width + s.rank)
    rows = []
    for cfg in (PREFILL, PREFILL._replace(rows=32), PREFILL._replace(rows=16, num_warps=4)):
        def prefill(cfg=cfg):
            paged_latent_attention(q, batch.kv_cache[:1], batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                   width ** -0.5, rank=s.rank, max_seq_len=length, check_indices=False, config=cfg)

        ms = do_bench(prefill, warmup=10, rep=100, return_mode="median")
        rows.append((f"MLA prefill {count} x {length}, rows {cfg.rows} w{cfg.num_warps}", ms, flops / ms / 1e9))
    return rows
