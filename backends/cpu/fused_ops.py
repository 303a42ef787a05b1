"""The CPU's fused layer kernels (corectl.models.kernels.LayerKernels) and paged attention, from
`fused_ops.c`, built like the 4-bit GEMM (corectl.quantization.int4_cpu.build_library) and called
through ctypes on torch's OpenMP threads.

fp32 only (the CPU platform computes quantized and fp32 checkpoints in fp32; fused_layer.py installs
them, with the whole-layer call, only then and where a C compiler exists). The
wrappers check nothing on the hot path beyond what picks the C call: the model runner hands them
contiguous fp32 rows, positions within the rotary tables and slots within the cache.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from corectl.quantization.int4_cpu import build_library

_SOURCE = Path(__file__).with_name("fused_ops.c")
# The KV cache dtypes the fused attention reads and writes: fp16 caches are widened to fp32 as read.
KV_DTYPES = (torch.float32, torch.float16)
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_L, _L, _P, _L, _P, _L, _P, _F, _P, _P, _I],
    "silu_and_mul": [_L, _L, _P, _L, _P, _I],
    "rotary": [_L, _I, _I, _I, _P, _P, _L, _L, _P, _L, _L, _P, _P, _I],
    "paged_attention": [_L, _I, _I, _I, _P, _L, _P, _L, _P, _L, _P, _I, _L, _P, _P, _L, _I, _P, _P, _L, _F, _P, _I],
    "decoder_layer": [_P, _P, _P, _L, _I, _P, _P, _I, _P],
}


@functools.lru_cache(maxsize=None)
def fused_library(arch: str = "native") -> ctypes.CDLL | None:
    """The kernels built for `-march=arch` (the host's CPU; tests build older ones for the loops other
    CPUs run), or None where they cannot be built."""
    lib = build_library(_SOURCE, arch)
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, N] -> norm(x), or (norm(x + residual), x + residual)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    residual = residual if residual is None or residual.stride(1) == 1 else residual.contiguous()
    t, n = x.shape
    out = torch.empty(t, n)
    summed = None if residual is None else torch.empty(t, n)
    fused_library().rms_norm(t, n, x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                             0 if residual is None else residual.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                             None if summed is None else summed.data_ptr(), torch.get_num_threads())
    return out if summed is None else (out, summed)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    t, n = x.shape
    out = torch.empty(t, n // 2)
    fused_library().silu_and_mul(t, n // 2, x.data_ptr(), x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (any token and head strides; a view whose
    features are not adjacent is rotated in a copy and written back)."""
    if q.stride(2) != 1 or k.stride(2) != 1:
        q_rows, k_rows = q.contiguous(), k.contiguous()
        rotary_embedding(positions, q_rows, k_rows, cos, sin)
        q.copy_(q_rows)
        k.copy_(k_rows)
        return
    positions = positions if positions.dtype == torch.int64 else positions.long()
    fused_library().rotary(q.shape[0], q.shape[1], k.shape[1], q.shape[2], positions.data_ptr(), q.data_ptr(),
                           q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), cos.data_ptr(),
                           sin.data_ptr(), torch.get_num_threads())


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor, block_size: int, seqs: torch.Tensor,
                    ends: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None,
                    scale: float) -> torch.Tensor:
    """Causal attention of the packed rows q [T, Hq * D] over the paged cache [2, blocks, block_size,
    Hk, D] (fp32, or fp16: `KV_DTYPES`), into which this step's k, v [T, Hk * D] are written at
    slot_mapping first; row t sees positions [0, ends[t]) (the last `window` of them where set) of
    sequence seqs[t] (both int64); block_tables int32."""
    t = q.shape[0]
    q, k, v = (x.reshape(t, -1) for x in (q, k, v))
    q, k, v = (x if x.stride(1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(t, num_heads * head_dim)
    fused_library().paged_attention(
        t, num_heads, num_kv_heads, head_dim, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
        v.stride(0), kv_cache.data_ptr(), kv_cache.dtype == torch.float16,
        kv_cache[0].numel() // (num_kv_heads * head_dim), slot_mapping.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), block_size, seqs.data_ptr(), ends.data_ptr(), window or 0,
        scale, out.data_ptr(), torch.get_num_threads())
    return out
