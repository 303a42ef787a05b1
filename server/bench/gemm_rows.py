"""The model's own GEMMs at a few row counts, by cuBLAS (`F.linear`), for W11: a verify step with
k = 4 at batch 64 runs 320 rows (2.5 x 128), and a poor cuBLAS choice for that shape would show as
320 rows costing more per row than 256 or 384. Each projection of the first decoder layer and the LM
head is timed at each row count as torch chooses (what the engine runs), with cuBLAS and with
cuBLASLt (`torch.backends.cuda.preferred_blas_library`), and the LM head also writing fp32 directly
(`torch.mm(out_dtype=)`, against the engine's bf16 logits converted after). The layer's element-wise kernels
(RMSNorm with the residual add, SiLU-and-mul, rotary) follow at the same row counts with the bytes
they move per microsecond (repeated on the same tensors, so an L2-resident input reads faster than
from memory, as it does right after the GEMM that wrote it)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

_ITERS = 20


def _linear_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, [N, K] weight) of every linear layer in the model's first decoder layer, then the LM head."""
    layer = model.model.layers[model.model.stage_layers[0]]
    found = [(name, m.weight) for name, m in layer.named_modules()
             if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2]
    # A platform may have swapped the head for a module without a plain weight (CPU prepacking).
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    return found + ([("lm_head", head)] if isinstance(head, torch.Tensor) and head.dim() == 2 else [])


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


@torch.inference_mode()
def gemm_rows_report(model: torch.nn.Module, rows: list[int]) -> str:
    """A table of each GEMM's time (ms) and rate (TFLOP/s) at each row count; CUDA only."""
    if not torch.cuda.is_available():
        return "gemm rows: CUDA only"
    lines = ["| GEMM (N x K) | rows | torch's choice ms | TFLOP/s | cuBLAS ms | TFLOP/s | cuBLASLt ms | TFLOP/s "
             "| fp32 out ms |", "|---|---|---|---|---|---|---|---|---|"]
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for name, weight in _linear_weights(model):
            n, k = weight.shape
            for m in rows:
                x = torch.randn(m, k, dtype=weight.dtype, device=weight.device)
                flop = 2 * m * n * k / 1e9
                times = []
                for library in (default, "cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(library)
                    times.append(_time(lambda: F.linear(x, weight)))
                torch.backends.cuda.preferred_blas_library(default)
                fp32 = (f"{_time(lambda: torch.mm(x, weight.t(), out_dtype=torch.float32)):.4f}"
                        if name == "lm_head" and weight.dtype != torch.float32 else "")
                rates = " | ".join(f"{t:.4f} | {flop / t:.0f}" for t in times)
                lines.append(f"| {name} ({n} x {k}) | {m} | {rates} | {fp32} |")
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    return "\n".join(lines)


@torch.inference_mode()
def elementwise_rows_report(model: torch.nn.Module, rows: list[int]) -> str:
    """A table of the first decoder layer's installed element-wise kernels at each row count: time (ms)
    and GB/s; CUDA only, and only where a platform installed kernels."""
    layer = model.model.layers[model.model.stage_layers[0]]
    kernels = layer.input_layernorm.kernels
    if not torch.cuda.is_available() or kernels is None:
        return "element-wise rows: CUDA with installed layer kernels only"
    norm, attn = layer.input_layernorm, layer.self_attn
    hidden, inter = norm.weight.shape[0], layer.mlp.down_proj.weight.shape[1]
    dtype, device = norm.weight.dtype, norm.weight.device
    lines = ["| kernel | rows | ms | GB/s |", "|---|---|---|---|"]
    for m in rows:
        x, res = (torch.randn(m, hidden, dtype=dtype, device=device) for _ in range(2))
        gate_up = torch.randn(m, 2 * inter, dtype=dtype, device=device)
        q = torch.randn(m, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        k = torch.randn(m, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        positions = torch.arange(m, device=device)
        size = x.element_size()
        cases = (
            ("rms_norm + residual", lambda: kernels.rms_norm(x, norm.weight, norm.eps, res), 4 * x.numel() * size),
            ("silu_and_mul", lambda: kernels.silu_and_mul(gate_up), 3 * gate_up.numel() // 2 * size),
            ("rotary (q, k)", lambda: kernels.rotary_embedding(positions, q, k, attn.rotary.cos, attn.rotary.sin),
             2 * (q.numel() + k.numel()) * size),
        )
        for name, fn, nbytes in cases:
            ms = _time(fn)
            lines.append(f"| {name} | {m} | {ms:.4f} | {nbytes / ms / 1e6:.0f} |")
    return "\n".join(lines)
