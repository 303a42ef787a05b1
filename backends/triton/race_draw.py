"""The exponential race in one pass: token = argmax_i(logit_i - log q_i), q_i ~ Exp(1), per row.

The sampler's torch form (`corectl.sample.random_sampling`) makes the noise in its own tensor and
passes over the vocabulary five times more (uniform, log, negate, log, subtract) before the argmax:
at 256 rows of a 152k vocabulary that is ~1.9 GB of traffic a decode step, about 5% of W4's device
time on an H100. Here each program draws its random words with Philox as it reads its slice of a row's
logits once, keeps the best score and its id, and a second pass over the [rows, splits] partial
maxima picks each row's winner; the logits are left as they were.

Randomness: one 62-bit seed a call, drawn on the device from torch's generator (so no host sync,
and CUDA graphs replay a fresh one each time); row r's random words come from Philox keyed by
seed + r, four to a counter, and each becomes an exponential accurate in the small values that
decide a light token's chance (`_exponential`).
Rows with a generator of their own (seeded requests) are the sampler's to redraw.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_float, require

_BLOCK = 1024
# A program's share of a row (`_split_size`): slices of 4k-16k columns give the device about
# `_TARGET_PROGRAMS` programs and keep the partial maxima few.
_MIN_SPLIT = 4096
_MAX_SPLIT = 16384
_TARGET_PROGRAMS = 1024


@triton.jit
def _exponential(bits):
    """q ~ Exp(1) from 32 random bits, exact where it decides a race: q = -log(1 - w) for w
    uniform in (0, 1), by its series where w is small. A light token wins only by a tiny q (at
    p = 1e-7 against a favourite's 0.4, q under ~3e-7), which -log(u) of an fp32 u cannot give:
    u's last steps below 1 are 6e-8 apart, and those few values would decide such tokens' share."""
    w = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    series = w * (1.0 + w * (0.5 + w * (0.3333333333 + w * 0.25)))
    # The top words round w to 1 in fp32: their 1 - w is the half step the +0.5 stands for.
    return tl.where(w < 0.01, series, -tl.log(tl.maximum(1.0 - w, 1.1641532182693481e-10)))


@triton.jit
def _compete(best, index, base, cols, vocab, bits):
    """Fold one block of columns into the running best: score = logit - log q."""
    logit = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
    score = logit - tl.log(_exponential(bits))
    # `>` keeps the first of equal scores (a lane sees its columns in order) and never takes a NaN.
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, index)


# Sizes are not specialized on, so one compile serves every batch and vocabulary.
@triton.jit(do_not_specialize=["stride", "vocab", "num_splits", "split_size"])
def _race_kernel(logits_ptr, seed_ptr, best_ptr, index_ptr, stride, vocab, num_splits, split_size,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    seed = tl.load(seed_ptr) + row
    start = split * split_size
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    index = tl.full([QUARTER], 0, tl.int32) + start
    base = logits_ptr + row.to(tl.int64) * stride
    for offset in range(start, tl.minimum(start + split_size, vocab), BLOCK):
        # One Philox call gives four random words: one for each quarter of the block's columns.
        r0, r1, r2, r3 = tl.randint4x(seed, offset // 4 + lanes)
        best, index = _compete(best, index, base, offset + lanes, vocab, r0)
        best, index = _compete(best, index, base, offset + QUARTER + lanes, vocab, r1)
        best, index = _compete(best, index, base, offset + 2 * QUARTER + lanes, vocab, r2)
        best, index = _compete(best, index, base, offset + 3 * QUARTER + lanes, vocab, r3)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, index, vocab), axis=0)
    first = tl.where(first == vocab, start, first)
    tl.store(best_ptr + row * num_splits + split, top)
    tl.store(index_ptr + row * num_splits + split, first.to(tl.int64))


def _split_size(num_rows: int, vocab: int) -> int:
    """Columns a program reads: the vocabulary over enough programs to fill the device, in whole
    blocks (a program streams its slice block by block, waiting on each load: a whole 152k row in one
    program would take ~150 such waits)."""
    per_row = max(1, _TARGET_PROGRAMS // max(1, num_rows))
    split = triton.cdiv(triton.cdiv(vocab, per_row), _BLOCK) * _BLOCK
    return min(max(split, _MIN_SPLIT), _MAX_SPLIT)


def race_draw(logits: torch.Tensor) -> torch.Tensor:
    """One token id per row of fp32 `logits` [B, V], drawn with probability softmax(logits row):
    the exponential race, argmax(logit - log q) with q ~ Exp(1). A -inf logit never wins while a
    finite one is left. Returns int64 [B]; `logits` is not modified."""
    check_float("logits", logits, 2)
    require(logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}")
    require(logits.stride(1) == 1, "logits rows must be contiguous")
    num_rows, vocab = logits.shape
    require(0 < vocab < 2 ** 31, f"vocabulary of {vocab} ids is out of range")
    split = _split_size(num_rows, vocab)
    num_splits = triton.cdiv(vocab, split)
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=logits.device)
    best = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(num_rows, num_splits, dtype=torch.int64, device=logits.device)
    if num_rows:
        block = min(_BLOCK, max(16, triton.next_power_of_2(vocab)))
        _race_kernel[(num_rows, num_splits)](logits, seed, best, index, logits.stride(0), vocab, num_splits, split,
                                             BLOCK=block, num_warps=4)
    if num_splits == 1:
        return index.squeeze(1)  # a small vocabulary: no maxima to combine
    return index.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)
