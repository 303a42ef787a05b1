"""Mixture of experts: a top-k router and one layer's experts as one fused module.

Layout. A layer's experts are two stacked parameters, as the fused kernel reads them:
  - `gate_up_proj` [E, 2 * I_rank, H]: expert e's gate rows, then its up rows;
  - `down_proj`    [E, H, I_rank].
Checkpoints store one matrix per expert and projection (`experts.<e>.gate_proj.weight` ...); each
is copied into its expert's slice at load (`load_moe_weights`).

Tensor parallelism splits every expert along its intermediate dimension (I_rank = I / ranks, the
same rows of gate, up and down): every rank holds every expert's slice and computes a partial
down projection, summed by the same all-reduce as a dense MLP's row-parallel output. The leading
expert dimension is never split, so expert parallelism can later hand each rank a range of it
(and mask the routes to other ranks' experts) without changing the parameter layout or the kernel.

The torch path (`select_experts`, then `fused_moe_torch`) is the numerical reference and runs where
no fused kernel is installed (CPU); a platform installs its kernel, routing included, through
`LayerKernels.fused_moe`.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ..distributed import all_reduce, get_tp, shard_range
from .kernels import UsesLayerKernels
from .layers import load_packed_weights

# A per-expert checkpoint tensor: "<prefix>.experts.<e>.<gate_proj|up_proj|down_proj>.weight"
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (fp32), the top-k of it, renormalised to sum to 1 when the model
    says so (Mixtral always; Qwen3-MoE with `norm_topk_prob`). Returns (weights [T, k] fp32,
    expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_torch(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j w[t, j] * down[e_j] @ (silu(gate[e_j] @ x_t) * up[e_j] @ x_t) for every token t.

    hidden [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_weights [T, k]; topk_ids [T, k].
    Each expert multiplies all its routed rows at once (rows sorted by expert); the k results of a
    token are weighted and summed in fp32, in slot order. Reads the per-expert counts back to the
    host: the CPU path, and eager execution elsewhere."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = hidden[order // top_k]
    sorted_out = torch.empty(rows.shape[0], down.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            gate, up = F.linear(rows[start:start + count], gate_up[expert]).chunk(2, dim=-1)
            sorted_out[start:start + count] = F.linear(F.silu(gate) * up, down[expert])
        start += count
    per_slot = torch.empty_like(sorted_out)
    per_slot[order] = sorted_out
    weighted = per_slot.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden.dtype)


class FusedMoE(UsesLayerKernels, nn.Module):
    """The experts of one layer, tensor parallel along their intermediate dimension (module doc):
    routes each token to its top-k experts (`select_experts`) and sums their weighted outputs."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        tp = get_tp()
        self.first_row, rows = shard_range(intermediate_size, tp.rank, tp.world_size)
        self.num_experts, self.intermediate_size, self.rows = num_experts, intermediate_size, rows
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, rows))
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        self.reduce_output = all_reduce if tp.world_size > 1 else None

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels.fused_moe if self.kernels is not None else None
        if kernel is not None:
            out = kernel(hidden, self.gate_up_proj, self.down_proj, router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
            out = fused_moe_torch(hidden, self.gate_up_proj, self.down_proj, weights, ids)
        return out if self.reduce_output is None else self.reduce_output(out)

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, proj: str, expert: int) -> None:
        """One expert's gate_proj or up_proj [I, H]: this rank's rows into its half of the expert."""
        self._check(loaded, (self.intermediate_size, param.shape[2]), proj, expert)
        offset = 0 if proj == "gate_proj" else self.rows
        param.data[expert].narrow(0, offset, self.rows).copy_(loaded.narrow(0, self.first_row, self.rows))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, proj: str, expert: int) -> None:
        """One expert's down_proj [H, I]: this rank's input columns."""
        self._check(loaded, (param.shape[1], self.intermediate_size), proj, expert)
        param.data[expert].copy_(loaded.narrow(1, self.first_row, self.rows))

    def _check(self, loaded: torch.Tensor, expected: tuple[int, int], proj: str, expert: int) -> None:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint names expert {expert}; the model has {self.num_experts} experts")
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert} {proj}: expected {expected}, checkpoint has {tuple(loaded.shape)}")


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated on every rank) and experts: the MLP of a mixture-of-experts layer."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, top_k, renormalize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


def load_moe_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Callable[[str], bool]) -> set[str]:
    """`load_packed_weights` plus per-expert tensors, each copied into its expert's slice of the
    stacked parameter. A stacked parameter counts as filled only when every expert's every
    projection arrived, so a checkpoint missing one is reported by name."""
    params = dict(model.named_parameters())
    arrived: dict[str, set[tuple[str, int]]] = {}

    def dense_tensors():
        for name, tensor in weights:
            match = EXPERT_TENSOR.match(name)
            if match is None:
                yield name, tensor
                continue
            proj, expert = match["proj"], int(match["expert"])
            target = match["prefix"] + (".down_proj" if proj == "down_proj" else ".gate_up_proj")
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
            params[target].weight_loader(params[target], tensor, proj, expert)
            arrived.setdefault(target, set()).add((proj, expert))

    filled = load_packed_weights(model, dense_tensors(), skip)
    for target, pieces in arrived.items():
        per_expert = 1 if target.endswith(".down_proj") else 2
        if len(pieces) == per_expert * params[target].shape[0]:
            filled.add(target)
    return filled
