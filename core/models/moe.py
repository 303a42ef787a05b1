"""Mixture of experts: a top-k router and one layer's experts as one fused module.

Layout. A layer's experts are two stacked parameters, as the fused kernel reads them:
  - `gate_up_proj` [E, 2 * I_rank, H]: expert e's gate rows, then its up rows;
  - `down_proj`    [E, H, I_rank].
Checkpoints store one matrix per expert and projection (`experts.<e>.gate_proj.weight` ...); each
is copied into its expert's slice at load (`load_moe_weights`).

Quantized experts. Under a quantization config the layer asks it for a `MoEMethod` (as linear
layers ask for a `LinearMethod`); the method registers the stacked parameters it loads (FP8:
e4m3 `gate_up_proj`/`down_proj` and fp32 per-row `gate_up_proj_scale` [E, 2 * I_rank] and
`down_proj_scale` [E, H]), each per-expert checkpoint tensor `experts.<e>.<proj>.<kind>` reaching
the parameter `<stack><suffix of kind>`. A config without one leaves the experts dense.

Tensor parallelism splits every expert along its intermediate dimension (I_rank = I / ranks, the
same rows of gate, up and down): every rank holds every expert's slice and computes a partial
down projection, summed by the same all-reduce as a dense MLP's row-parallel output. The leading
expert dimension is never split, so expert parallelism can later hand each rank a range of it
(and mask the routes to other ranks' experts) without changing the parameter layout or the kernel.

The torch path (`select_experts`, then `fused_moe_torch`) is the numerical reference and runs where
no fused kernel is installed (CPU); a platform installs its kernel, routing included, through
`LayerKernels.fused_moe`. Both take optional per-row weight scales: FP8 weights are widened
exactly, multiplied with unquantized activations, and the row scale is applied to the fp32 sum
(W8A16).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ..distributed import all_reduce, get_tp, shard_range
from ..loaders.packing import load_packed_weights
from ..quantization.base import MoEMethod, QuantizableLayer, QuantizationConfig
from ..quantization.fp8_block import dequantize_blocks
from ..quantization.scope import deferred_weight_device
from .kernels import UsesLayerKernels

# A per-expert checkpoint tensor: "<prefix>.experts.<e>.<gate_proj|up_proj|down_proj>.<kind>"
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                           r"\.(?P<kind>weight|weight_scale|weight_scale_inv|input_scale)$")
# The stacked parameter a kind of per-expert tensor loads into: its stack's name plus this suffix.
KIND_SUFFIX = {"weight": "", "weight_scale": "_scale", "weight_scale_inv": "_scale", "input_scale": "_input_scale"}


# Why a model whose experts run `fused_moe_torch` decodes outside CUDA graphs (`graph_capture_blocker`).
TORCH_EXPERTS_BLOCKER = "its experts' torch path reads expert counts back to the host"


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (fp32), the top-k of it, renormalised to sum to 1 when the model
    says so (Mixtral always; Qwen3-MoE with `norm_topk_prob`). Returns (weights [T, k] fp32,
    expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [n, 2I] holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_moe_torch(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None, *, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None,
                    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
                    weight_block: tuple[int, int] | None = None, lora=None) -> torch.Tensor:
    """sum_j w[t, j] * down[e_j] @ (silu(gate[e_j] @ x_t) * up[e_j] @ x_t) for every token t.

    hidden [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_weights [T, k]; topk_ids [T, k].
    Each expert multiplies all its routed rows at once (rows sorted by expert); the k results of a
    token are weighted and summed in fp32, in slot order. Reads the per-expert counts back to the
    host: the CPU path, and eager execution elsewhere. With scales ([E, 2I] and [E, H] fp32) the
    weights are FP8 and each expert's product is scaled per output row (`_expert_linear`); with a
    `weight_block` (bn, bk) the scales are per block ([E, 2I/bn, H/bk] and [E, H/bn, I/bk], block
    FP8) and each expert's matrices are dequantized as they are read. Biases
    ([E, 2I], [E, H]) are added to each projection, and `activation` maps gate_up rows to the down
    projection's input (gpt-oss: biased experts and a clamped SwiGLU). `lora` (a
    `corectl.lora.experts.ExpertLoRA`) adds each token's adapter to both projections of its experts
    (and orders an expert's rows by adapter)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True) if lora is None else lora.pair_order(flat, top_k)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k
    rows = hidden[tokens]
    sorted_out = torch.empty(rows.shape[0], down.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            part = slice(start, start + count)
            projected = _expert_linear(rows[part], gate_up, gate_up_scale, expert, weight_block)
            if lora is not None:
                lora.add("gate_up_proj", rows[part], projected, expert, tokens[part])
            if gate_up_bias is not None:
                projected = projected + gate_up_bias[expert]
            activated = activation(projected)
            out = _expert_linear(activated, down, down_scale, expert, weight_block)
            if lora is not None:
                lora.add("down_proj", activated, out, expert, tokens[part])
            sorted_out[part] = out if down_bias is None else out + down_bias[expert]
        start += count
    per_slot = torch.empty_like(sorted_out)
    per_slot[order] = sorted_out
    weighted = per_slot.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden.dtype)


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, expert: int,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """x @ weight[expert].T; with a row scale (FP8 weights), the e4m3 values widened exactly, the
    product summed in fp32 and scaled per output row before one rounding to x's dtype, as the
    fused kernel computes it; with block scales (`block`), the expert's matrix dequantized in fp32."""
    if scale is None:
        return F.linear(x, weight[expert])
    if block is not None:
        return F.linear(x.float(), dequantize_blocks(weight[expert], scale[expert], block)).to(x.dtype)
    return (F.linear(x.float(), weight[expert].float()) * scale[expert]).to(x.dtype)


class FusedMoE(UsesLayerKernels, QuantizableLayer, nn.Module):
    """The experts of one layer, tensor parallel along their intermediate dimension (module doc):
    routes each token to its top-k experts (`select_experts`) and sums their weighted outputs."""

    quant_method: MoEMethod | None = None
    # (bn, bk) when the method's scales are per block (block FP8): only the torch path takes them.
    weight_block: tuple[int, int] | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        tp = get_tp()
        self.first_row, rows = shard_range(intermediate_size, tp.rank, tp.world_size)
        self.num_experts, self.hidden_size, self.intermediate_size, self.rows = (num_experts, hidden_size,
                                                                                 intermediate_size, rows)
        # Under a quantization config the method allocates the experts (`set_quant_method`):
        # dense ones made here first would be a transient copy of most of the model.
        self._create_dense(torch.get_default_dtype(), deferred_weight_device())
        self.reduce_output = all_reduce if tp.world_size > 1 else None
        # The experts' adapters (corectl.lora.experts.ExpertLoRA), set when LoRA serving is on.
        self.lora = None

    def _create_dense(self, dtype: torch.dtype, device: torch.device | str | None) -> None:
        e, h, rows = self.num_experts, self.hidden_size, self.rows
        self.register_expert_param("gate_up_proj", torch.empty(e, 2 * rows, h, dtype=dtype, device=device),
                                   self.load_gate_up)
        self.register_expert_param("down_proj", torch.empty(e, h, rows, dtype=dtype, device=device), self.load_down)

    def register_expert_param(self, name: str, tensor: torch.Tensor, loader: Callable) -> nn.Parameter:
        """A stacked parameter filled expert by expert through `loader(param, loaded, proj, expert)`:
        `load_gate_up`/`load_down` for matrices, `load_gate_up_rows`/`load_down_rows` for one
        value per output row."""
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = loader
        self.register_parameter(name, param)
        return param

    def quant_method_for(self, config: QuantizationConfig, prefix: str) -> MoEMethod | None:
        return config.moe_method(prefix, self)

    def set_quant_method(self, method: MoEMethod | None, dtype: torch.dtype, device: torch.device) -> None:
        """Give the layer its method (None: materialise the dense experts it deferred)."""
        del self.gate_up_proj, self.down_proj
        self.quant_method = method
        if method is None:
            self._create_dense(dtype, device)
            return
        with torch.device(device):
            method.create_weights(self, dtype)

    def checkpoint_weight_names(self, prefix: str) -> list[str]:
        """The checkpoint weights this layer holds (every expert's three projections)."""
        return [f"{prefix}.{e}.{proj}.weight" for e in range(self.num_experts)
                for proj in ("gate_proj", "up_proj", "down_proj")]

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            out = self.quant_method.apply(self, hidden, router_logits)
        else:
            out = self.run_experts(hidden, router_logits)
        return out if self.reduce_output is None else self.reduce_output(out)

    def run_experts(self, hidden: torch.Tensor, router_logits: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial output from the stacked weights (and their row scales, FP8): by the
        installed kernel, else the torch path."""
        lora = self.lora if self.lora is not None and self.lora.active else None
        kernels = self.kernels
        kernel = None if kernels is None else kernels.fused_moe if lora is None else kernels.fused_moe_lora
        scales = {} if gate_up_scale is None else {"gate_up_scale": gate_up_scale, "down_scale": down_scale}
        if kernel is not None and self.weight_block is None:
            adapters = {} if lora is None else {"lora": lora}
            return kernel(hidden, self.gate_up_proj, self.down_proj, router_logits, self.top_k, self.renormalize,
                          **adapters, **scales)
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return fused_moe_torch(hidden, self.gate_up_proj, self.down_proj, weights, ids, **scales,
                               weight_block=self.weight_block, lora=lora)

    def load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, proj: str, expert: int) -> None:
        """One expert's gate_proj or up_proj [I, H]: this rank's rows into its half of the expert."""
        self._check(loaded, (self.intermediate_size, param.shape[2]), proj, expert)
        offset = 0 if proj == "gate_proj" else self.rows
        param.data[expert].narrow(0, offset, self.rows).copy_(loaded.narrow(0, self.first_row, self.rows))

    def load_down(self, param: nn.Parameter, loaded: torch.Tensor, proj: str, expert: int) -> None:
        """One expert's down_proj [H, I]: this rank's input columns."""
        self._check(loaded, (param.shape[1], self.intermediate_size), proj, expert)
        param.data[expert].copy_(loaded.narrow(1, self.first_row, self.rows))

    def load_gate_up_rows(self, param: nn.Parameter, loaded: torch.Tensor, proj: str, expert: int) -> None:
        """One value per output row of gate_proj or up_proj ([I], [I, 1], or one for the whole
        matrix, expanded): this rank's rows into param [E, 2 * I_rank]."""
        rows = self._per_row(loaded, self.intermediate_size, proj, expert)
        offset = 0 if proj == "gate_proj" else self.rows
        param.data[expert].narrow(0, offset, self.rows).copy_(rows.narrow(0, self.first_row, self.rows))

    def load_down_rows(self, param: nn.Parameter, loaded: torch.Tensor, proj: str, expert: int) -> None:
        """One value per output row of down_proj (the hidden size, never split) into param [E, H]."""
        param.data[expert].copy_(self._per_row(loaded, self.hidden_size, proj, expert))

    def _per_row(self, loaded: torch.Tensor, rows: int, proj: str, expert: int) -> torch.Tensor:
        self._check(loaded, (), proj, expert)
        if loaded.numel() == 1:  # per-tensor: every row keeps the matrix's value (exact)
            return loaded.reshape(1).expand(rows)
        if loaded.numel() != rows:
            raise ValueError(f"expert {expert} {proj}: expected {rows} row values or one, checkpoint has "
                             f"{tuple(loaded.shape)}")
        return loaded.reshape(rows)

    def _check(self, loaded: torch.Tensor, expected: tuple[int, ...], proj: str, expert: int) -> None:
        """The expert exists and `loaded` has the `expected` shape (() checks the expert only)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint names expert {expert}; the model has {self.num_experts} experts")
        if expected and tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert} {proj}: expected {expected}, checkpoint has {tuple(loaded.shape)}")


class SparseMoeBlock(UsesLayerKernels, nn.Module):
    """Router (`gate`, replicated on every rank) and experts: the MLP of a mixture-of-experts layer."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, top_k, renormalize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router_forward(self.gate, hidden))


def load_moe_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                     skip: Callable[[str], bool]) -> set[str]:
    """`load_packed_weights` plus per-expert tensors, each copied into its expert's slice of the
    stacked parameter its kind loads into (`KIND_SUFFIX`; kinds the layer's method names unused
    are read past). A stacked parameter counts as filled only when every expert's every
    projection arrived, so a checkpoint missing one (a matrix or a scale) is reported by name."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    arrived: dict[str, set[tuple[str, int]]] = {}

    def dense_tensors():
        for name, tensor in weights:
            match = EXPERT_TENSOR.match(name)
            if match is None or skip(name):
                yield name, tensor
                continue
            proj, expert, kind = match["proj"], int(match["expert"]), match["kind"]
            method = getattr(modules.get(match["prefix"]), "quant_method", None)
            if method is not None and kind in method.unused_tensors:
                continue
            stack = ".down_proj" if proj == "down_proj" else ".gate_up_proj"
            target = match["prefix"] + stack + KIND_SUFFIX[kind]
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
            params[target].weight_loader(params[target], tensor, proj, expert)
            arrived.setdefault(target, set()).add((proj, expert))

    filled = load_packed_weights(model, dense_tensors(), skip)
    for target, pieces in arrived.items():
        per_expert = 1 if ".down_proj" in target else 2
        if len(pieces) == per_expert * params[target].shape[0]:
            filled.add(target)
    return filled
