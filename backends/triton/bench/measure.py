"""What the kernel benchmarks share: the error measure of their correctness checks and the copy
they compare bandwidth with."""
from __future__ import annotations

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench_copy(do_bench, nbytes: int) -> tuple[str, float, float]:
    """(name, median ms, TB/s) of a device-to-device copy of `nbytes` (read + write counted)."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return "device-to-device copy (read + write)", ms, 2 * nbytes / ms / 1e9
