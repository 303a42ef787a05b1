"""Check the Triton kernels at real sizes against torch, then time W6 (DESIGN.md section 5).

    python -m corectl.backends.triton.bench.kernels            # on a GPU: checks, timings, table
    python -m corectl.backends.triton.bench.kernels --small    # tiny shapes, CPU interpreter, checks only

W6: paged decode attention alone, batch 64 x context 4096, 32 q / 8 kv heads, head_dim 128, bf16.
Bandwidth counts the bytes that must move (K/V of every context read once, q read, out written)
and is compared with a measured device-to-device copy (bytes read + written) and with torch SDPA
over the same K/V stored contiguously. Also timed: the same decode over an FP8 (e4m3) cache, and
a layer with a 4096-token sliding window at 16k context (Mistral-7B), which should cost what the
4096-token context does. MLA decode (absorbed DeepSeek MLA over the latent cache, `bench/mla.py`)
is checked and timed the same way at DeepSeek-V2-Lite's shape, against a copy of the latent bytes.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from .measure import bench_copy, rel_error


@dataclass(frozen=True)
class Shapes:
    num_seqs: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hidden: int
    intermediate: int


W6 = Shapes(num_seqs=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
            hidden=4096, intermediate=14336)
# SmolLM2-135M's attention: a query group of 3 (not a power of two) and head_dim 64.
SMOLLM2 = Shapes(num_seqs=8, context=1000, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                 hidden=576, intermediate=1536)
SMALL = Shapes(num_seqs=3, context=37, num_heads=6, num_kv_heads=2, head_dim=32, block_size=4,
               hidden=96, intermediate=80)
DTYPE = torch.bfloat16


def check_correctness(shapes: Shapes, device: str) -> list[tuple[str, float]]:
    """Relative error of each kernel against its torch reference on fresh random inputs."""
    from .. import reference as ref
    from ..attention.decode_attention import paged_decode_attention
    from ..attention.kv_cache_store import store_kvcache
    from ..attention.prefill_attention import paged_prefill_attention
    from ..elementwise.activation import silu_and_mul
    from ..elementwise.rms_norm import rms_norm
    from ..elementwise.rotary import qk_norm_rotary, rotary_embedding
    from .paged_batch import contiguous_attention_ref, random_paged_batch

    s, scale, results = shapes, shapes.head_dim ** -0.5, []
    seq_lens = [s.context - 7 * i for i in range(s.num_seqs)]
    batch = random_paged_batch(seq_lens, [1] * s.num_seqs, s.num_heads, s.num_kv_heads, s.head_dim,
                               s.block_size, DTYPE, device)
    expected_cache = ref.store_kvcache_ref(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    store_kvcache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    results.append(("store_kvcache", float(not torch.equal(batch.kv_cache.nan_to_num(), expected_cache.nan_to_num()))))
    expected = contiguous_attention_ref(batch, scale)
    for splits in (1, 4):
        out = paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, scale,
                                     max_seq_len=max(seq_lens), num_splits=splits)
        results.append((f"decode, {splits} split(s)", rel_error(out, expected)))
    chunk = [(max(1, n // 3), n) for n in seq_lens[:4]]
    batch = random_paged_batch([n for _, n in chunk], [q for q, _ in chunk], s.num_heads, s.num_kv_heads,
                               s.head_dim, s.block_size, DTYPE, device, store_new_tokens=True)
    out = paged_prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, scale, max_query_len=max(batch.query_lens))
    results.append(("prefill with cached prefix", rel_error(out, contiguous_attention_ref(batch, scale))))
    results += _check_elementwise(shapes, device, ref, rms_norm, silu_and_mul, rotary_embedding, qk_norm_rotary)
    return results


def _check_elementwise(s: Shapes, device, ref, rms_norm, silu_and_mul, rotary_embedding,
                       qk_norm_rotary) -> list[tuple[str, float]]:
    tokens = 2 * s.num_seqs

    def randn(*shape):
        return torch.randn(*shape, device=device).to(DTYPE)

    x, residual, weight = randn(tokens, s.hidden), randn(tokens, s.hidden), randn(s.hidden)
    out, new_res = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = ref.rms_norm_ref(x, weight, 1e-5, residual)
    gate_up = randn(tokens, 2 * s.intermediate)
    q, k = randn(tokens, s.num_heads, s.head_dim), randn(tokens, s.num_kv_heads, s.head_dim)
    cos, sin = randn(s.context, s.head_dim), randn(s.context, s.head_dim)
    positions = torch.randint(0, s.context, (tokens,), device=device)
    ref_q, ref_k = ref.rotary_embedding_ref(positions, q, k, cos, sin)
    q_weight, k_weight = randn(s.head_dim), randn(s.head_dim)
    normed_q, normed_k = q.clone(), k.clone()
    ref_normed_q, ref_normed_k = ref.rotary_embedding_ref(
        positions, ref.rms_norm_ref(q, q_weight, 1e-6), ref.rms_norm_ref(k, k_weight, 1e-6), cos, sin)
    rotary_embedding(positions, q, k, cos, sin)
    qk_norm_rotary(positions, normed_q, normed_k, q_weight, k_weight, 1e-6, cos, sin)
    return [
        ("rms_norm + residual", max(rel_error(out, ref_out), rel_error(new_res, ref_res))),
        ("silu_and_mul", rel_error(silu_and_mul(gate_up), ref.silu_and_mul_ref(gate_up))),
        ("rotary_embedding", max(rel_error(q, ref_q), rel_error(k, ref_k))),
        ("qk_norm_rotary", max(rel_error(normed_q, ref_normed_q), rel_error(normed_k, ref_normed_k))),
    ]


def bench_w6(shapes: Shapes) -> list[tuple[str, float, float]]:
    """(name, median ms, TB/s) for the copy ceiling, our decode at several split counts, and SDPA."""
    from triton.testing import do_bench

    from ..attention.decode_attention import choose_decode_splits
    from .paged_batch import random_paged_batch

    s, scale = shapes, shapes.head_dim ** -0.5
    batch = random_paged_batch([s.context] * s.num_seqs, [1] * s.num_seqs, s.num_heads, s.num_kv_heads,
                               s.head_dim, s.block_size, DTYPE, "cuda", store_new_tokens=True, spare_blocks=0)
    elem = batch.q.element_size()
    kv_bytes = 2 * s.num_seqs * s.context * s.num_kv_heads * s.head_dim * elem
    moved = kv_bytes + 2 * batch.q.numel() * elem
    rows = [bench_copy(do_bench, kv_bytes)]
    auto = choose_decode_splits(s.num_seqs, s.num_kv_heads, s.context, batch.q.device)
    for splits in sorted({1, 2, 4, auto}):
        ms = _time_decode(do_bench, batch, batch.kv_cache, scale, s.context, splits)
        label = f"triton decode, {splits} split(s)" + (" [auto]" if splits == auto else "")
        rows.append((label, ms, moved / ms / 1e9))
    fp8_moved = kv_bytes // elem + 2 * batch.q.numel() * elem
    ms = _time_decode(do_bench, batch, batch.kv_cache.to(torch.float8_e4m3fn), scale, s.context, auto)
    rows.append((f"triton decode, FP8 KV cache, {auto} split(s)", ms, fp8_moved / ms / 1e9))
    rows.append(_bench_sdpa(do_bench, batch, s, scale, moved))
    del batch
    rows.append(_bench_window(do_bench, s, scale, moved))
    return rows


def _time_decode(do_bench, batch, kv_cache, scale: float, max_len: int, splits: int, **masking) -> float:
    from ..attention.decode_attention import paged_decode_attention

    def decode():
        paged_decode_attention(batch.q, kv_cache, batch.block_tables, batch.seq_lens, scale, max_seq_len=max_len,
                               num_splits=splits, check_indices=False, **masking)

    return do_bench(decode, warmup=50, rep=300, return_mode="median")


def _bench_window(do_bench, s: Shapes, scale: float, moved: int) -> tuple[str, float, float]:
    """A sliding window of `s.context` keys at 4x that context: the bytes that must move are those of
    the window, so it should match the unwindowed row at `s.context`."""
    from ..attention.decode_attention import choose_decode_splits
    from .paged_batch import random_paged_batch

    context = 4 * s.context
    batch = random_paged_batch([context] * s.num_seqs, [1] * s.num_seqs, s.num_heads, s.num_kv_heads,
                               s.head_dim, s.block_size, DTYPE, "cuda", store_new_tokens=True, spare_blocks=0)
    splits = choose_decode_splits(s.num_seqs, s.num_kv_heads, context, batch.q.device)
    ms = _time_decode(do_bench, batch, batch.kv_cache, scale, context, splits, sliding_window=s.context)
    return f"triton decode, window {s.context} at {context}", ms, moved / ms / 1e9


def _bench_sdpa(do_bench, batch, s: Shapes, scale: float, moved: int) -> tuple[str, float, float]:
    """SDPA over the same K/V made contiguous; each KV head's query group is a short query row block
    attending to everything, which is GQA decode without repeating K/V."""
    keys = torch.stack(batch.keys).transpose(1, 2).contiguous()       # [B, Hk, ctx, D]
    values = torch.stack(batch.values).transpose(1, 2).contiguous()
    group = s.num_heads // s.num_kv_heads
    q = batch.q.view(s.num_seqs, s.num_kv_heads, group, s.head_dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = do_bench(lambda: sdpa(q, keys, values, scale=scale), warmup=50, rep=300, return_mode="median")
    return "torch SDPA, contiguous K/V (peer)", ms, moved / ms / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU interpreter, checks only")
    args = parser.parse_args(argv)
    if args.small:
        # Must precede the first import of triton, which the kernel modules do: hence their late imports.
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        parser.error("no GPU visible: run on a CUDA/ROCm device, or pass --small for the CPU interpreter")
    from . import mla

    torch.manual_seed(0)
    if args.small:
        checks = [("small: " + name, err) for name, err in check_correctness(SMALL, "cpu")
                  + mla.check_latent(mla.SMALL, "cpu", DTYPE)]
    else:
        checks = [(f"{label}: {name}", err) for label, shapes in (("W6", W6), ("SmolLM2", SMOLLM2))
                  for name, err in check_correctness(shapes, "cuda")]
        checks += [(f"V2-Lite: {name}", err) for name, err in mla.check_latent(mla.V2_LITE, "cuda", DTYPE)]
    failed = [name for name, err in checks if not err < 1e-2]
    timings = [] if args.small else bench_w6(W6)
    latent_timings = [] if args.small else mla.bench_latent(mla.V2_LITE, DTYPE)
    prefill_timings = [] if args.small else mla.bench_latent_prefill(mla.V2_LITE, DTYPE)
    print("\ncorrectness vs torch (bf16; relative L2 error, store_kvcache: 0 = identical)")
    for name, err in checks:
        print(f"  {name:<44} {err:9.2e}  {'ok' if err < 1e-2 else 'FAIL'}")
    if timings:
        _print_timings(f"W6 paged decode: batch {W6.num_seqs} x context {W6.context}, "
                       f"{W6.num_heads} q / {W6.num_kv_heads} kv heads, d {W6.head_dim}, bf16", timings)
    if latent_timings:
        s = mla.V2_LITE
        _print_timings(f"MLA decode (latent cache): batch {s.num_seqs} x context {s.context}, {s.num_heads} heads, "
                       f"latent {s.rank} + rope {s.rope}, bf16", latent_timings, width=82)
    for name, ms, tflops in prefill_timings:
        print(f"  {name:<82} {ms:10.4f} {tflops:7.1f} TFLOP/s")
    if failed:
        raise SystemExit(f"correctness check failed: {', '.join(failed)}")


def _print_timings(title: str, timings: list[tuple[str, float, float]], width: int = 44) -> None:
    """A table of (name, median ms, TB/s) rows whose first row is the copy they are compared with."""
    copy_bw = timings[0][2]
    print(f"\n{title}")
    print(f"  {'kernel':<{width}} {'median ms':>10} {'TB/s':>7} {'% copy':>7}")
    for name, ms, bw in timings:
        print(f"  {name:<{width}} {ms:10.4f} {bw:7.3f} {100 * bw / copy_bw:6.1f}%")


if __name__ == "__main__":
    main()
