"""Time one mixture-of-experts layer at Qwen3-30B-A3B's shape on the GPU (W7's expert share).

    python -m corectl.backends.triton.bench.moe [--num-tokens 1 8 64 256] [--sweep coarse|fine]

For each batch: the layer kernel the CUDA worker installs (routing, then the path the launcher
picks), each kernel path forced, and the torch path (the CPU code, run eagerly on the GPU), as
median milliseconds and as bandwidth counting the expert weights the batch is routed to (every
chosen expert's gate, up and down rows read once), next to a device-to-device copy. `--sweep`
times each kernel of the pairs path (the decode path) over a grid of tile configs (`fine`: a
larger grid, for batch 1) for batches up to 8 tokens and prints moe_pairs.TUNED's entry.
"""
from __future__ import annotations

import argparse
import itertools

import torch

# Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, top 8, renormalised.
HIDDEN, EXPERTS, INTER, TOP_K = 2048, 128, 768, 8
DTYPE = torch.bfloat16


def bench_layer(num_tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[str, float, float]]:
    """(name, median ms, TB/s of routed expert weights) for one batch size."""
    from corectl.models.moe import fused_moe_torch, select_experts
    from triton.testing import do_bench

    from ..layer_kernels import triton_layer_kernels
    from ..moe.fused_moe import fused_moe

    hidden = torch.randn(num_tokens, HIDDEN, device="cuda").to(DTYPE)
    logits = torch.randn(num_tokens, EXPERTS, device="cuda").to(DTYPE)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    routed = ids.unique().numel() * 3 * INTER * HIDDEN * gate_up.element_size()
    routed_moe = triton_layer_kernels().fused_moe
    candidates = {
        "layer kernel (routing + auto path)": lambda: routed_moe(hidden, gate_up, down, logits, TOP_K, True),
        "pairs path": lambda: fused_moe(hidden, gate_up, down, weights, ids, check_indices=False, path="pairs"),
        "sorted path": lambda: fused_moe(hidden, gate_up, down, weights, ids, check_indices=False, path="sorted"),
        "torch path (eager, reads counts back)": lambda: fused_moe_torch(hidden, gate_up, down, weights, ids),
    }
    rows = []
    for name, run in candidates.items():
        ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        rows.append((name, ms, routed / ms / 1e9))
    return rows


# Tile grids of the sweep: (block_n, block_k, num_warps, num_stages) choices; "fine" is for batch 1.
SWEEP_GRIDS = {
    "coarse": ((4, 8, 16), (128, 256, 512), (4, 8), (2, 4)),
    "fine": ((2, 4, 8), (256, 512, 1024), (2, 4, 8), (3, 4, 5)),
}


def sweep_pairs(num_tokens: int, gate_up: torch.Tensor, down: torch.Tensor, copy: float, grid: str):
    """The fastest gate/up and down configs of the pairs path at one batch size, with their times."""
    from corectl.models.moe import select_experts
    from triton.testing import do_bench

    from ..moe.moe_pairs import PairConfig, PairConfigs, down_sum_by_token, gate_up_by_pair

    hidden = torch.randn(num_tokens, HIDDEN, device="cuda").to(DTYPE)
    weights, ids = select_experts(torch.randn(num_tokens, EXPERTS, device="cuda"), TOP_K, renormalize=True)
    experts = ids.unique().numel()
    activated = torch.randn(num_tokens * TOP_K, INTER, device="cuda").to(DTYPE)
    kernels = {
        "gate_up": (lambda cfg: gate_up_by_pair(hidden, gate_up, ids, None, cfg), 2 * INTER * HIDDEN),
        "down": (lambda cfg: down_sum_by_token(activated, down, ids, weights, None, cfg), HIDDEN * INTER),
    }
    best = {}
    for name, (run, elements) in kernels.items():
        timed = []
        for block_n, block_k, warps, stages in itertools.product(*SWEEP_GRIDS[grid]):
            cfg = PairConfig(block_n, block_k, warps, stages)
            timed.append((do_bench(lambda: run(cfg), warmup=10, rep=60, return_mode="median"), cfg))
        ms, cfg = min(timed)
        bandwidth = experts * elements * gate_up.element_size() / ms / 1e9
        print(f"  {num_tokens:>6}  {name:<8} {ms * 1e3:8.1f} us {bandwidth:7.3f} TB/s "
              f"{100 * bandwidth / copy:5.1f}%  {cfg}")
        best[name] = cfg
    return PairConfigs(best["gate_up"], best["down"])


def copy_bandwidth(nbytes: int) -> float:
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / ms / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, nargs="+", default=None)
    parser.add_argument("--sweep", choices=sorted(SWEEP_GRIDS), help="tune the pairs path's tiles (batches <= 8)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no GPU visible: the MoE benchmark times the CUDA/ROCm kernels")
    torch.manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") / HIDDEN ** 0.5).to(DTYPE)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") / INTER ** 0.5).to(DTYPE)
    copy = copy_bandwidth(1 << 30)
    print(f"\nQwen3-30B-A3B MoE layer (hidden {HIDDEN}, {EXPERTS} experts x {INTER}, top {TOP_K}, bf16); "
          f"device copy {copy:.3f} TB/s")
    if args.sweep:
        table = {}
        for num_tokens in args.num_tokens or [1, 2, 4, 8]:
            table[num_tokens * TOP_K] = sweep_pairs(num_tokens, gate_up, down, copy, args.sweep)
        print(f"moe_pairs.TUNED[({HIDDEN}, {INTER})] = {table!r}")
        return
    print(f"  {'tokens':>6}  {'kernel':<40} {'median ms':>10} {'TB/s':>7} {'% copy':>7}")
    for num_tokens in args.num_tokens or [1, 8, 64, 256]:
        for name, ms, bandwidth in bench_layer(num_tokens, gate_up, down):
            print(f"  {num_tokens:>6}  {name:<40} {ms:10.4f} {bandwidth:7.3f} {100 * bandwidth / copy:6.1f}%")


if __name__ == "__main__":
    main()
