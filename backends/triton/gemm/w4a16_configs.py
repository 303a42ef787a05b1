"""Launch configurations of the 4-bit GEMM (`w4a16.py`): a table keyed by (M bucket, N, K) that
`python -m corectl.backends.triton.bench.w4a16` fills, and a heuristic for shapes it lacks.

Decode (M <= 16) reads the weight once per call, so it is a bandwidth problem: it needs wide
contiguous rows of packed words (BLOCK_N), enough programs to cover every SM several times
(SPLIT_K slices of K for a 4096-wide layer that has only 16-32 column tiles) and little ALU work
per weight (the GEMV form for M = 1). Prefill is tensor-core work and keeps tl.dot tiles.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Decode batches are padded by CUDA graphs to 1, 2, 4, 8, 16; prefill chunks are larger.
M_BUCKETS = (1, 4, 16, 64, 512)
# At most this many K slices: each adds a [M, N] fp32 partial to write and sum.
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class W4Config:
    """One launch: tiles of [block_m, block_n] outputs, K walked in block_k steps in each of
    split_k slices; gemv (block_m 1: one program per row, meant for M = 1) accumulates broadcast
    products in fp32 instead of tl.dot."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 2
    gemv: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_k < 16 or self.split_k < 1 or (self.gemv and self.block_m != 1):
            raise ValueError(f"invalid w4a16 config {self}: block_k >= 16, split_k >= 1, gemv only with block_m 1")
        if not self.gemv and self.block_m < 16:
            raise ValueError(f"tl.dot tiles need block_m >= 16, got {self}")


# (M bucket, N, K) -> config, from the H100 sweep of bench.w4a16 --quick (2026-11-25, triton 3.6;
# llama3-8b shapes, group 128); the M = 1 entries re-picked by an A/B script (since removed) on 2026-11-26 once
# words were column tiles and each code one LOP3 (weights cycled past L2, PDL on: qkv 8.7, o 7.0,
# gate_up 26.9, down 16.7 us, 59.2 a layer against 72.4 before). Other shapes take the heuristic.
TABLE: dict[tuple[int, int, int], W4Config] = {
    (1, 6144, 4096): W4Config(block_m=1, block_n=16, block_k=512, split_k=1, num_warps=4, num_stages=2, gemv=True),
    (16, 6144, 4096): W4Config(block_m=16, block_n=128, block_k=64, split_k=8, num_warps=4, num_stages=2, gemv=False),
    (1, 4096, 4096): W4Config(block_m=1, block_n=16, block_k=512, split_k=4, num_warps=4, num_stages=2, gemv=True),
    (16, 4096, 4096): W4Config(block_m=16, block_n=128, block_k=64, split_k=16, num_warps=4, num_stages=2, gemv=False),
    (1, 28672, 4096): W4Config(block_m=1, block_n=16, block_k=512, split_k=1, num_warps=4, num_stages=2, gemv=True),
    (16, 28672, 4096): W4Config(block_m=16, block_n=128, block_k=64, split_k=4, num_warps=4, num_stages=2, gemv=False),
    (1, 4096, 14336): W4Config(block_m=1, block_n=16, block_k=512, split_k=4, num_warps=4, num_stages=2, gemv=True),
    (16, 4096, 14336): W4Config(block_m=16, block_n=128, block_k=64, split_k=16, num_warps=4, num_stages=2, gemv=False),
}


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a host-side query, cached: no sync inside graphs);
    the H100's 132 for the CPU interpreter, so tests exercise realistic split counts."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def heuristic(m: int, n: int, k: int, sms: int, gathered: bool = False) -> W4Config:
    """Decode: GEMV (M = 1) or 16-row dot tiles, K split until the grid covers the SMs about four
    times; prefill: 64-row dot tiles, split only when the grid is smaller than the SMs. Gathered
    (act-order) tiles are smaller: their per-input scale gathers need registers (sm_90 ptxas:
    these sizes compile without spills). The contiguous-group GEMV streams 16-column slices (one
    tile of int4.tile_words each) in 512-input blocks, K split until there are four programs per
    SM: the H100 sweep's best form on every llama3-8b layer."""
    if m == 1 and not gathered:
        block_n, block_k = 16, 512
        tiles, split = -(-n // block_n), 1
        while split * 2 <= MAX_SPLIT_K and tiles * split < 4 * sms and k // (split * 2) >= 2 * block_k:
            split *= 2
        return W4Config(1, block_n, block_k, split, 4, gemv=True)
    if m == 1:
        cfg, waves = W4Config(1, 128, 32, 1, 4, gemv=True), 4
    elif m <= 16:
        cfg, waves = W4Config(16, 128, 64, 1, 4), 4
    else:
        cfg, waves = W4Config(64, 128, 32, 1, 4, 3) if gathered else W4Config(64, 128, 64, 1, 8, 3), 1
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split = 1
    while split * 2 <= MAX_SPLIT_K and tiles * split < waves * sms and k // (split * 2) >= 2 * cfg.block_k:
        split *= 2
    return W4Config(cfg.block_m, cfg.block_n, cfg.block_k, split, cfg.num_warps, cfg.num_stages, cfg.gemv)


def choose(m: int, n: int, k: int, device: torch.device, gathered: bool = False) -> W4Config:
    """The table's entry for contiguous groups (the measured case), else the heuristic."""
    cfg = None if gathered else TABLE.get((m_bucket(m), n, k))
    return cfg or heuristic(m, n, k, sm_count(device), gathered)
