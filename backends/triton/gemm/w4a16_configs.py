"""Launch configurations of the 4-bit GEMM (`w4a16.py`): a rule of the problem size (M, N, K, the
SM count), read off the sweeps of `python -m corectl.backends.triton.bench.w4a16` on llama3-8b's layers.

Decode (M <= 16) reads the weight once per call, so it is a bandwidth problem: it needs wide
contiguous rows of packed words (BLOCK_N), enough programs to cover every SM several times
(SPLIT_K slices of K for a 4096-wide layer that has only 16-32 column tiles) and little ALU work
per weight (the GEMV form for M = 1). Prefill is tensor-core work and keeps tl.dot tiles.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

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
    tile of int4.tile_words each) in 512-input blocks; a grid of two programs an SM or more runs
    unsplit (the split's partials and second launch cost more than the fuller grid gains), a smaller
    one splits K until there are four programs per SM. This gives the H100 sweep's best launches on
    llama3-8b's layers (2026-11-25/26, group 128: M = 1 qkv 6144x4096 unsplit, o and down split in
    four, gate_up unsplit; M = 5-16 16 x 128 x 64 tiles, o and down split 16, gate_up 4 and qkv 16
    where the sweep's 8 was within its spread)."""
    if m == 1 and not gathered:
        block_n, block_k = 16, 512
        tiles, split = -(-n // block_n), 1
        if tiles < 2 * sms:
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
    """The rule's launch for this problem on `device`'s SMs."""
    return heuristic(m, n, k, sm_count(device), gathered)
