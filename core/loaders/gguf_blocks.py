"""GGUF's block formats as groups of affine integer codes: w = code * scale + min.

Q4_0 (w = (q - 8) d), Q4_1 (w = q d + m) and Q4_K (eight 32-value sub-blocks per 256, each with
its own 6-bit scale and min: w = d sc q - dmin m) are groups of 32 int4 codes (`Int4Groups`),
what torch's packed int4 GEMMs compute with (`(q - 8) * scale + zero` per group of inputs).
Q8_0 (w = q d, 32 int8 codes) and Q6_K (sixteen 16-value sub-blocks per 256 with int8 scales:
w = d sc (q - 32)) are groups of int8 codes (`Int8Groups`, 32 or 16 inputs), which the int4
formats also fit when a packed layer mixes them. Other types (Q5_*, Q2_K, ...) are dequantized at
load instead.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf.quants import Q4_K

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# int8 group formats and their group size; a layer of several takes the smallest.
INT8_GROUPS = {"Q8_0": 32, "Q6_K": 16, **{name: GROUP for name in INT4_TYPES}}
# Types whose minimum is zero as int8 groups (Q4_0's codes are stored as q - 8).
SYMMETRIC = ("Q8_0", "Q6_K", "Q4_0")


class Int4Groups(NamedTuple):
    """A weight [N, K] as codes (uint8 in [0, 16)), with per-32-input scale and min [N, K / 32]."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return dequantize_groups(self.codes, self.scales, self.mins, GROUP)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """fp32 weight [N, K] from codes [N, K] and a scale and min (None: 0) per `group` inputs [N, K / group]."""
    weight = codes.float() * scales.float().repeat_interleave(group, dim=1)
    if mins is not None:
        weight += mins.float().repeat_interleave(group, dim=1)
    return weight


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


class Int8Groups(NamedTuple):
    """A weight [N, K] as int8 codes, with per-`group`-input scale and min [N, K / group] (fp32)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor


def decode_int8_groups(type_name: str, rows: np.ndarray, group: int) -> Int8Groups:
    """Decode the blocks of a 2-D GGUF tensor of `type_name` as int8 groups of `group` inputs (at
    most the type's own group, which it then repeats)."""
    n = rows.shape[0]
    if type_name == "Q8_0":
        blocks = rows.reshape(-1, 34)
        codes, scales = blocks[:, 2:].copy().view(np.int8), blocks[:, :2].copy().view(np.float16).astype(np.float32)
        mins = np.zeros_like(scales)
    elif type_name == "Q6_K":
        codes, scales = _q6_k(rows.reshape(-1, 210))
        mins = np.zeros_like(scales)
    elif type_name in INT4_TYPES:
        int4 = decode_int4_groups(type_name, rows)
        codes, scales, mins = int4.codes.numpy().astype(np.int8), int4.scales.numpy(), int4.mins.numpy()
        if type_name == "Q4_0":
            codes, mins = codes - np.int8(8), np.zeros_like(mins)
    else:
        raise ValueError(f"GGUF type {type_name} is not an int8 group format ({', '.join(INT8_GROUPS)})")
    repeat = INT8_GROUPS[type_name] // group
    if repeat < 1 or INT8_GROUPS[type_name] % group:
        raise ValueError(f"{type_name} groups of {INT8_GROUPS[type_name]} do not split into groups of {group}")
    as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))  # noqa: E731
    return Int8Groups(as_rows(codes), as_rows(np.repeat(scales.reshape(n, -1), repeat, axis=1)),
                      as_rows(np.repeat(mins.reshape(n, -1), repeat, axis=1)))


def _q6_k(blocks: np.ndarray):
    """Codes q - 32 (int8) and scales d sc per 16 values of Q6_K blocks: 128 bytes of low nibbles,
    64 of high bit pairs, 16 int8 scales, then d (fp16)."""
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    # Each 128-value half: 64 bytes of low nibbles (values 0-63 low, 64-127 high nibble) and 32
    # bytes of high bits (values j, j+32, j+64, j+96 at bit pairs 0, 2, 4, 6 of byte j).
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = low.reshape(-1, 2, 128) | (high.reshape(-1, 2, 128) << 4)
    return (q.reshape(-1, 256).astype(np.int16) - 32).astype(np.int8), (d * sc).reshape(-1)
