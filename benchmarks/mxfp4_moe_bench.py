"""The MXFP4 MoE kernel (`backends/triton/moe/mxfp4_moe.py`) alone at gpt-oss-20b's layer sizes, from a
decode step to a prefill chunk (stage `w2oss` of `device_bench.sh` prints it before the engine's TPOT).

Four layers of packed experts (1.7 GB, far past L2) are run in turn from one CUDA graph, so each
layer's experts come from HBM as in a forward, each as the engine runs it: from the router's
logits (`routed_mxfp4_moe`, the CUDA worker's kernel), whose pairs path takes the top-k inside its
kernels (a launch from given ids ran some launches faster alone that were slower in the engine). `expert GB/s` is the packed bytes of the experts a
layer's tokens touch (17/32 byte a weight, plus biases) over its time: at batch 1 this is the
figure to hold against the copy bandwidth. `TFLOP/s` counts the routed pairs' GEMMs.

`--sweep` then times the pairs path at 1, 2 and 4 tokens (`--sweep-tokens`) with each candidate launch of one kernel
(the other at its rule's `pair_config`): column block, groups a step, warps and stages, one line a
kernel and token count. `*` marks the rule's own choice.

`--once` instead runs each layer's pairs path once at one token, eagerly, after a warm-up: a kernel
profiler's input (`sweep:mxfp4ncu` of device_bench.sh runs Nsight Compute over it).
"""
import argparse

import torch
import triton
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.backends.triton.moe.fused_moe import topk_softmax
from corectl.backends.triton.moe.mxfp4_moe import GROUP, Mxfp4Stack, PairConfig, routed_mxfp4_moe
from corectl.backends.triton.moe.mxfp4_pairs import pair_config

HIDDEN, EXPERTS, INTER, TOP_K = 2880, 32, 2880, 4
LAYERS = 4
TOKENS = (1, 2, 4, 16, 64, 256, 2048, 8192)
EXPERT_BYTES = 3 * INTER * HIDDEN * 17 / 32 + (2 * INTER + HIDDEN) * 2


def stack(rows: int, k: int) -> Mxfp4Stack:
    blocks = torch.randint(0, 256, (EXPERTS, rows, k // 32, 16), dtype=torch.uint8, device="cuda")
    scales = torch.randint(118, 124, (EXPERTS, rows, k // 32), dtype=torch.uint8, device="cuda")
    return Mxfp4Stack(blocks, scales, torch.randn(EXPERTS, rows, device="cuda", dtype=torch.bfloat16) / 8)


def routed(tokens: int):
    """(hidden rows, router logits, the experts those pick)."""
    hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    return hidden, logits, topk_softmax(logits, TOP_K, True)[1]


def moe(hidden, logits, gate_up: Mxfp4Stack, down: Mxfp4Stack, **kwargs) -> torch.Tensor:
    """The layer as the engine runs it: from the router's logits (`routed_mxfp4_moe`)."""
    return routed_mxfp4_moe(hidden, logits, tuple(gate_up), tuple(down), TOP_K, True, 1.702, 7.0, **kwargs)


def layer_us(layers, hidden, logits, **kwargs) -> float:
    calls = [lambda gate_up=gate_up, down=down: moe(hidden, logits, gate_up, down, **kwargs) for gate_up, down in layers]
    return graph_us(calls)


def table(layers) -> None:
    print(" tokens  path     us/layer  experts read  expert GB/s  TFLOP/s")
    for tokens in TOKENS:
        hidden, logits, ids = routed(tokens)
        touched = ids.unique().numel()
        path = "pairs" if tokens * TOP_K <= EXPERTS // 2 else "sorted"
        us = layer_us(layers, hidden, logits)
        flops = 2 * tokens * TOP_K * 3 * INTER * HIDDEN
        print(f"{tokens:7d}  {path:7s} {us:9.1f}  {touched:12d}  {touched * EXPERT_BYTES / us / 1e3:11.0f}  "
              f"{flops / us / 1e6:7.1f}", flush=True)


def candidates(rows: int, k: int) -> list[PairConfig]:
    """Column blocks of 4-32 rows on 4 warps, one 16-byte vector a thread and projection (3, 5 and 8
    stages) or two (3 and 5); 1-warp programs of 4 and 8 rows (5 and 8 stages); and programs whose
    threads each hold several rows of one group (a warp across 32 groups, 1 or 2 warps), which
    share each activation load among those rows (3 and 4 stages)."""
    cap = triton.next_power_of_2(k // GROUP)
    four = [PairConfig(bn, min(128 // bn, cap), 4, st) for bn in (4, 8, 16, 32) for st in (3, 5, 8)]
    wide = [PairConfig(bn, min(256 // bn, cap), 4, st) for bn in (8, 16) for st in (3, 5)]
    single = [PairConfig(bn, min(32 // bn, cap), 1, st) for bn in (4, 8) for st in (5, 8)]
    shared = [PairConfig(bn, min(32, cap), warps, st) for bn, warps in ((2, 1), (4, 1), (4, 2), (8, 2))
              for st in (3, 4)]
    return [cfg for cfg in four + wide + single + shared if rows % cfg.block_n == 0]


def sweep(layers, token_counts: tuple[int, ...]) -> None:
    """One line a kernel and token count: block_n/groups/warps/stages:us a layer (both kernels), the
    rule's pick starred."""
    device = torch.device("cuda")
    for tokens in token_counts:
        hidden, logits, _ = routed(tokens)
        rule = (pair_config(INTER, tokens * TOP_K, HIDDEN, device), pair_config(HIDDEN, tokens, INTER, device))
        for kernel, rows, k in (("gate_up", INTER, HIDDEN), ("down", HIDDEN, INTER)):
            cells = []
            for cfg in candidates(rows, k):
                configs = (cfg, rule[1]) if kernel == "gate_up" else (rule[0], cfg)
                us = layer_us(layers, hidden, logits, pair_configs=configs)
                star = "*" if cfg in rule else ""
                cells.append(f"{cfg.block_n}/{cfg.groups}/{cfg.num_warps}/{cfg.num_stages}:{us:.1f}{star}")
            print(f"sweep {kernel} tokens={tokens}: " + " ".join(cells), flush=True)


def once(layers) -> None:
    """Two warm-up rounds, then one round of the layers at one token (the profiled launches)."""
    hidden, logits, _ = routed(1)
    for _ in range(3):
        for gate_up, down in layers:
            moe(hidden, logits, gate_up, down)
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time each candidate pairs launch at 1-4 tokens")
    parser.add_argument("--sweep-tokens", default="1,2,4", help="the token counts the sweep times (default 1,2,4)")
    parser.add_argument("--once", action="store_true", help="run each layer once at one token, for a profiler")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [(stack(2 * INTER, HIDDEN), stack(HIDDEN, INTER)) for _ in range(LAYERS)]
    if args.once:
        once(layers)
        return
    print(f"triton {triton.__version__}; gpt-oss-20b layer: {EXPERTS} experts, top {TOP_K}, "
          f"{EXPERT_BYTES / 1e6:.1f} MB an expert")
    table(layers)
    if args.sweep:
        sweep(layers, tuple(int(count) for count in args.sweep_tokens.split(",")))


if __name__ == "__main__":
    main()
