"""LoRA on a mixture-of-experts layer's experts: each token's adapter added inside its experts.

For a pair (token t routed to expert e) whose token has an adapter slot s, the experts compute
  gate_up = x_t @ W_gu[e].T + (x_t @ A_gu[s, e].T) @ B_gu[s, e].T * scale[s]
  out     = act @ W_d[e].T  + (act @ A_d[s, e].T)  @ B_d[s, e].T  * scale[s],  act = silu(gate) * up
and the token's k outputs are weighted and summed as without LoRA (PEFT's parameter LoRA adds
B A * scale to each expert's weights: the same sums, in another order).

`ExpertLoRA` holds one layer's slots, stacked as the kernels read them: gate_up's A
[S, E, 2, R, H] (gate's, then up's) and B [S, E, 2 * I_rank, R]; down's A [S, E, 1, R, I_rank]
and B [S, E, H, R]. It is set as `FusedMoE.lora`; the layer's torch path calls `add` per expert
(`fused_moe_torch`, its pairs in `pair_order`), a platform's `fused_moe_lora` kernel reads the stacks directly. Tensor
parallel: each rank keeps gate_up's B rows and down's A columns of its own intermediate slice
(as the base splits its experts); a rank's partial down delta is linear in its partial x @ A.T,
so the all-reduce that sums the base's partial outputs sums the deltas too.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.moe import FusedMoE
from .layers import LoRABatch
from .punica import SlotGroup, grouped_lora

EXPERT_STACKS = ("gate_up_proj", "down_proj")


class ExpertLoRA(nn.Module):
    def __init__(self, experts: FusedMoE, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        e, h, rows = experts.num_experts, experts.hidden_size, experts.rows
        self.batch = batch
        self.first_row, self.rows, self.intermediate = experts.first_row, rows, experts.intermediate_size
        shapes = {"gate_up_a": (max_loras, e, 2, max_rank, h), "gate_up_b": (max_loras, e, 2 * rows, max_rank),
                  "down_a": (max_loras, e, 1, max_rank, rows), "down_b": (max_loras, e, h, max_rank)}
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # (offset, size) of each sub-projection's rows in a stack's B: gate then up; down whole.
        self.slices = {"gate_up_proj": [(0, rows), (rows, rows)], "down_proj": [(0, h)]}

    @property
    def active(self) -> bool:
        return self.batch.active

    def stacks(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.gate_up_a, self.gate_up_b) if proj == "gate_up_proj" else (self.down_a, self.down_b)

    def load_slot(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's expert stacks (`expert_checkpoint`'s form) into `slot`: this rank's
        intermediate slice, zeros past its rank and for a stack it does not adapt."""
        for proj in EXPERT_STACKS:
            a_slots, b_slots = self.stacks(proj)
            a_slots[slot].zero_()
            b_slots[slot].zero_()
            if proj not in pairs:
                continue
            a, b = pairs[proj]
            rank = a.shape[2]
            if proj == "down_proj":
                a_slots[slot, :, :, :rank].copy_(a.narrow(3, self.first_row, self.rows))
                b_slots[slot, :, :, :rank].copy_(b)
                continue
            a_slots[slot, :, :, :rank].copy_(a)
            for j in range(2):
                rows = b.narrow(1, j * self.intermediate + self.first_row, self.rows)
                b_slots[slot, :, j * self.rows:(j + 1) * self.rows, :rank].copy_(rows)

    def pair_order(self, expert_ids: torch.Tensor, top_k: int) -> torch.Tensor:
        """The torch path's order of the pairs (expert_ids [T * k]): by expert, and within an
        expert by adapter slot, so that each (expert, slot) group is one run of rows."""
        slots = self.batch.token_slots[:expert_ids.shape[0] // top_k].long().repeat_interleave(top_k)
        return (expert_ids * (self.gate_up_a.shape[0] + 1) + slots + 1).argsort(stable=True)

    def add(self, proj: str, x: torch.Tensor, out: torch.Tensor, expert: int, tokens: torch.Tensor) -> None:
        """The torch path: add the adapters' delta of `proj` to `out` [n, N] in place, for one
        expert's rows `x` [n, K] of tokens `tokens` [n], in `pair_order` (one GEMM pair per
        adapter among them, on its run of rows)."""
        slots, counts = self.batch.token_slots[tokens].unique_consecutive(return_counts=True)
        groups, start = [], 0
        for slot, count in zip(slots.tolist(), counts.tolist()):
            if slot >= 0:
                groups.append(SlotGroup(slot, slice(start, start + count)))
            start += count
        if groups:
            a, b = self.stacks(proj)
            grouped_lora(x, out, a[:, expert], b[:, expert], self.slices[proj], groups, self.batch.ranks,
                         self.batch.scale_list, None)


def attach_expert_lora(model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype,
                       device: torch.device) -> dict[str, tuple[ExpertLoRA, str]]:
    """Give every `FusedMoE` of `model` (not its subclasses, whose experts compute otherwise) an
    `ExpertLoRA`; returns each stack's module path (`model.layers.0.mlp.experts.gate_up_proj`)
    -> (its ExpertLoRA, the stack)."""
    modules: dict[str, tuple[ExpertLoRA, str]] = {}
    for prefix, layer in model.named_modules():
        if type(layer) is FusedMoE:
            layer.lora = ExpertLoRA(layer, batch, max_loras, max_rank, dtype, device)
            for proj in EXPERT_STACKS:
                modules[f"{prefix}.{proj}"] = (layer.lora, proj)
    return modules
