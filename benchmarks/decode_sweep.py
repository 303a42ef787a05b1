"""Sweep the paged decode kernel's launch (keys per tile, warps, stages) over the decode regimes of
the workloads, on the GPU: W1's batch of 256 at 512-640 keys, W6's 64 x 4096, batch-1 decode at
640 keys split as a graph for an 8192-token model splits it, and qwen3-0.6b's batch of 256.

    python benchmarks/decode_sweep.py     (on the device: bash benchmarks/device_bench.sh sweep:decode)

Each case checks every config's output against the default launch's (relative error), then times
it (`triton.testing.do_bench` median); the best configs per case and cache dtype come last.
"""
import itertools
import random

import torch
from corectl.backends.triton.attention.decode_attention import DecodeConfig, choose_decode_splits, paged_decode_attention
from corectl.backends.triton.bench.paged_batch import random_paged_batch
from triton.testing import do_bench

# name: (sequence lengths, q heads, kv heads, the max_seq_len the splits are chosen for)
rng = random.Random(0)
CASES = {
    "W1 256 x 512-640": ([rng.randint(513, 640) for _ in range(256)], 32, 8, 8192),
    "W6 64 x 4096": ([4096] * 64, 32, 8, 4096),
    "batch 1 x 640, graph splits": ([640], 32, 8, 8192),
    "qwen3-0.6b 256 x 100-1100": ([rng.randint(100, 1100) for _ in range(256)], 16, 8, 8192),
}
CONFIGS = [DecodeConfig(n, w, s) for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3))]


def main() -> None:
    results = []
    for (name, (lens, heads, kv_heads, max_len)), dtype in itertools.product(CASES.items(), ("bf16", "fp8")):
        batch = random_paged_batch(lens, [1] * len(lens), heads, kv_heads, 128, 16, torch.bfloat16, "cuda",
                                   store_new_tokens=True, spare_blocks=0)
        cache = batch.kv_cache if dtype == "bf16" else batch.kv_cache.to(torch.float8_e4m3fn)
        splits = choose_decode_splits(len(lens), kv_heads, max_len, batch.q.device)

        def run(cfg):
            return paged_decode_attention(batch.q, cache, batch.block_tables, batch.seq_lens, 128 ** -0.5,
                                          max_seq_len=max_len, num_splits=splits, check_indices=False, config=cfg)

        ref = run(DecodeConfig()).float()
        for cfg in CONFIGS:
            try:
                err = ((run(cfg).float() - ref).norm() / ref.norm()).item()
                ms = do_bench(lambda: run(cfg), warmup=25, rep=100, return_mode="median")
            except Exception as exc:  # a config that does not compile (shared memory) is skipped
                print(f"{name} {dtype} {tuple(cfg)}: {type(exc).__name__}")
                continue
            results.append((name, dtype, cfg, ms, err))
            print(f"{name:28s} {dtype} splits {splits:2d} {tuple(cfg)}: {ms * 1e3:8.1f} us err {err:.1e}", flush=True)
        del batch, cache
        torch.cuda.empty_cache()
    print("\ncase, cache: default us -> best us (config); the next two")
    for name, dtype in itertools.product(CASES, ("bf16", "fp8")):
        rows = sorted((r for r in results if r[:2] == (name, dtype)), key=lambda r: r[3])
        default = next(r for r in rows if r[2] == DecodeConfig())
        print(f"{name:28s} {dtype}: {default[3] * 1e3:7.1f} -> {rows[0][3] * 1e3:7.1f} {tuple(rows[0][2])}; "
              + "; ".join(f"{r[3] * 1e3:.1f} {tuple(r[2])}" for r in rows[1:3]))


if __name__ == "__main__":
    main()
