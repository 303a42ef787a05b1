"""Decode attention over ragged and even batches: the row groups started longest first
(`AttentionBatch.decode_order`) against batch order, and the split count, each launch timed against
a device copy of the bytes it reads. Batches of 8-256 sequences at W1's, W4's and W6's contexts.

    python benchmarks/decode_order_sweep.py      (on the device: device_bench.sh sweep:order)
"""
import random

import numpy as np
import torch
from corectl.attention import longest_first
from corectl.backends.triton.attention.decode_attention import choose_decode_splits, paged_decode_attention
from corectl.backends.triton.bench.paged_batch import random_paged_batch
from triton.testing import do_bench

rng = random.Random(0)


def w4_lens(n):
    """A step in the middle of W4: prompt U[100, 1024] plus part of an output U[100, 1024]."""
    return [rng.randint(100, 1024) + rng.randint(0, rng.randint(100, 1024)) for _ in range(n)]


# name: (sequence lengths, q heads, kv heads)
CASES = {
    "W4 256 ragged": (w4_lens(256), 16, 8),
    "W4 128 ragged": (w4_lens(128), 16, 8),
    "W4 32 ragged": (w4_lens(32), 16, 8),
    "W1 256 x 512-640": ([rng.randint(513, 640) for _ in range(256)], 32, 8),
    "W6 64 x 4096": ([4096] * 64, 32, 8),
    "64 ragged 100-4096": ([rng.randint(100, 4096) for _ in range(64)], 32, 8),
    "32 x 600": ([600] * 32, 32, 8),
    "32 ragged 100-4096": ([rng.randint(100, 4096) for _ in range(32)], 32, 8),
    "16 x 2000": ([2000] * 16, 32, 8),
    "8 x 600": ([600] * 8, 32, 8),
    "8 ragged 100-8000": ([rng.randint(100, 8000) for _ in range(8)], 32, 8),
}
GRAPH_MAX_LEN = 8192  # graphs choose splits for the model's max length


def main() -> None:
    table = []
    for name, (lens, heads, kv_heads) in CASES.items():
        batch = random_paged_batch(lens, [1] * len(lens), heads, kv_heads, 128, 16, torch.bfloat16, "cuda",
                                   store_new_tokens=True, spare_blocks=0)
        nbytes = sum(lens) * kv_heads * 128 * 2 * 2
        src = torch.empty(max(nbytes // 2, 1 << 20), dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        read_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") / 2
        order = torch.from_numpy(longest_first(np.array(lens, dtype=np.int32))).cuda()
        rule = choose_decode_splits(len(lens), kv_heads, GRAPH_MAX_LEN, batch.q.device)
        ref, times = None, {}
        for ordered in (False, True):
            for splits in (1, 2, 4, 8, 16):
                def run():
                    return paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                                  128 ** -0.5, max_seq_len=GRAPH_MAX_LEN, num_splits=splits,
                                                  check_indices=False, order=order if ordered else None)
                out = run().float()
                ref = out if ref is None else ref
                err = ((out - ref).norm() / ref.norm()).item()
                times[ordered, splits] = ms = do_bench(run, warmup=25, rep=200, return_mode="median")
                print(f"{name:20s} {'longest first' if ordered else 'batch order  '} splits {splits:2d}: "
                      f"{ms * 1e3:7.1f} us, {read_ms / ms * 100:5.1f}% of a copy's read, err {err:.1e}", flush=True)
        best = min(times, key=times.get)
        table.append((name, nbytes, rule, times[False, rule], times[True, rule], best, times[best]))
        del batch, src, dst
        torch.cuda.empty_cache()
    print("\n| case | KV MB | rule's splits | batch order | longest first | best (order, splits) |")
    print("|---|---|---|---|---|---|")
    for name, nbytes, rule, plain, ordered, best, best_ms in table:
        print(f"| {name} | {nbytes / 1e6:.0f} | {rule} | {plain * 1e3:.1f} us | {ordered * 1e3:.1f} us | "
              f"{best_ms * 1e3:.1f} us ({'longest' if best[0] else 'batch'}, {best[1]}) |")


if __name__ == "__main__":
    main()
