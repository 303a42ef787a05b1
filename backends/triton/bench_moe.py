"""Time one mixture-of-experts layer at Qwen3-30B-A3B's shape on the GPU (W7's expert share).

    python -m corectl.backends.triton.bench_moe [--num-tokens 1 8 64 256]

For each batch: the layer kernel the CUDA worker installs (routing, then the path the launcher
picks), each kernel path forced, and the torch path (the CPU code, run eagerly on the GPU), as
median milliseconds and as bandwidth counting the expert weights the batch is routed to (every
chosen expert's gate, up and down rows read once), next to a device-to-device copy.
"""
from __future__ import annotations

import argparse

import torch

# Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, top 8, renormalised.
HIDDEN, EXPERTS, INTER, TOP_K = 2048, 128, 768, 8
DTYPE = torch.bfloat16


def bench_layer(num_tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[str, float, float]]:
    """(name, median ms, TB/s of routed expert weights) for one batch size."""
    from triton.testing import do_bench

    from corectl.models.moe import fused_moe_torch, select_experts

    from .fused_moe import fused_moe
    from .layer_kernels import triton_layer_kernels

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


def copy_bandwidth(nbytes: int) -> float:
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / ms / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no GPU visible: the MoE benchmark times the CUDA/ROCm kernels")
    torch.manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") / HIDDEN ** 0.5).to(DTYPE)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") / INTER ** 0.5).to(DTYPE)
    copy = copy_bandwidth(1 << 30)
    print(f"\nQwen3-30B-A3B MoE layer (hidden {HIDDEN}, {EXPERTS} experts x {INTER}, top {TOP_K}, bf16); "
          f"device copy {copy:.3f} TB/s")
    print(f"  {'tokens':>6}  {'kernel':<40} {'median ms':>10} {'TB/s':>7} {'% copy':>7}")
    for num_tokens in args.num_tokens:
        for name, ms, bandwidth in bench_layer(num_tokens, gate_up, down):
            print(f"  {num_tokens:>6}  {name:<40} {ms:10.4f} {bandwidth:7.3f} {100 * bandwidth / copy:6.1f}%")


if __name__ == "__main__":
    main()
