"""Sweep the 4-bit GEMM's launch configs at llama3-8b's layer shapes on a GPU and print each case's
best config beside the launch rule's (`w4a16_configs.heuristic`), for revising the rule.

    python -m corectl.backends.triton.bench.w4a16            # H100: about 2-3 minutes
    python -m corectl.backends.triton.bench.w4a16 --quick    # fewer candidates, M in (1, 16)

For each shape (group 128, contiguous groups as AWQ loads) and M in 1, 4, 16, 64, 512: every
candidate config is checked against `w4a16_reference` once, then timed with CUDA graphs of
REPEATS calls (launch overhead out, as in the engine's decode graphs); the peer is bf16
torch.matmul against the dequantized weight. GB/s counts the bytes that must move: packed words,
scales and zero codes, x and the output.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from ..gemm.w4a16 import w4a16_gemm
from ..gemm.w4a16_configs import W4Config, heuristic, sm_count

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
M_VALUES = (1, 4, 16, 64, 512)
GROUP = 128
REPEATS = 20


def candidates(m: int, n: int, k: int, quick: bool) -> list[W4Config]:
    """The heuristic's choice plus a small grid around it: tile width, K block, split, warps."""
    base = heuristic(m, n, k, sm_count(torch.device("cuda")))
    splits = sorted({1, 2, 4, 8, 16} if not quick else {base.split_k, max(1, base.split_k // 2)})
    if m == 1:
        tiles = [(256, 64, 4), (128, 64, 4), (512, 64, 8), (256, 32, 4), (256, 128, 4), (512, 32, 8),
                 (32, 512, 4), (64, 512, 4), (64, 256, 4), (128, 256, 4), (32, 1024, 8)]
        grid = [W4Config(1, bn, bk, s, w, gemv=True) for (bn, bk, w), s in itertools.product(tiles, splits)]
        grid += [W4Config(16, 128, 64, s, 4) for s in splits]  # the tl.dot form at M = 1, for comparison
    elif m <= 16:
        tiles = [(128, 64, 4), (64, 128, 4), (256, 64, 8), (128, 128, 8)]
        grid = [W4Config(16, bn, bk, s, w) for (bn, bk, w), s in itertools.product(tiles, splits)]
    else:
        tiles = [(64, 128, 64, 8, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (64, 256, 32, 8, 3)]
        grid = [W4Config(bm, bn, bk, s, w, ns) for (bm, bn, bk, w, ns), s in itertools.product(tiles, splits[:3])]
    if quick:
        grid = grid[:: max(1, len(grid) // 8)]
    return list(dict.fromkeys([base] + grid))


def graph_time_us(fn) -> float:
    """Mean microseconds per call of `fn`, replayed from a CUDA graph of REPEATS calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / REPEATS)
    return best


def layer(n: int, k: int):
    from corectl.quantization.int4 import dequantize_w4, pack_int32

    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(k // GROUP, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // GROUP, n), dtype=torch.int32, device="cuda")
    g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // GROUP
    dense = dequantize_w4(codes, zeros, scales, g_idx).to(torch.bfloat16)
    return pack_int32(codes.t(), 0), scales, zeros, g_idx, dense


def bench_shape(name: str, n: int, k: int, ms, quick: bool) -> list[tuple]:
    from corectl.quantization.int4 import w4a16_reference

    qweight, scales, zeros, g_idx, dense = layer(n, k)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = w4a16_reference(x, qweight, scales, zeros, g_idx).float()
        moved = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel() * 4 + (m * k + m * n) * 2
        peer = graph_time_us(lambda: torch.matmul(x, dense.t()))
        results = []
        for cfg in candidates(m, n, k, quick):
            run = lambda cfg=cfg: w4a16_gemm(x, qweight, scales, zeros, g_idx, GROUP, False, cfg)  # noqa: E731
            error = ((run().float() - ref).norm() / ref.norm()).item()
            if error > 1e-2:
                print(f"  {name} M={m} {cfg}: relative error {error:.2e}, skipped")
                continue
            us = graph_time_us(run)
            results.append((us, cfg))
            print(f"  {name:8s} M={m:<4d} {us:8.1f} us {moved / us / 1e3:7.0f} GB/s  {cfg}", flush=True)
        us, cfg = min(results, key=lambda r: r[0])
        rows.append((name, m, n, k, us, moved / us / 1e3, peer, cfg))
    del dense
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer candidates, M in (1, 16)")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, {sm_count(torch.device('cuda'))} SMs; group {GROUP}, bf16 x")
    ms = (1, 16) if args.quick else M_VALUES
    rows = [row for name, (n, k) in SHAPES.items() for row in bench_shape(name, n, k, ms, args.quick)]
    print(f"\n{'layer':8s} {'M':>4s} {'w4a16 us':>9s} {'GB/s':>6s} {'bf16 us':>8s}  best config")
    for name, m, n, k, us, gbs, peer, cfg in rows:
        print(f"{name:8s} {m:4d} {us:9.1f} {gbs:6.0f} {peer:8.1f}  {cfg}")
    print("\n# the rule's launches where the sweep's best differs:")
    for name, m, n, k, us, gbs, peer, cfg in rows:
        rule = heuristic(m, n, k, sm_count(torch.device("cuda")))
        if rule != cfg:
            print(f"    {name} M={m}: rule {rule}, best {cfg}")


if __name__ == "__main__":
    main()
