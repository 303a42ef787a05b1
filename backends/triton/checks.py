"""Input validation shared by the kernel launchers.

Triton kernels address raw pointers: a wrong shape, stride or index silently reads or corrupts
other memory (the interpreter catches nothing either), so launchers check everything they rely on
and raise ValueError naming the argument. Index-range checks read device values back, which is a
synchronisation on GPUs: launchers take `check_indices` so hot paths can check once per step.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# An FP8 KV cache (`--kv-cache-dtype fp8`) holds e4m3 values divided by a per-tensor scale.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# The checks run on every launch, eager steps launch hundreds of kernels, and a message is an
# f-string built before `require` is called: each check tests first and words its error only on
# failure.
def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if (isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in FLOAT_DTYPES
            and (t.stride(-1) == 1 or t.numel() == 0)):
        return
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    require(t.dtype in FLOAT_DTYPES, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_index(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in dtypes and (t.stride(-1) == 1 or t.numel() == 0):
        return
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    require(t.dim() == ndim, f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    require(t.dtype in dtypes, f"{name} must be {names}, got {t.dtype}")
    raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every element of `t` must lie in [low, high); reads the tensor's extremes back."""
    if t.numel() == 0:
        return
    lo, hi = torch.stack([t.min(), t.max()]).tolist()
    require(low <= lo and hi < high, f"{name} values must lie in [{low}, {high}), found range [{lo}, {hi}]")


def check_kv_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the layout fixed by corectl.attention; returns (num_blocks, block_size, kv_heads, head_dim).
    The cache may be FP8 (e4m3) whatever the model's dtype."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == FP8_KV_DTYPE:
        require(kv_cache.dim() == 5, f"kv_cache must have 5 dimensions, got shape {tuple(kv_cache.shape)}")
        require(kv_cache.stride(-1) == 1, f"kv_cache must be contiguous in its last dimension, got {kv_cache.stride()}")
    else:
        check_float("kv_cache", kv_cache, 5)
    require(kv_cache.shape[0] == 2,
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    require(kv_cache.stride(3) == head_dim,
            f"kv_cache heads must be packed (stride {head_dim} between heads), got strides {kv_cache.stride()}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_packed_heads(name: str, t: torch.Tensor, num_tokens: int, num_heads: int, head_dim: int) -> None:
    """`t` is [num_tokens, num_heads * head_dim] with rows at any stride (e.g. a slice of a qkv output)."""
    check_float(name, t, 2)
    expected = (num_tokens, num_heads * head_dim)
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must be [num_tokens, num_heads * head_dim] = {list(expected)}, got {list(t.shape)}")


def attention_output(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The attention kernels' output: a new tensor shaped like q, or a caller's `out` checked to match."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not (out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1):
        raise ValueError(f"out must be {q.dtype} of shape {tuple(q.shape)}, contiguous in its last dimension; "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    return out


def check_window_and_cap(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """A layer's window is a positive number of tokens and its soft cap a positive scale (None: off)."""
    require(sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1),
            f"sliding_window must be a positive number of tokens or None, got {sliding_window!r}")
    require(logits_soft_cap is None or logits_soft_cap > 0,
            f"logits_soft_cap must be positive or None, got {logits_soft_cap!r}")


def check_cache_dtype(name: str, t: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Activations and cache share a dtype, unless the cache is FP8 (the kernels convert)."""
    require(kv_cache.dtype in (t.dtype, FP8_KV_DTYPE),
            f"{name} and kv_cache must share a dtype (or the cache be {FP8_KV_DTYPE}), "
            f"got {t.dtype} and {kv_cache.dtype}")


def check_kv_scales(k_scale: float, v_scale: float) -> None:
    require(k_scale > 0 and v_scale > 0, f"k_scale and v_scale must be positive, got {k_scale} and {v_scale}")
