"""The MXFP4 MoE kernel (`backends/triton/moe/mxfp4_moe.py`) alone at gpt-oss-20b's layer sizes, from a
decode step to a prefill chunk (stage `w2oss` of `device_bench.sh` prints it before the engine's TPOT).

Four layers of packed experts (1.7 GB, far past L2) are run in turn from one CUDA graph, so each
layer's experts come from HBM as in a forward. `expert GB/s` is the packed bytes of the experts a
layer's tokens touch (17/32 byte a weight, plus biases) over its time: at batch 1 this is the
figure to hold against the copy bandwidth. `TFLOP/s` counts the routed pairs' GEMMs.
"""
import torch
import triton
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.backends.triton.moe.fused_moe import topk_softmax
from corectl.backends.triton.moe.mxfp4_moe import Mxfp4Stack, mxfp4_moe

HIDDEN, EXPERTS, INTER, TOP_K = 2880, 32, 2880, 4
LAYERS = 4
TOKENS = (1, 2, 4, 16, 64, 256, 2048, 8192)


def stack(rows: int, k: int) -> Mxfp4Stack:
    blocks = torch.randint(0, 256, (EXPERTS, rows, k // 32, 16), dtype=torch.uint8, device="cuda")
    scales = torch.randint(118, 124, (EXPERTS, rows, k // 32), dtype=torch.uint8, device="cuda")
    return Mxfp4Stack(blocks, scales, torch.randn(EXPERTS, rows, device="cuda", dtype=torch.bfloat16) / 8)


def main() -> None:
    torch.manual_seed(0)
    layers = [(stack(2 * INTER, HIDDEN), stack(HIDDEN, INTER)) for _ in range(LAYERS)]
    expert_bytes = 3 * INTER * HIDDEN * 17 / 32 + (2 * INTER + HIDDEN) * 2
    print(f"triton {triton.__version__}; gpt-oss-20b layer: {EXPERTS} experts, top {TOP_K}, "
          f"{expert_bytes / 1e6:.1f} MB an expert")
    print(" tokens  path     us/layer  experts read  expert GB/s  TFLOP/s")
    for tokens in TOKENS:
        hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, ids = topk_softmax(torch.randn(tokens, EXPERTS, device="cuda"), TOP_K, True)
        touched = ids.unique().numel()
        path = "pairs" if tokens * TOP_K <= EXPERTS // 2 else "sorted"
        calls = [lambda gate_up=gate_up, down=down: mxfp4_moe(hidden, gate_up, down, weights, ids, 1.702, 7.0,
                                                              check_indices=False)
                 for gate_up, down in layers]
        us = graph_us(calls)
        flops = 2 * tokens * TOP_K * 3 * INTER * HIDDEN
        print(f"{tokens:7d}  {path:7s} {us:9.1f}  {touched:12d}  {touched * expert_bytes / us / 1e3:11.0f}  "
              f"{flops / us / 1e6:7.1f}", flush=True)


if __name__ == "__main__":
    main()
