"""GGUF's int8 groups through the Triton 8-bit GEMM against the dense bf16 weight they replace
(`bash benchmarks/device_bench.sh sweep:w8a16`): llama3-8b's projections at M = 1 and 16, Q8_0's form (groups
of 32, no offsets) and Q6_K-with-Q4_K's (groups of 16 with offsets), bf16 x, timed from CUDA-graph
replays that cycle through weight copies past L2; the dense side is the model's own decode path
(the Triton dense GEMV where its table has the shape, else F.linear). W8_SWEEP=1 also times
other launch configs and prints the best per case."""
import math
import os

import torch
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.backends.triton.gemm.w8a16 import W8Config, config, w8a16_gemm
from corectl.backends.triton.layer_kernels import triton_layer_kernels
from corectl.quantization.gguf_int8 import w8a16_reference
from torch.nn import functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FORMS = {"g32": (32, False), "g16+off": (16, True)}
SWEEP = os.environ.get("W8_SWEEP") == "1"


def candidates(m: int, n: int, k: int, group: int) -> list[W8Config]:
    """The heuristic's config, then (W8_SWEEP=1) others of the same form."""
    chosen = config(m, n, k, group, 132)
    if not SWEEP:
        return [chosen]
    if m == 1:
        others = [W8Config(1, bn, bk, sk, w) for bn in (16, 32, 64) for bk in (256, 512) for sk in (1, 2, 4)
                  for w in (4, 8) if bn * bk <= 16384]
    else:
        others = [W8Config(16, bn, bk, sk, w) for bn in (32, 64, 128) for bk in (64, 128) for sk in (1, 2, 4, 8)
                  for w in (4,)]
    return [chosen] + [c for c in others if c != chosen]


def copies_of(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, math.ceil((256 << 20) / nbytes)))]


def main() -> None:
    kernels = triton_layer_kernels()

    def dense_linear(x, w):
        out = kernels.dense_linear(x, w, None, False)
        return F.linear(x, w) if out is None else out
    print("layer    M  form      int8 us   GB/s   dense bf16 us   GB/s   error")
    for name, (n, k) in SHAPES.items():
        dense = copies_of(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, n * k * 2)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dense_us = graph_us([lambda w=w: dense_linear(x, w) for w in dense])
            for form, (group, offsets) in FORMS.items():
                def make():
                    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda")
                    scales = (torch.rand(n, k // group, device="cuda") * 1e-3).half()
                    return codes, scales, (torch.randn_like(scales) * 1e-3) if offsets else None
                weights = copies_of(make, n * k)
                ref = w8a16_reference(x, *weights[0], group).float()
                error = ((w8a16_gemm(x, *weights[0], group).float() - ref).norm() / ref.norm()).item()
                timed = sorted((graph_us([lambda q=q, c=c: w8a16_gemm(x, *q, group, c) for q in weights]), i, c)
                               for i, c in enumerate(candidates(m, n, k, group)))
                us = next(t for t, i, _ in timed if i == 0)
                moved = n * k * (1 + (4 if offsets else 2) / group)
                print(f"{name:8s} {m:2d} {form:8s} {us:8.2f} {moved / us / 1e3:6.0f} {dense_us:12.2f} "
                      f"{n * k * 2 / dense_us / 1e3:6.0f}   {error:.1e}", flush=True)
                if SWEEP:
                    print(f"    best {timed[0][0]:.2f} us {timed[0][2]}", flush=True)
                del weights
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
