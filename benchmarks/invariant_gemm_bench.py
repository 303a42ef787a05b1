"""The batch-invariant GEMM against cuBLAS (`bash benchmarks/device_bench.sh sweep:invgemm`): bf16
4096 x 4096 x 4096 (the target: >= 70% of cuBLAS) and llama3-8b's projections from a decode batch of
1 to a prefill chunk of 8192 rows, each timed from a CUDA graph (which also proves the launch
captures). First, on the device itself, each shape's first rows alone against the same rows inside
every larger batch: bitwise equal, or the mode's promise does not hold on this GPU.

`--sweep` (`sweep:invgemmcfg`) times other launch configs too, per shape and batch: one config must
serve every M of a shape (the config may depend on N and K only), so pick the one with the best
total over the batches that matter (W1: decode batches near 256, prefill chunks of 8192)."""
import argparse

import torch
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.backends.triton.gemm.invariant import InvariantConfig, invariant_config, invariant_linear

SHAPES = {"square": (4096, 4096), "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = (1, 16, 64, 256, 2048, 8192)
CANDIDATES = [InvariantConfig(128, 128, 64, 8, 8, 3), InvariantConfig(128, 128, 64, 8, 4, 5),
              InvariantConfig(128, 256, 64, 8, 8, 4), InvariantConfig(64, 128, 64, 8, 4, 4),
              InvariantConfig(128, 128, 128, 8, 8, 3)]


def check_rows(weight: torch.Tensor) -> bool:
    x = torch.randn(max(ROWS), weight.shape[1], device="cuda", dtype=weight.dtype)
    first = invariant_linear(x[:1], weight)
    return all(torch.equal(invariant_linear(x[:m], weight)[:1], first) for m in ROWS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time CANDIDATES beside the chosen config")
    sweep = parser.parse_args().sweep
    print("layer        M   invariant us  cuBLAS us  share of cuBLAS  TFLOP/s  rows invariant"
          + "".join(f"  {tuple(c)}" for c in CANDIDATES) * sweep)
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        invariant = check_rows(weight)
        for m in (4096,) if name == "square" else ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = graph_us([lambda: invariant_linear(x, weight)])
            cublas = graph_us([lambda: torch.nn.functional.linear(x, weight)])
            row = (f"{name:8s} {m:5d}   {ours:12.1f}  {cublas:9.1f}  {cublas / ours:15.2f}  "
                   f"{2 * m * n * k / ours / 1e6:7.0f}  {invariant}")
            for cfg in CANDIDATES if sweep else ():
                cfg = cfg._replace(block_n=min(cfg.block_n, invariant_config(n, k, weight.dtype).block_n))
                row += f"  {graph_us([lambda cfg=cfg: invariant_linear(x, weight, config=cfg)]):8.1f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
