"""GGUF's 4-bit block formats as groups of 32 affine int4 values: w = code * scale + min.

Q4_0 (w = (q - 8) d), Q4_1 (w = q d + m) and Q4_K (eight 32-value sub-blocks per 256, each with
its own 6-bit scale and min: w = d sc q - dmin m) all fit this form exactly, which is what
torch's packed int4 GEMMs compute with (`(q - 8) * scale + zero` per group of inputs). Other
types (Q5_*, Q6_K, Q8_0, ...) are dequantized at load instead.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf.quants import Q4_K

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


class Int4Groups(NamedTuple):
    """A weight [N, K] as codes (uint8 in [0, 16)), with per-32-input scale and min [N, K / 32]."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        expand = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
        return self.codes.float() * expand(self.scales) + expand(self.mins)


def decode_int4_groups(type_name: str, rows: np.ndarray) -> Int4Groups:
    """Decode the blocks of a 2-D GGUF tensor (`rows`: uint8 [N, bytes per row]) of `type_name`."""
    n = rows.shape[0]
    if type_name == "Q4_K":
        codes, scales, mins = _q4_k(rows.reshape(-1, 144))
    elif type_name in ("Q4_0", "Q4_1"):
        codes, scales, mins = _q4_0_1(rows.reshape(-1, 18 if type_name == "Q4_0" else 20), type_name)
    else:
        raise ValueError(f"GGUF type {type_name} is not an int4 group format ({', '.join(INT4_TYPES)})")
    return Int4Groups(torch.from_numpy(codes.reshape(n, -1)), torch.from_numpy(scales.reshape(n, -1)),
                      torch.from_numpy(mins.reshape(n, -1)))


def _q4_0_1(blocks: np.ndarray, type_name: str):
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if type_name == "Q4_0":
        m, qs = -8.0 * d, blocks[:, 2:]
    else:
        m, qs = blocks[:, 2:4].copy().view(np.float16).astype(np.float32), blocks[:, 4:]
    # Element j of a block is the low nibble of byte j (j < 16), else the high nibble of byte j - 16.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return codes, d[:, 0], m[:, 0]


def _q4_k(blocks: np.ndarray):
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    # Each 32-byte chunk holds two sub-blocks: low nibbles first, then high nibbles.
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(-1, 8 * 32)
    return codes, (d * sc.astype(np.float32)).reshape(-1), (-dmin * m.astype(np.float32)).reshape(-1)
