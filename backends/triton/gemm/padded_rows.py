"""Row counts at which cuBLAS's GEMM choice is slow, found by timing while CUDA graphs are captured.

cuBLAS picks its kernel by a heuristic of (M, N, K). At some row counts the pick is poor: on an H100
a speculative verify step's 320 rows (64 requests x 5) of Llama 3 8B's qkv projection (6144 x 4096)
take 0.038 ms, 384 rows 0.029 ms (W11, docs/speculative.md), 0.3 ms of a 12 ms step over 32 layers.
Which counts suffer depends on the GPU, the library and the shape, so there is no table: while the
graphs are captured (`tuning()` around each capture's eager warm-up), every unquantized GEMM that
cuBLAS runs is timed at its own row count and padded with zero rows up to the next multiples of 64
and 128, and a padded count is kept where it wins by a clear margin. Graph replays and eager steps
of those row counts then run it; any other row count runs as it is, since timing a live eager step
would stall it. Zero rows add work but change no real row's result beyond cuBLAS's own choice of
kernel, which already varies with M.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from corectl import envs
from torch.nn import functional as F

# A padded count must beat the row count's own time by this factor: timing noise is a few percent,
# and a padded count does more work on a busier GPU than the idle one it was timed on.
MARGIN = 0.9
ALIGNMENTS = (64, 128)
_TIMED_RUNS = 20
_ROUNDS = 3
logger = logging.getLogger("corectl.triton")

# (rows, N, K, dtype, bias?, device index) -> the row count to run: one per process, filled only
# inside `tuning()`, read by every GEMM of a row count that cuBLAS runs.
_decisions: dict[tuple, int] = {}
_tuning = False


@contextlib.contextmanager
def tuning() -> Iterator[None]:
    """Time the row counts of the GEMMs run inside (eagerly, outside a graph capture)."""
    global _tuning
    previous, _tuning = _tuning, envs.gemm_row_padding_enabled()
    try:
        yield
    finally:
        _tuning = previous


def candidates(m: int) -> list[int]:
    """`m` and the distinct next multiples of ALIGNMENTS above it."""
    return sorted({m, *(-(-m // a) * a for a in ALIGNMENTS)})


def choose(times: dict[int, float]) -> int:
    """The row count to run, given each candidate's time (the smallest count is the real one)."""
    rows = min(times)
    best = min(times, key=times.get)
    return best if times[best] < MARGIN * times[rows] else rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ weight.T + bias by cuBLAS on zero-padded rows where a capture's timing chose that, else None
    (the caller runs F.linear): a CUDA 2-D input with no decision and no tuning open takes nothing."""
    m = x.shape[0]
    key = (m, weight.shape[0], weight.shape[1], x.dtype, bias is not None, x.device.index)
    rows = _decisions.get(key)
    if rows is None:
        counts = candidates(m)
        if not _tuning or torch.cuda.is_current_stream_capturing() or len(counts) == 1:
            return None
        times = _times(x, weight, bias, counts)
        rows = _decisions[key] = choose(times)
        if rows != m:
            logger.info("GEMM of %d x %d weights: %d rows run padded to %d (%.4f ms against %.4f)",
                        *weight.shape, m, rows, times[rows], times[m])
    if rows == m:
        return None
    return F.linear(F.pad(x, (0, 0, 0, rows - m)), weight, bias)[:m]


def _times(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: list[int]) -> dict[int, float]:
    # Each candidate's best of three rounds, the candidates interleaved within a round so that clock
    # and power drift fall on all of them alike; a warm-up run before each (a shape's first call sets
    # up cuBLAS).
    operands = {rows: torch.randn(rows, x.shape[1], dtype=x.dtype, device=x.device) for rows in counts}
    best = dict.fromkeys(operands, float("inf"))
    for _ in range(_ROUNDS):
        for rows, a in operands.items():
            F.linear(a, weight, bias)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(_TIMED_RUNS):
                F.linear(a, weight, bias)
            end.record()
            end.synchronize()
            best[rows] = min(best[rows], start.elapsed_time(end) / _TIMED_RUNS)
    return best
