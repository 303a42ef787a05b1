"""Launch knobs of the LoRA kernels on sorted tiles, picked from the tiles' row count.

A decode step has few tiles (W10: 256 tokens of 8 adapters are 16 to 24 tiles of 16 rows): the
shrink splits its reduction over the input features to fill the GPU, and each expand program covers
several output blocks, loading its tile's partial sums of every split once. A prefill or mixed
step's tiles are long (64 rows and up, 130 and more of them in an 8,192-token step): the shrink
needs fewer splits for as many programs, and the expand's output read-modify-write is the traffic
to spread. `benchmarks/lora_bench.py` times the candidates (`CANDIDATES`) on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from corectl.envs import lora_knobs


@dataclass(frozen=True)
class SortedConfig:
    """shrink_programs: programs a shrink aims for (input splits make up the difference);
    shrink_splits: the most splits (each expand program loads every split's partial sums of its
    tile); expand_programs: programs an expand aims for (each covers its tile's output blocks in
    turn); block_n: the expand's output columns a step of that loop."""

    shrink_programs: int
    shrink_splits: int
    expand_programs: int
    block_n: int = 64


# Tiles of up to 32 rows (decode steps), and longer ones (prefill and mixed steps);
# CORECTL_LORA_DECODE_KNOBS / CORECTL_LORA_PREFILL_KNOBS replace them for a measurement.
DECODE = SortedConfig(*(lora_knobs("decode") or (192, 8, 1024)))
PREFILL = SortedConfig(*(lora_knobs("prefill") or (1024, 8, 2048)))
# What benchmarks/lora_bench.py times: the default first, then one knob moved at a time.
CANDIDATES = {kind: list(dict.fromkeys(configs)) for kind, configs in {
    "decode": [DECODE, SortedConfig(192, 8, 1024), SortedConfig(96, 8, 1024), SortedConfig(384, 8, 1024),
               SortedConfig(192, 4, 1024), SortedConfig(192, 16, 1024), SortedConfig(192, 8, 512),
               SortedConfig(192, 8, 2048), SortedConfig(192, 8, 1024, 128)],
    "prefill": [PREFILL, SortedConfig(1024, 8, 2048), SortedConfig(512, 8, 2048), SortedConfig(2048, 8, 2048),
                SortedConfig(1024, 2, 2048), SortedConfig(1024, 8, 1024), SortedConfig(1024, 8, 4096),
                SortedConfig(1024, 8, 8192), SortedConfig(1024, 8, 2048, 128)],
}.items()}


def sorted_config(block_m: int) -> SortedConfig:
    """The knobs for tiles of `block_m` rows."""
    return DECODE if block_m <= 32 else PREFILL


def warps_for(block_m: int) -> int:
    """Warps of a program on a tile of `block_m` rows: 128-row tiles hold twice the registers."""
    return 8 if block_m >= 128 else 4
