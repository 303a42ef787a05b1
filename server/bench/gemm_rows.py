"""The model's own GEMMs at a few row counts, by cuBLAS (`F.linear`), for W11: a verify step with
k = 4 at batch 64 runs 320 rows (2.5 x 128), and a poor cuBLAS choice for that shape would show as
320 rows costing more per row than 256 or 384. Each projection of the first decoder layer and the LM
head is timed at each row count with cuBLAS and with cuBLASLt (`torch.backends.cuda.
preferred_blas_library`), and the LM head also writing fp32 directly (`torch.mm(out_dtype=)`,
what `corectl.models.llama.fp32_logits` does on a verify step)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

_ITERS = 20


def _linear_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, [N, K] weight) of every linear layer in the model's first decoder layer, then the LM head."""
    layer = model.model.layers[model.model.stage_layers[0]]
    found = [(name, m.weight) for name, m in layer.named_modules()
             if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2]
    head = getattr(model, "lm_head", None)
    return found + ([("lm_head", head.weight)] if head is not None else [])


def _time(fn) -> float:
    """Mean milliseconds of `fn` over _ITERS back-to-back calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_ITERS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / _ITERS


def gemm_rows_report(model: torch.nn.Module, rows: list[int]) -> str:
    """A table of each GEMM's time (ms) and rate (TFLOP/s) at each row count; CUDA only."""
    if not torch.cuda.is_available():
        return "gemm rows: CUDA only"
    lines = ["| GEMM (N x K) | rows | cuBLAS ms | TFLOP/s | cuBLASLt ms | TFLOP/s | fp32 out ms |", "|---|---|---|---|---|---|---|"]
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for name, weight in _linear_weights(model):
            n, k = weight.shape
            for m in rows:
                x = torch.randn(m, k, dtype=weight.dtype, device=weight.device)
                flop = 2 * m * n * k / 1e9
                times = []
                for library in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(library)
                    times.append(_time(lambda: F.linear(x, weight)))
                torch.backends.cuda.preferred_blas_library(default)
                fp32 = (f"{_time(lambda: torch.mm(x, weight.t(), out_dtype=torch.float32)):.4f}"
                        if name == "lm_head" and weight.dtype != torch.float32 else "")
                lines.append(f"| {name} ({n} x {k}) | {m} | {times[0]:.4f} | {flop / times[0]:.0f} | "
                             f"{times[1]:.4f} | {flop / times[1]:.0f} | {fp32} |")
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    return "\n".join(lines)
