"""The segment form's tile: which rows of which adapter one program of a segment kernel covers."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def segment_tile(starts_ptr, lens_ptr, slots_ptr, order_ptr, BLOCK_M: tl.constexpr, ORDERED: tl.constexpr):
    """Program axis 0 is the segment, axis 1 its block of BLOCK_M rows: (token rows, which of them lie
    in the segment, the segment's slot, whether any does: a program past the end does nothing).
    ORDERED: a segment is positions of `order` (token rows sorted by slot), not rows themselves."""
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    length = tl.load(lens_ptr + seg)
    m = m0 + tl.arange(0, BLOCK_M)
    in_segment = m < length
    first = tl.load(starts_ptr + seg)
    if ORDERED:
        rows = tl.load(order_ptr + first + m, mask=in_segment, other=0).to(tl.int64)
    else:
        rows = first.to(tl.int64) + m
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    return rows, in_segment, slot, m0 < length
