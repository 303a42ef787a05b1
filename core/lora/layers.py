"""LoRA on a model's projections: a wrapper around each adapted linear layer, sharing one step batch.

`attach_lora` replaces every attention and dense MLP projection (`qkv_proj`, `o_proj`,
`gate_up_proj`, `down_proj`) of a built model with a `LoRALinear` that runs the original layer
(dense, quantized or prepacked, whatever it is) and adds the adapters' products to its output.
The wrapper keeps the base layer's tensor-parallel layout:
  - packed column-parallel layers (qkv, gate_up): A per sub-projection, whole (every rank sees the
    whole input); B rows sliced exactly as the base shards its output rows;
  - row-parallel layers (o, down): A sliced along the input as the base is; each rank's partial
    x @ A.T is summed over the ranks (a [T, r] all-reduce) before the expand, with B whole.
The adapted output is `base(x) + (x @ A.T @ B.T) * scaling` per token, PEFT's formula. On GPUs a
dense base's A rows of every slot sit under its weight in one storage, so a batch-1 step's base
GEMV computes x @ A.T as well and no shrink launches (docs/lora.md, "How it runs").

Which slot each token uses is in the shared `LoRABatch` (one per model, written by the adapter
manager before each forward pass): static device buffers (the slots, and the rows sorted by slot in
tiles), so a captured decode graph reads the layout of whatever step replays it.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import envs
from ..models.kernels import UsesLayerKernels
from ..loaders.packing import PACKED_MODULES
from ..models.quantizable import QuantizableLinear
from .punica import LoRASegments, SlotGroup, grouped_lora, sorted_tiles

ADAPTED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Decode steps of at most this many tokens keep the gathered form (a program a token): fewer tokens
# than a tile gain nothing from sorting. tl.dot takes 16 rows and up.
GATHERED_MAX_TOKENS = 16


class LoRABatch:
    """One step's adapter layout, read by every `LoRALinear` of the model.

    `token_slots` [max_tokens] int32 holds each token row's slot (-1: base only, and every row past
    the step's tokens); `scales` [S] fp32 each slot's scaling. `segments` is the segment form of a
    prefill or mixed step, None in decode steps and graph captures, whose kernels read the static
    buffers: `token_slots` (the gathered form) and, past GATHERED_MAX_TOKENS tokens, the sorted tiles
    of `tile_rows` rows. A prefill or mixed step runs on sorted tiles of `prefill_tile_rows` (its
    requests' runs are long; a grid over requests x row blocks would launch a program for every row
    block of the longest prompt for each decode token of the step, nearly all of them empty).
    `groups` are the rows of each slot for the torch path; `active` is False for a step with no
    adapter at all.
    """

    def __init__(self, max_loras: int, max_tokens: int, device: torch.device):
        self.max_loras = max_loras
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.scale_list = [0.0] * max_loras
        self.ranks = [0] * max_loras
        self.segments: LoRASegments | None = None
        self.groups: list[SlotGroup] = []
        self.active = True
        self.sorted = envs.lora_sorted_enabled()
        # Fixed for the engine's life: a captured graph keeps the tiles of its row count.
        self.tile_rows, self.prefill_tile_rows = envs.lora_tile_rows()
        smallest = min(rows for rows in (self.tile_rows, self.prefill_tile_rows) if rows)
        self.max_tiles = -(-max_tokens // smallest) + max_loras
        # The tiles' starts, lengths and slots, then the sorted order: one buffer, so one copy writes
        # a step's. Zero lengths: no tile, what a replayed graph must see in a step without adapters.
        self._sorted = torch.zeros(3 * self.max_tiles + max_tokens, dtype=torch.int32, device=device)
        self._tiles: dict[tuple[int, int], LoRASegments] = {}
        # Rows of `token_slots` that may hold a slot other than -1 (the last step with adapters wrote them).
        self._slot_rows = 0
        # Rows of the tiles the step's write_slots cut: an eager step with segments runs on those.
        self._written_tile_rows = self.tile_rows

    def reset(self) -> None:
        """Back to the state a captured decode graph is recorded in: every kernel runs on the static buffers."""
        self.segments, self.groups, self.active = None, [], True

    def write_slots(self, token_slots: np.ndarray, tiles: bool, prefill: bool = False) -> None:
        """A step's token slots into the static buffers (rows past them back to -1), with the sorted
        tiles where `tiles` (the kernels read them; a prefill or mixed step's of `prefill_tile_rows`);
        each one host-to-device copy."""
        num_tokens = token_slots.shape[0]
        rows = max(num_tokens, self._slot_rows)
        if rows:
            padded = np.full(rows, -1, dtype=np.int32)
            padded[:num_tokens] = token_slots
            self.token_slots[:rows].copy_(torch.from_numpy(padded), non_blocking=True)
        self._slot_rows = num_tokens
        tile_rows = self.prefill_tile_rows if prefill else self.tile_rows
        if tiles and self.sorted and tile_rows:
            self._written_tile_rows = tile_rows
            order, step_tiles = sorted_tiles(token_slots, tile_rows)
            host = np.zeros(3 * self.max_tiles + order.shape[0], dtype=np.int32)
            host[:3 * self.max_tiles].reshape(3, self.max_tiles)[:, :step_tiles.shape[1]] = step_tiles
            host[3 * self.max_tiles:] = order
            self._sorted[:host.shape[0]].copy_(torch.from_numpy(host), non_blocking=True)

    def clear_slots(self) -> None:
        """No adapter in this step: a replayed decode graph runs the kernels whatever the step, so the
        buffers it reads must hold none (only where a step with adapters wrote them)."""
        if self._slot_rows:
            self.token_slots[:self._slot_rows].fill_(-1)
            self._sorted[:3 * self.max_tiles].zero_()
            self._slot_rows = 0

    def kernel_layout(self, num_tokens: int) -> LoRASegments | None:
        """The layout the kernels take for a forward pass of `num_tokens` rows: a step with segments
        (prefill, mixed, or verify run eagerly) on the sorted tiles its write_slots cut (its
        segments where prefill tiles are off); in a decode step or a graph capture, the sorted tiles
        past GATHERED_MAX_TOKENS rows (a captured graph keeps the form of its row count), else None:
        the gathered form, a program a token."""
        prefill = self.segments is not None
        if not self.sorted or (prefill and not self.prefill_tile_rows) or \
                (not prefill and num_tokens <= GATHERED_MAX_TOKENS):
            return self.segments
        tile_rows = self._written_tile_rows if prefill else self.tile_rows
        count = min(self.max_tiles, -(-num_tokens // tile_rows) + min(self.max_loras, num_tokens))
        if (count, tile_rows) not in self._tiles:
            starts, lens, slots = (self._sorted[j * self.max_tiles:j * self.max_tiles + count] for j in range(3))
            self._tiles[count, tile_rows] = LoRASegments(starts, lens, slots, tile_rows,
                                                         self._sorted[3 * self.max_tiles:])
        return self._tiles[count, tile_rows]


class LoRALinear(UsesLayerKernels, nn.Module):
    """A base projection plus the LoRA adapters of the device slots.

    `projections` are the checkpoint projections packed in the base (`q_proj`, `k_proj`, `v_proj`;
    or one); `slices` their (offset, size, first checkpoint row) in the base's local output;
    `input_slice` the (first, count) input features this rank holds (row-parallel layers).
    """

    def __init__(self, base: nn.Module, projections: list[str], slices: list[tuple[int, int, int]],
                 input_slice: tuple[int, int] | None, batch: LoRABatch, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, reduce_xa=None, stack_a: bool = False):
        super().__init__()
        self.base = base
        self.projections = projections
        self.slices = slices
        self.input_slice = input_slice
        self.batch = batch
        self.reduce_xa = reduce_xa
        self.max_rank = max_rank
        in_features = base.in_features
        out_features = sum(size for _, size, _ in slices)
        offsets = [offset for offset, _, _ in slices]
        if offsets != [sum(size for _, size, _ in slices[:j]) for j in range(len(slices))]:
            raise ValueError(f"LoRA needs a packed layer's slices side by side from column 0, got {slices}")
        self.slice_sizes = [size for _, size, _ in slices]
        a_shape = (max_loras, len(projections), max_rank, in_features)
        # The base weight with every slot's A rows under it (None: A apart), `stacked_bias` its bias.
        # Only where the platform's kernels run batch-1 steps on it (`stack_a`): the torch path would
        # not read it, and a CPU's prepacked linears keep a packed copy, so it would hold the base twice.
        stacked = _stack_under(base, a_shape, dtype) if envs.lora_stacked(stack_a) else None
        self.stacked, self.stacked_bias = stacked or (None, None)
        self.base_rows = out_features
        lora_a = torch.zeros(a_shape, dtype=dtype, device=device) if self.stacked is None else \
            self.stacked[self.base_rows:].view(a_shape)
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch.active:
            out = self._stacked_forward(x, gated=False)
            if out is not None:
                return out
        out = self.base(x)
        if self.batch.active:
            self._add_lora(x, out)
        return out

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """A gated MLP's fused down projection: the base's, with the LoRA kernels forming the
        activation as they load `gate_up` (None where the base has none, or LoRA runs in torch)."""
        kernels = self.kernels
        if self.batch.active and (kernels is None or kernels.lora_shrink is None):
            return None
        if self.batch.active:
            out = self._stacked_forward(gate_up, gated=True)
            if out is not None:
                return out
        out = self.base.forward_gated(gate_up)
        if out is not None and self.batch.active:
            self._add_lora(gate_up, out, gated=True)
        return out

    def _stacked_forward(self, x: torch.Tensor, gated: bool) -> torch.Tensor | None:
        """A batch-1 step on the stacked weight: one GEMV gives the base output and every slot's
        x @ A.T after it, and the expand adds the token's slot's (no shrink launch). None where the
        layer is not stacked or the platform has no GEMV for it: the base and the shrink run apart."""
        kernels = self.kernels
        if self.stacked is None or x.shape[0] != 1 or kernels is None or kernels.lora_stacked_linear is None:
            return None
        base_rows = self.base_rows
        y = kernels.lora_stacked_linear(x, self.stacked, self.stacked_bias, base_rows, gated)
        if y is None:
            return None
        if self.reduce_xa is not None:
            # A row-parallel layer: one all-reduce sums the base output and x @ A.T over the ranks.
            y = self.reduce_xa(y)
        out = y[:, :base_rows]
        batch = self.batch
        kernels.lora_expand(y[:, base_rows:].unsqueeze(0), self.lora_b, batch.scales, batch.token_slots[:1], None, out,
                            self.slice_sizes)
        return out

    def _add_lora(self, x: torch.Tensor, out: torch.Tensor, gated: bool = False) -> None:
        batch, kernels = self.batch, self.kernels
        if kernels is None or kernels.lora_shrink is None:
            if not batch.groups:
                # Only a forward pass outside a prepared step gets here (a CUDA graph capture):
                # the torch path reads host-side groups, which a replayed graph could not follow.
                raise RuntimeError("LoRA in a captured graph needs the platform's LoRA kernels "
                                   "(CORECTL_FUSED_KERNELS=0 leaves the torch path: add --enforce-eager)")
            slices = [(offset, size) for offset, size, _ in self.slices]
            grouped_lora(x, out, self.lora_a, self.lora_b, slices, batch.groups, batch.ranks, batch.scale_list,
                         self.reduce_xa)
            return
        slots = batch.token_slots[: x.shape[0]]
        layout = batch.kernel_layout(x.shape[0])
        num_slots, n, rank, in_features = self.lora_a.shape
        # One shrink over every sub-projection's stacked A and one expand writing every slice: at
        # batch 1 each launch costs more than the bytes it moves.
        xa = kernels.lora_shrink(x, self.lora_a.view(num_slots, n * rank, in_features), slots, layout, gated=gated)
        if self.reduce_xa is not None:
            xa = self.reduce_xa(xa.sum(0, keepdim=True))
        kernels.lora_expand(xa, self.lora_b, batch.scales, slots, layout, out, self.slice_sizes)

    def load_slot(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's (A [r, in], B [out, r]) per checkpoint projection into `slot` (this
        rank's slices; zeros for the projections it does not adapt and past its rank)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, projection in enumerate(self.projections):
            if projection not in pairs:
                continue
            a, b = pairs[projection]
            rank = a.shape[0]
            if self.input_slice is not None:
                a = a.narrow(1, *self.input_slice)
            offset, size, first = self.slices[j]
            self.lora_a[slot, j, :rank].copy_(a)
            self.lora_b[slot, offset:offset + size, :rank].copy_(b.narrow(0, first, size))

    def extra_repr(self) -> str:
        return f"projections={self.projections}, slots={self.lora_a.shape[0]}, max_rank={self.max_rank}"


def _stack_under(base: nn.Module, a_shape: tuple[int, ...],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A dense base weight [N, K] moved into [N + S n R, K] (the base keeps a view of its rows, so
    the weight is held once), the rows past N every slot's A (zeros), with the bias likewise
    (zeros past N); None for a quantized or differently typed base, or where the A rows would
    add over 1/8 to the bytes a batch-1 GEMV reads (at most the cost of the shrink launch they save)."""
    weight = getattr(base, "weight", None)
    a_rows = a_shape[0] * a_shape[1] * a_shape[2]
    if (getattr(base, "quant_method", None) is not None or not isinstance(weight, torch.Tensor) or weight.dim() != 2
            or weight.dtype != dtype or weight.is_meta or 8 * a_rows > weight.shape[0]):
        return None
    rows = weight.shape[0]
    stacked = torch.zeros(rows + a_rows, weight.shape[1], dtype=dtype, device=weight.device)
    stacked[:rows].copy_(weight)
    weight.data = stacked[:rows]
    if base.bias is None:
        return stacked, None
    bias = torch.zeros(rows + a_rows, dtype=base.bias.dtype, device=base.bias.device)
    bias[:rows].copy_(base.bias)
    base.bias.data = bias[:rows]
    return stacked, bias


def attach_lora(model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device, stack_a: bool = False) -> dict[str, tuple[LoRALinear, str]]:
    """Wrap every adapted projection of `model` in place; returns checkpoint module path
    (`model.layers.0.self_attn.q_proj`) -> (its wrapper, its projection name). `stack_a`: the
    platform's kernels run batch-1 steps on stacked weights (`LayerKernels.lora_stacked_linear`)."""
    targets = [(prefix, parent, name, child)
               for prefix, parent in model.named_modules() for name, child in parent.named_children()
               if name in ADAPTED_LAYERS and isinstance(child, QuantizableLinear)]
    modules: dict[str, tuple[LoRALinear, str]] = {}
    for prefix, parent, name, base in targets:
        wrapper = _wrap(base, name, batch, max_loras, max_rank, dtype, device, stack_a)
        setattr(parent, name, wrapper)
        for projection in wrapper.projections:
            modules[f"{prefix}.{projection}" if prefix else projection] = (wrapper, projection)
    return modules


def _wrap(base: QuantizableLinear, name: str, batch: LoRABatch, max_loras: int, max_rank: int,
          dtype: torch.dtype, device: torch.device, stack_a: bool) -> LoRALinear:
    if base.shards is not None:
        by_shard = {shard: proj for proj, (packed, shard) in PACKED_MODULES.items() if packed == name}
        projections = [by_shard[shard] for shard in base.shards]
        return LoRALinear(base, projections, list(base.shards.values()), None, batch, max_loras, max_rank, dtype,
                          device, stack_a=stack_a)
    slices = [(0, base.out_features, 0)]
    input_slice = None if base.first_input is None else (base.first_input, base.in_features)
    return LoRALinear(base, [name], slices, input_slice, batch, max_loras, max_rank, dtype, device,
                      reduce_xa=base.reduce_output, stack_a=stack_a)
