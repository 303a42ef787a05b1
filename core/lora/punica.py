"""Batched mixed-adapter LoRA arithmetic (punica's shrink and expand) in torch.

Every LoRA layer holds its adapters stacked by device slot: A as [S, n, R, K] (n sub-projections
of a packed layer, R = max_lora_rank, zero rows past an adapter's rank) and B as [S, N, R] (rows in
the base layer's output order). A step's tokens each carry a slot (-1: no adapter, the base only):
shrink computes xa = x @ A[slot].T per token, expand adds (xa_j @ B[slot][slice_j].T) * scale[slot]
into slice j of the base output.

Two torch forms live here: `shrink_reference`/`expand_reference` gather per token (the numerical
reference the Triton kernels are tested against), and `grouped_lora` loops over the distinct
adapters of the step, one pair of GEMMs each (the CPU path: no per-token Python loop, and each GEMM
has PEFT's shapes, so fp32 outputs match PEFT's).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class LoRASegments:
    """Runs of tokens that share one adapter (base-only runs are left out): the segment form a
    step's kernels take. Device int32 tensors of G entries. Without `order` a segment is consecutive
    token rows [start, start + len) (a prefill or mixed step). With it, a segment is positions
    [start, start + len) of `order`, the step's adapted token rows sorted by slot: a decode step's
    tiles (`sorted_tiles`), each at most `max_len` rows of one slot, so each adapter's A and B are
    read once a tile instead of once a token; segments of length 0 are padding."""

    starts: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    max_len: int
    order: torch.Tensor | None = None

    @property
    def num_segments(self) -> int:
        return self.slots.shape[0]


def sorted_tiles(token_slots: np.ndarray, tile_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The sorted form of a step whose token row i has adapter slot token_slots[i] (-1: base):
    (order, tiles [3, n]) with `order` the adapted rows sorted by slot (stable) and tiles' rows
    the starts in `order`, lengths (at most `tile_rows`) and slots of n = sum over slots of
    ceil(rows / tile_rows) tiles, at most ceil(T / tile_rows) + distinct slots."""
    rows = np.flatnonzero(token_slots >= 0).astype(np.int32)
    order = rows[np.argsort(token_slots[rows], kind="stable")]
    sorted_slots = token_slots[order]
    run_starts = np.flatnonzero(np.diff(sorted_slots, prepend=-1)).astype(np.int32)
    run_lens = np.diff(run_starts, append=np.int32(order.shape[0]))
    per_run = -(-run_lens // tile_rows)
    run_of = np.repeat(np.arange(run_starts.shape[0]), per_run)
    within = np.arange(run_of.shape[0]) - np.repeat(np.cumsum(per_run) - per_run, per_run)
    starts = run_starts[run_of] + within * tile_rows
    lens = np.minimum(tile_rows, run_starts[run_of] + run_lens[run_of] - starts)
    return order, np.stack([starts, lens, sorted_slots[run_starts][run_of]]).astype(np.int32)


@dataclass(frozen=True)
class SlotGroup:
    """The rows of one adapter slot in a step: a slice when they are contiguous, else an index."""

    slot: int
    rows: slice | torch.Tensor


def shrink_reference(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R', K] (R' = n * R), token_slots [T] -> fp32 xa [T, R'], zero on base rows."""
    base = token_slots < 0
    gathered = a[token_slots.clamp(min=0).long()].float()
    xa = torch.bmm(gathered, x.float().unsqueeze(-1)).squeeze(-1)
    return xa.masked_fill(base.unsqueeze(-1), 0.0)


def expand_reference(xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, token_slots: torch.Tensor,
                     out: torch.Tensor) -> None:
    """out [T, N] += (xa [T, R] @ b[slot] [N, R].T) * scales[slot], for rows with a slot >= 0."""
    base = token_slots < 0
    index = token_slots.clamp(min=0).long()
    delta = torch.bmm(b[index].float(), xa.float().unsqueeze(-1)).squeeze(-1) * scales[index].unsqueeze(-1)
    out += delta.masked_fill(base.unsqueeze(-1), 0.0).to(out.dtype)


def grouped_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 slices: Sequence[tuple[int, int]], groups: Sequence[SlotGroup], ranks: Sequence[int],
                 scales: Sequence[float], reduce_xa: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Add each group's LoRA product into `out` in place: a [S, n, R, K], b [S, N, R], slice j of
    `slices` ((offset, size) in `out`'s columns) takes sub-projection j. Each adapter's matrices are
    cut to its own rank, so the GEMMs are the adapter's (PEFT's) shapes. `reduce_xa` sums the
    shrink's partial products over tensor-parallel ranks (a layer whose input is split)."""
    for group in groups:
        slot, rows, rank = group.slot, group.rows, ranks[group.slot]
        xs = x[rows]
        xa = F.linear(xs, a[slot, :, :rank].reshape(-1, a.shape[-1]).to(x.dtype))
        if reduce_xa is not None:
            xa = reduce_xa(xa)
        for j, (offset, size) in enumerate(slices):
            b_slice = b[slot, offset:offset + size, :rank].to(x.dtype)
            delta = F.linear(xa[:, j * rank:(j + 1) * rank], b_slice) * scales[slot]
            target = out[:, offset:offset + size]
            if isinstance(rows, slice):
                target[rows] += delta
            else:
                target.index_add_(0, rows, delta)
