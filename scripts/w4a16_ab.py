"""The 4-bit GEMV before and after a change, in one device call (stage `w4ab` of device_bench.sh).

The earlier kernel module is imported as `corectl.backends.triton.w4a16_before` (the stage copies
it there from `.bench/w4a16_before.py`, e.g. `git show REV:backends/triton/gemm/w4a16.py`). At M = 1
on llama3-8b's four projections (group 128, bf16 x), each version runs the table's config and a
few others (GEMV forms, and 16-row tl.dot tiles padding the one row), timed from CUDA-graph
replays that cycle through weight copies past L2, and is checked against the fp32 reference; the
best time per layer and version comes last, then both versions' table configs at M = 16 (a
decode batch, tl.dot tiles). Zero codes go to the earlier kernel as int32 codes and to the
current one in the form int4.py now serves (W4_AFTER_FORM=served: fp32 offsets -z s, words as
column tiles; =codes: as the earlier one).
"""
import os
import math

import torch
from corectl.backends.triton.gemm import w4a16 as after
from corectl.backends.triton import w4a16_before as before
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.backends.triton.gemm.w4a16_configs import W4Config, choose
from corectl.quantization.int4 import pack_int32, tile_words, w4a16_reference

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
# (block_n, block_k, split_k, num_warps) besides the table's choice
OTHERS = ((16, 512, 1, 4), (32, 512, 1, 4), (32, 512, 2, 4), (16, 256, 1, 4), (32, 256, 1, 4), (32, 256, 2, 4),
          (64, 256, 1, 4), (16, 1024, 1, 4), (8, 512, 1, 4), (16, 512, 2, 4), (32, 512, 1, 8), (16, 256, 2, 2),
          (16, 256, 4, 4), (16, 512, 4, 4), (32, 512, 4, 4), (16, 128, 4, 2), (32, 1024, 1, 8))
# (block_n, block_k, split_k, num_warps) of 16-row tl.dot tiles tried at M = 1 (W4_DOTS=1)
DOTS = ((64, 128, 4, 4), (128, 64, 8, 4)) if os.environ.get("W4_DOTS") == "1" else ()
AFTER_SERVED = os.environ.get("W4_AFTER_FORM", "served") == "served"


def layer(n: int, k: int):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(k // GROUP, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // GROUP, n), dtype=torch.int32, device="cuda")
    g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // GROUP
    return pack_int32(codes.t(), 0), scales, zeros, g_idx


def as_served(qweight, scales, zeros, g_idx):
    return tile_words(qweight), scales, -(zeros.float() * scales.float()), g_idx


def versions(copies):
    """(module, tag, its weight copies): the current kernel takes offsets where int4.py makes them."""
    return ((before, "before", copies),
            (after, "after", [as_served(*c) for c in copies] if AFTER_SERVED else copies))


def bench(name: str, n: int, k: int) -> list[tuple]:
    copies = [layer(n, k) for _ in range(max(2, math.ceil((256 << 20) / (n * k // 2))))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = w4a16_reference(x, *copies[0]).float()
    configs = dict.fromkeys([choose(1, n, k, x.device)] + [W4Config(1, bn, bk, sk, w, gemv=True)
                                                           for bn, bk, sk, w in OTHERS]
                            + [W4Config(16, bn, bk, sk, w) for bn, bk, sk, w in DOTS])
    moved = n * k // 2 + (k // GROUP) * n * 6
    rows = []
    for module, tag, copies in versions(copies):
        for cfg in configs:
            out = module.w4a16_gemm(x, *copies[0], GROUP, False, cfg)
            error = ((out.float() - ref).norm() / ref.norm()).item()
            us = graph_us([lambda q=q, c=cfg: module.w4a16_gemm(x, *q, GROUP, False, c) for q in copies])
            rows.append((name, tag, cfg, us, error))
            print(f"{name:8s} {tag:6s} {us:7.2f} us {moved / us / 1e3:6.0f} GB/s error {error:.1e} {cfg}", flush=True)
    return rows


def main() -> None:
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += bench(name, n, k)
        torch.cuda.empty_cache()
    print("\nbest per layer (us): layer, before, after, after's config")
    for name in SHAPES:
        best = {tag: min((r for r in rows if r[0] == name and r[1] == tag), key=lambda r: r[3])
                for tag in ("before", "after")}
        print(f"{name:8s} {best['before'][3]:7.2f} {best['after'][3]:7.2f} {best['after'][2]}")
    print("\nM = 16, table configs (us): layer, before, after")
    for name, (n, k) in SHAPES.items():
        copies = [layer(n, k) for _ in range(max(2, math.ceil((256 << 20) / (n * k // 2))))]
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        times = []
        for module, tag, weights in versions(copies):
            error = ((module.w4a16_gemm(x, *weights[0], GROUP, False).float() - w4a16_reference(x, *copies[0]).float()
                      ).norm() / w4a16_reference(x, *copies[0]).float().norm()).item()
            assert error < 1e-2, (name, tag, error)
            times.append(graph_us([lambda q=q, m=module: m.w4a16_gemm(x, *q, GROUP, False) for q in weights]))
        print(f"{name:8s} {times[0]:7.2f} {times[1]:7.2f}", flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
