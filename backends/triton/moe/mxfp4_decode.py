"""Pieces the MXFP4 MoE paths share (`mxfp4_moe.py`'s module doc): the packed stack, the activations'
shift, gpt-oss's clamped SwiGLU, and the pairs path's decode of packed int32 words of e2m1 codes to
their fp32 values by PTX byte permutes (with the same steps in Triton for the interpreter).

A word holds 8 codes, input 8w + j in nibble j (low nibble of a byte first); a code's fp32 is the
subnormal 16 |value| * 2^-133 with the code's sign, so |value| * 2^-129 exactly.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

GROUP = 32


class Mxfp4Stack(NamedTuple):
    """One packed projection of a layer's experts: blocks [E, N, K / 32, 16], scales [E, N, K / 32]
    (uint8 both), bias [E, N]."""

    blocks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor


# What the activations are multiplied by, so products with decoded (tiny) codes stay normal fp32
# (mxfp4_moe.py's module doc).
X_SHIFT = tl.constexpr(2.0 ** 64)


@triton.jit
def clamped_swiglu(gate, up, alpha, limit):
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1) * (gate * tl.sigmoid(gate * alpha))


def strides(stack: Mxfp4Stack) -> tuple[int, ...]:
    """Expert and row strides of the blocks (in bytes) and scales, and the bias's expert stride."""
    blocks, scales, bias = stack
    return blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1), bias.stride(0)


# e2m1 magnitude -> 16 |value|, a byte each, looked up four codes at a time by one byte permute of
# this table (bytes 0-7 of LUT_HI:LUT_LO).
_LUT = (0x18100800, 0x60403020)
LUT_LO, LUT_HI = tl.constexpr(_LUT[0]), tl.constexpr(_LUT[1])
# One packed word ($8) -> its 8 codes' fp32 ($0-$7): magnitudes looked up (k_lo: codes 0-3, k_hi:
# 4-7), sign bytes of the even codes (se: each byte's low-nibble sign at its msb) and odd ones (so),
# then a permute a code: byte 3 its sign byte (sources 4-7), byte 2 its looked-up byte (0-3), bytes
# 0-1 that byte's sign replicated (selector msb; 0, magnitudes being under 128).
DECODE_PTX = tl.constexpr(f"""{{
.reg .b32 m, mh, klo, khi, so, se, w4, tlo, thi;
mov.b32 tlo, {_LUT[0]:#x};
mov.b32 thi, {_LUT[1]:#x};
and.b32 m, $8, 0x77777777;
prmt.b32 klo, tlo, thi, m;
shr.u32 mh, m, 16;
prmt.b32 khi, tlo, thi, mh;
and.b32 so, $8, 0x80808080;
shl.b32 w4, $8, 4;
and.b32 se, w4, 0x80808080;
prmt.b32 $0, klo, se, 0x4088;
prmt.b32 $1, klo, so, 0x4199;
prmt.b32 $2, klo, se, 0x52aa;
prmt.b32 $3, klo, so, 0x53bb;
prmt.b32 $4, khi, se, 0x6088;
prmt.b32 $5, khi, so, 0x6199;
prmt.b32 $6, khi, se, 0x72aa;
prmt.b32 $7, khi, so, 0x73bb;
}}""")


@triton.jit
def _prmt(a, b, SELECT: tl.constexpr):
    """PTX's `prmt.b32 d, a, b, SELECT` (generic mode: a selector's msb replicates the picked
    byte's sign) on int32 tensors, for the interpreter, which runs no PTX."""
    out = tl.zeros_like(a)
    for n in tl.static_range(4):
        if (SELECT >> (4 * n)) & 7 < 4:
            byte = (a >> (8 * ((SELECT >> (4 * n)) & 3))) & 0xFF
        else:
            byte = (b >> (8 * ((SELECT >> (4 * n)) & 3))) & 0xFF
        if (SELECT >> (4 * n)) & 8:
            byte = tl.where(byte >= 128, 0xFF, 0)
        out |= byte << (8 * n)
    return out


@triton.jit
def _lookup(magnitudes):
    """DECODE_PTX's table permute for the interpreter: the selectors are the low four codes."""
    out = tl.zeros_like(magnitudes)
    for n in tl.static_range(4):
        index = (magnitudes >> (4 * n)) & 7
        out |= ((tl.where(index < 4, LUT_LO, LUT_HI) >> (8 * (index & 3))) & 0xFF) << (8 * n)
    return out


@triton.jit
def decode_words(words, NATIVE: tl.constexpr):
    """The 8 codes of each packed word (input 8w + j in nibble j) as fp32: the subnormal
    16 |value| * 2^-133 with the code's sign (DECODE_PTX, or its steps for the interpreter)."""
    if NATIVE:
        return tl.inline_asm_elementwise(DECODE_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)
    magnitudes = words & 0x77777777
    k_lo, k_hi = _lookup(magnitudes), _lookup(magnitudes >> 16)
    se, so = (words << 4) & -0x7F7F7F80, words & -0x7F7F7F80
    return (_prmt(k_lo, se, 0x4088).to(tl.float32, bitcast=True), _prmt(k_lo, so, 0x4199).to(tl.float32, bitcast=True),
            _prmt(k_lo, se, 0x52AA).to(tl.float32, bitcast=True), _prmt(k_lo, so, 0x53BB).to(tl.float32, bitcast=True),
            _prmt(k_hi, se, 0x6088).to(tl.float32, bitcast=True), _prmt(k_hi, so, 0x6199).to(tl.float32, bitcast=True),
            _prmt(k_hi, se, 0x72AA).to(tl.float32, bitcast=True), _prmt(k_hi, so, 0x73BB).to(tl.float32, bitcast=True))
