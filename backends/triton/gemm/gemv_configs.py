"""Launch configs of the decode GEMV (`fp8_gemv`) as a rule of the problem size, not a table of shapes.

A decode GEMV reads its weight once, so what matters is bytes in flight per SM: enough programs to
cover the SMs, each streaming long contiguous runs of its rows. The rule was read off the H100 sweeps
of `python -m corectl.backends.triton.bench.fp8` (2026-11-25/26, triton 3.6: llama3-8b's and
qwen3-0.6b's projections and LM heads, every candidate config against F.linear) and returns their
winners on those shapes (tests/backends/triton/test_gemv_configs.py keeps the sweep's record), so
those models decode with the launches they were measured with; any other shape gets the same
reasoning applied to its own N, K and SM count instead of cuBLAS:

- M = 1, the CUDA-core GEMV: 8 output rows x 512 inputs a step (8 KB of bf16, 4 warps). Short rows
  (fewer than four steps) trade K for N while the grid stays under 16 programs an SM, so each
  program still walks several steps; long bf16 rows (K >= 4096) over a grid of at least 8 programs an
  SM of 16-row slices, and FP8 rows of 8 KB or more, take 16 x 1024 tiles with 8 warps (four times
  the bytes a step). K is split only when the grid would leave more than half the SMs idle.
- M = 2..8, one 16-row tensor-core tile: F.linear (cuBLAS) caught up with the GEMV on the
  projections (within 1-7%), except where the GEMV's grid is shaped better than cuBLAS's: the LM
  heads (N >= 16 K: 8,192 elements a tile step) and plain layers of long rows (K >= 4096) with fewer
  64-column tiles than half the SMs (K split in up to four so the grid covers the SMs twice). The gated
  form (silu(gate) * up on load) keeps F.linear there: every column slice recomputes the activation.
- FP8 weights always take the GEMV up to MAX_M rows (it beats the W8A8 GEMM there): M = 1 as above,
  larger M 16 x 64 x 128 tiles with K split in up to four until the grid covers the SMs twice.

`--batch-invariant` does not come here: its GEMM has one fixed launch (`invariant.py`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from .w4a16_configs import sm_count

MAX_M = 8
DOT_M = 16  # the smallest tl.dot tile
MAX_SPLIT_K = 4


class GemvConfig(NamedTuple):
    # Rows per program: 1 (the CUDA-core GEMV, M = 1 only) or 16 (one tensor-core tile).
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    # Loads issued ahead along K (the loop has no tl.dot at M = 1, so Triton pipelines its loads
    # only when the loop asks): bytes in flight per SM are what reach HBM bandwidth.
    num_stages: int


def device_sms(device: torch.device | None) -> int:
    """SMs of `device`; None: the current CUDA device where there is one (the interpreter: an H100's)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return sm_count(device)


def _split(tiles: int, k: int, block_k: int, target: int) -> int:
    """Powers of two up to MAX_SPLIT_K while the grid has fewer than `target` programs and each slice
    keeps two BLOCK_K steps."""
    split = 1
    while split < MAX_SPLIT_K and tiles * split < target and k >= 2 * (2 * split) * block_k:
        split *= 2
    return split


def _gemv(n: int, k: int, sms: int, wide: bool) -> GemvConfig:
    """M = 1: the CUDA-core GEMV (module doc); `wide`: the 16 x 1024, 8-warp tile."""
    if wide:
        block_n, block_k, warps = 16, 1024, 8
    else:
        block_n, block_k, warps = 8, 512, 4
        while k < 4 * block_k and block_k > 128 and triton.cdiv(n, 2 * block_n) < 16 * sms:
            block_n, block_k = 2 * block_n, block_k // 2
    split = 1
    if triton.cdiv(n, block_n) < sms // 2:
        split = _split(triton.cdiv(n, block_n), k, block_k, sms)
    return GemvConfig(1, block_n, block_k, split, warps, 3)


def _dot(n: int, k: int, sms: int) -> GemvConfig:
    """M > 1: 16 x 64 x 128 tensor-core tiles, K split until the grid covers the SMs twice."""
    return GemvConfig(DOT_M, 64, 128, _split(triton.cdiv(n, 64), k, 128, 2 * sms), 4, 3)


@functools.lru_cache(maxsize=None)
def _dense(m_bucket: int, n: int, k: int, gated: bool, sms: int) -> GemvConfig | None:
    if m_bucket == 1:
        return _gemv(n, k, sms, wide=k >= 4096 and triton.cdiv(n, 16) >= 8 * sms)
    if n >= 16 * k:
        block_k = max(16, min(512, 1 << (max(k // 8, 1).bit_length() - 1)))
        return GemvConfig(DOT_M, max(DOT_M, 8192 // block_k), block_k, 1, 4, 3)
    if not gated and k >= 4096 and triton.cdiv(n, 64) < sms // 2:
        return _dot(n, k, sms)
    return None


def bucket(m: int) -> int:
    """The power-of-two batch bucket CUDA graphs pad a decode step to."""
    return 1 << (m - 1).bit_length()


def dense_decode_config(m: int, n: int, k: int, gated: bool = False,
                        device: torch.device | None = None) -> GemvConfig | None:
    """The dense (16-bit weight) GEMV's config for an [M, K] x [N, K] layer (`gated`: its input is
    [M, 2K] gate | up), or None where F.linear is the faster choice (module doc)."""
    if not 1 <= m <= MAX_M:
        return None
    return _dense(bucket(m), n, k, gated, device_sms(device))


@functools.lru_cache(maxsize=None)
def _fp8(m_bucket: int, n: int, k: int, sms: int) -> GemvConfig:
    return _gemv(n, k, sms, wide=k >= 8192) if m_bucket == 1 else _dot(n, k, sms)


def fp8_decode_config(m: int, n: int, k: int, device: torch.device | None = None) -> GemvConfig:
    """The FP8-weight GEMV's config for M <= MAX_M rows (module doc)."""
    return _fp8(bucket(max(m, 1)), n, k, device_sms(device))


def small_n_config(m: int, n: int, k: int, device: torch.device | None = None) -> GemvConfig:
    """A router's few output rows: at M = 1 one launch without split-K, column slices narrowed
    (down to 2 rows) until the grid has a program per SM (a split adds a second launch to a
    call that is mostly launch latency); larger M the tensor-core tile."""
    sms = device_sms(device)
    if m != 1:
        return _dot(n, k, sms)
    block_n = 16
    while block_n > 2 and triton.cdiv(n, block_n) < sms:
        block_n //= 2
    return GemvConfig(1, block_n, min(512, triton.next_power_of_2(k)), 1, num_warps=4, num_stages=3)
