"""Time FP8-weight linear layers at decode batch sizes on the GPU and pick the W8A16 kernel's configs.

    python -m corectl.backends.triton.bench.fp8 [--m 1 2 4 8] [--shapes qkv o gate_up down]
    python -m corectl.backends.triton.bench.fp8 --dense [--m 1 2 4 8] [--shapes ...]

`--dense` sweeps the same kernel on bf16 weights (`dense_gemv`) against F.linear instead, the down
projections also gated (silu(gate) * up formed on load, against silu_and_mul + F.linear), and prints
per case the launch rule's choice (`gemv_configs.dense_decode_config`: a config or F.linear) against
the fastest of the sweep and F.linear: where the rule gives up more than the run-to-run spread, the
rule needs revising. Shapes of other presets (qwen3-14b, gemma-2-9b, ...) are among `--shapes`.

For llama3-8b's four projections and each batch size M: today's W8A8 path (the Triton activation
quantizer + torch._scaled_mm), bf16 F.linear, and `fp8_w8a16_gemv` under each candidate config.
Every variant is captured in one CUDA graph (launch gaps as in a graph-replayed decode step) that
cycles through enough weight copies to overflow L2, so each call reads its weight from HBM as in
a real step. Prints microseconds per call and GB/s of weight bytes, the best configs per case against
the rule's (`gemv_configs.fp8_decode_config`), a summary, the linear layers' time per decode step
(32 layers), and the largest M at which the kernel beats W8A8 on every shape (GEMV_MAX_M).
"""
from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from ..elementwise.activation import silu_and_mul
from ..gemm.fp8_gemv import GemvConfig, dense_gemv, fp8_w8a16_gemv
from ..gemm.gemv_configs import MAX_M, dense_decode_config, fp8_decode_config

# llama3-8b's projections, then qwen3-0.6b's (W3's model), both LM heads (the --dense default: the
# shapes the rule was read off), then shapes of presets it was not (`--shapes` picks).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "q06_qkv": (4096, 1024), "q06_o": (1024, 2048), "q06_gate_up": (6144, 1024), "q06_down": (1024, 3072),
          "lm_head": (128256, 4096), "q06_lm_head": (151936, 1024),
          "q14_qkv": (7168, 5120), "q14_o": (5120, 5120), "q14_gate_up": (34816, 5120), "q14_down": (5120, 17408),
          "g9_qkv": (8192, 3584), "g9_o": (3584, 4096), "g9_gate_up": (28672, 3584), "g9_down": (3584, 14336),
          "g9_lm_head": (256000, 3584), "l32_o": (3072, 3072), "l32_down": (3072, 8192)}
MEASURED = tuple(SHAPES)[:10]
LLAMA = ("qkv", "o", "gate_up", "down")
GATED = ("down", "q06_down", "q14_down", "g9_down", "l32_down")
# Run-to-run spread is ~1%: a rule more than this much slower than the best choice is worth revising.
RULE_SLACK = 1.03
LAYERS = 32
DTYPE = torch.bfloat16
L2_OVERFLOW_BYTES = 256 << 20  # H100 L2 is 50 MB: cycle through at least 5x that
REPLAYS = 10
# (block_m, block_n, block_k) candidates: M = 1 tries the CUDA-core GEMV and a few tensor-core
# tiles, larger M the 16-row tensor-core tile.
_DOT_TILES = [(16, 16, 256), (16, 16, 512), (16, 32, 128), (16, 32, 256), (16, 64, 128), (16, 64, 256)]
TILES = {1: [(1, 8, 512), (1, 16, 256), (1, 16, 512), (1, 16, 1024), (1, 32, 256), (1, 32, 512),
             (16, 16, 512), (16, 32, 256), (16, 64, 256)],
         16: _DOT_TILES}


def candidates(m: int, k: int) -> list[GemvConfig]:
    """Tiles x loads issued ahead (1: none) x split-K, each split keeping two BLOCK_K steps;
    16 KB tiles and up get 8 warps."""
    found = []
    for block_m, block_n, block_k in TILES[1 if m == 1 else 16]:
        warps = 8 if block_n * block_k >= 16384 else 4
        for stages in (1, 3):
            for split_k in (1, 2, 4):
                if k // split_k >= 2 * block_k:
                    found.append(GemvConfig(block_m, block_n, block_k, split_k, warps, stages))
    return found


def graph_us(calls: list[Callable[[], object]]) -> float:
    """Microseconds per call of `calls` replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * len(calls))


def _copies(nbytes: int) -> int:
    return max(2, math.ceil(L2_OVERFLOW_BYTES / nbytes))


def bench_shape(n: int, k: int, ms: list[int]) -> list[dict]:
    """One row per M: baselines and the sweep's results (us per call)."""
    from corectl.quantization.fp8 import fp8_gemm_scaled_mm, quantize_rows

    from ..gemm.fp8_quant import quantize_rows_fp8

    fp8 = [quantize_rows((torch.randn(n, k, device="cuda") * k ** -0.5).to(DTYPE)) for _ in range(_copies(n * k))]
    fp8 = [(w, s.view(-1)) for w, s in fp8]
    dense = [(torch.randn(n, k, device="cuda") * k ** -0.5).to(DTYPE) for _ in range(_copies(2 * n * k))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda").to(DTYPE)
        w8a8 = [lambda w=w, s=s: fp8_gemm_scaled_mm(*quantize_rows_fp8(x), w, s, None, DTYPE) for w, s in fp8]
        row = {"n": n, "k": k, "m": m, "w8a8": graph_us(w8a8),
               "bf16": graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in dense]),
               "default": fp8_decode_config(m, n, k), "sweep": {}}
        for cfg in dict.fromkeys(candidates(m, k) + [row["default"]]):
            row["sweep"][cfg] = graph_us([lambda w=w, s=s, c=cfg: fp8_w8a16_gemv(x, w, s, None, c) for w, s in fp8])
        row["best"] = min(row["sweep"], key=row["sweep"].get)
        rows.append(row)
        _print_case(row)
    del fp8, dense
    torch.cuda.empty_cache()
    return rows


def bench_dense_shape(n: int, k: int, ms: list[int], gated: bool) -> list[dict]:
    """One row per M: F.linear (after silu_and_mul when gated) and `dense_gemv` per config, bf16."""
    dense = [(torch.randn(n, k, device="cuda") * k ** -0.5).to(DTYPE) for _ in range(_copies(2 * n * k))]
    rows = []
    for m in ms:
        x = torch.randn(m, 2 * k if gated else k, device="cuda").to(DTYPE)
        if gated:
            peer = [lambda w=w: torch.nn.functional.linear(silu_and_mul(x), w) for w in dense]
        else:
            peer = [lambda w=w: torch.nn.functional.linear(x, w) for w in dense]
        rule = dense_decode_config(m, n, k, gated)
        row = {"n": n, "k": k, "m": m, "gated": gated, "bf16": graph_us(peer), "rule": rule, "sweep": {}}
        for cfg in dict.fromkeys(candidates(m, k) + ([rule] if rule else [])):
            row["sweep"][cfg] = graph_us([lambda w=w, c=cfg: dense_gemv(x, w, None, c, gated) for w in dense])
        row["best"] = min(row["sweep"], key=row["sweep"].get)
        rows.append(row)
        best = row["sweep"][row["best"]]
        print(f"N={n} K={k} M={m}{' gated' if gated else ''}: F.linear {row['bf16']:.2f} us "
              f"({_gbs(2 * n * k, row['bf16']):.0f} GB/s), gemv {best:.2f} us ({_gbs(2 * n * k, best):.0f} GB/s) "
              f"{tuple(row['best'])}")
    del dense
    torch.cuda.empty_cache()
    return rows


def summarize_dense(rows: list[dict]) -> None:
    """Per case: the rule's choice (a config or F.linear) against the fastest of the sweep and
    F.linear, flagged where the rule is more than RULE_SLACK behind."""
    print(f"\n{'shape':>13} {'M':>2} {'gated':>5} {'F.linear':>8} {'best':>8} {'rule':>8} {'rule/best':>9}  rule's choice")
    worst = 1.0
    for r in rows:
        best = min(r["bf16"], r["sweep"][r["best"]])
        ours = r["sweep"][r["rule"]] if r["rule"] else r["bf16"]
        worst = max(worst, ours / best)
        flag = "  <- revise" if ours > RULE_SLACK * best else ""
        print(f"{r['n']:>6}x{r['k']:<6} {r['m']:>2} {'yes' if r['gated'] else 'no':>5} {r['bf16']:8.2f} {best:8.2f} "
              f"{ours:8.2f} {ours / best:9.3f}  {tuple(r['rule']) if r['rule'] else 'F.linear'}{flag}")
    print(f"# the rule's worst case: {worst:.3f}x the best choice")


def _gbs(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def _print_case(row: dict) -> None:
    n, k, m, sweep = row["n"], row["k"], row["m"], row["sweep"]
    print(f"\nN={n} K={k} M={m}: W8A8 {row['w8a8']:.2f} us ({_gbs(n * k, row['w8a8']):.0f} GB/s), "
          f"bf16 {row['bf16']:.2f} us ({_gbs(2 * n * k, row['bf16']):.0f} GB/s)")
    ranked = sorted(sweep, key=sweep.get)
    for cfg in dict.fromkeys(ranked[:3] + [row["default"]]):
        tag = " (the rule's)" if cfg == row["default"] else ""
        print(f"  gemv {cfg}: {sweep[cfg]:.2f} us ({_gbs(n * k, sweep[cfg]):.0f} GB/s){tag}")
    print(f"  ({len(sweep)} configs; slowest {max(sweep.values()):.2f} us)")


def summarize(rows: list[dict]) -> None:
    print(f"\n{'shape':>12} {'M':>3} {'W8A8 us':>8} {'bf16 us':>8} {'gemv us':>8} {'GB/s':>6} {'vs W8A8':>8}"
          "  best (block_m, block_n, block_k, split_k, num_warps, num_stages)")
    for r in rows:
        best = r["sweep"][r["best"]]
        print(f"{r['n']:>6}x{r['k']:<5} {r['m']:>3} {r['w8a8']:8.2f} {r['bf16']:8.2f} {best:8.2f} "
              f"{_gbs(r['n'] * r['k'], best):6.0f} {r['w8a8'] / best:7.2f}x  {tuple(r['best'])}")
    for m in sorted({r["m"] for r in rows}):
        per_m = [r for r in rows if r["m"] == m]
        if len(per_m) == len(LLAMA):
            step = {name: LAYERS * sum(r[name] for r in per_m) / 1e3 for name in ("w8a8", "bf16")}
            gemv = LAYERS * sum(r["sweep"][r["best"]] for r in per_m) / 1e3
            print(f"M={m}: linear layers per decode step (x{LAYERS}, no lm_head): W8A8 {step['w8a8']:.2f} ms, "
                  f"bf16 {step['bf16']:.2f} ms, gemv {gemv:.2f} ms")
    slow = [r for r in rows if r["sweep"][r["default"]] > RULE_SLACK * r["sweep"][r["best"]]]
    for r in slow:
        print(f"# rule behind the best at N={r['n']} K={r['k']} M={r['m']}: {tuple(r['default'])} "
              f"{r['sweep'][r['default']]:.2f} us against {tuple(r['best'])} {r['sweep'][r['best']]:.2f} us")
    print(f"# the rule is within {RULE_SLACK:.2f}x of the best config in {len(rows) - len(slow)} of {len(rows)} cases")
    bound = 0
    for m in sorted({r["m"] for r in rows}):
        if not all(r["sweep"][r["best"]] < r["w8a8"] for r in rows if r["m"] == m):
            break
        bound = m
    print(f"# the kernel beats W8A8 on every shape up to M = {bound} "
          "(GEMV_MAX_M in core/quantization/fp8.py, MAX_M in gemv_configs.py)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8], help="batch rows, at most MAX_M")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                        help="default: llama3-8b's four (FP8), the rule's measured ten (--dense)")
    parser.add_argument("--dense", action="store_true", help="sweep the bf16 dense GEMV against F.linear")
    args = parser.parse_args(argv)
    shapes = args.shapes or list(MEASURED if args.dense else LLAMA)
    if not torch.cuda.is_available():
        parser.error("no GPU visible: the benchmark times CUDA kernels")
    if max(args.m) > MAX_M:
        parser.error(f"--m: the GEMV serves at most {MAX_M} rows")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: {', '.join(shapes)}, bf16 activations, "
          f"{REPLAYS} graph replays over weight copies of >= {L2_OVERFLOW_BYTES >> 20} MB")
    start = time.perf_counter()
    if args.dense:
        rows = [row for name in shapes for gated in ((False, True) if name in GATED else (False,))
                for row in bench_dense_shape(*SHAPES[name], args.m, gated)]
        summarize_dense(rows)
    else:
        rows = [row for name in shapes for row in bench_shape(*SHAPES[name], args.m)]
        summarize(rows)
    print(f"# {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
