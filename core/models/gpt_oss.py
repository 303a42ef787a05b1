"""gpt-oss (`GptOssForCausalLM`): Llama's decoder with attention sinks and biased, clamped-SwiGLU experts.

What differs from Llama (`llama.py`), following transformers' GptOssForCausalLM:
  - q/k/v and o projections carry biases (`attention_bias`);
  - every attention layer has a learned sink logit per head joining its softmax's denominator
    (`Attention.add_sinks`; only backends with `supports_sinks` run it, others refuse by name);
  - layers alternate between 128-token sliding-window and full attention (`layer_types`), with
    YaRN rotary scaling (`rope_parameters`, through transformers' ROPE_INIT_FUNCTIONS);
  - every MLP is a mixture of experts: the router has a bias and softmaxes its top-k logits; each
    expert has biases and gates with a clamped SwiGLU (`clamped_swiglu`).

Checkpoints stack the experts: `experts.gate_up_proj` [E, H, 2I] with gate and up interleaved
column by column, `experts.down_proj` [E, I, H], and their biases. They load transposed and
de-interleaved into `FusedMoE`'s layout ([E, 2I, H], gate rows then up rows). MXFP4 checkpoints
(`*_blocks`/`*_scales`) load through the `mxfp4` quantization method (`corectl.quantization.mxfp4`),
which on a platform with its `mxfp4_moe` kernel (CUDA) keeps them packed and runs that kernel,
biases and activation included; such a model decodes in CUDA graphs. Dense experts, and MXFP4
ones dequantized at load (CPU), run the torch path (`fused_moe_torch`): the dense fused MoE
kernels take neither biases nor this activation.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from ..distributed import get_tp
from ..loaders.packing import load_packed_weights
from ..quantization.mxfp4 import Mxfp4MoEMethod
from .kernels import UsesLayerKernels
from .llama import LlamaForCausalLM
from .pipeline import held_by_other_stage, held_layers
from .moe import TORCH_EXPERTS_BLOCKER, FusedMoE, fused_moe_torch, select_experts

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>gate_up_proj|down_proj)(?P<suffix>_bias|_blocks|_scales)?$")


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of rows [n, 2I] holding gate then up: (up + 1) * gate * sigmoid(alpha *
    gate), with gate clamped above at `limit` and up to [-limit, limit]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def deinterleave(tensor: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a tensor holding them alternately along `dim` (gate first)."""
    return tensor.unflatten(dim, (-1, 2)).unbind(dim + 1)


class GptOssExperts(FusedMoE):
    """`FusedMoE` plus per-expert biases and gpt-oss's activation. The down bias is added once: rank
    0 holds it, the other ranks zeros (their partial outputs are summed)."""

    def __init__(self, config):
        super().__init__(config.num_local_experts, config.hidden_size, config.intermediate_size,
                         config.num_experts_per_tok, renormalize=True)
        self.alpha, self.limit = 1.702, config.swiglu_limit
        self.rank = get_tp().rank
        e = self.num_experts
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * self.rows), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(e, self.hidden_size), requires_grad=False)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def run_experts(self, hidden: torch.Tensor, router_logits: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return fused_moe_torch(hidden, self.gate_up_proj, self.down_proj, weights, ids, gate_up_scale, down_scale,
                               gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                               activation=self.activation)

    def load_stacked(self, name: str, loaded: torch.Tensor) -> None:
        """A stacked checkpoint tensor (`gate_up_proj`, `down_proj` or a bias; module doc) into
        this rank's slice of the parameter of the same name."""
        e, rows = self.num_experts, self.rows
        if name == "down_proj_bias":
            self._expect(name, loaded, (e, self.hidden_size))
            self.down_proj_bias.data.copy_(loaded if self.rank == 0 else torch.zeros_like(loaded))
        elif name == "gate_up_proj_bias":
            self._expect(name, loaded, (e, 2 * self.intermediate_size))
            for half, part in enumerate(deinterleave(loaded, 1)):
                self.gate_up_proj_bias.data[:, half * rows:(half + 1) * rows].copy_(part.narrow(1, self.first_row, rows))
        elif name == "gate_up_proj":
            self._expect(name, loaded, (e, self.hidden_size, 2 * self.intermediate_size))
            for half, part in enumerate(deinterleave(loaded, 2)):
                self.gate_up_proj.data[:, half * rows:(half + 1) * rows].copy_(
                    part.narrow(2, self.first_row, rows).transpose(1, 2))
        else:
            self._expect(name, loaded, (e, self.intermediate_size, self.hidden_size))
            self.down_proj.data.copy_(loaded.narrow(1, self.first_row, rows).transpose(1, 2))

    def _expect(self, name: str, loaded: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(loaded.shape) != shape:
            raise ValueError(f"experts.{name}: expected {shape}, checkpoint has {tuple(loaded.shape)}")


class GptOssMoE(UsesLayerKernels, nn.Module):
    def __init__(self, config):
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router_forward(self.router, hidden))


class GptOssForCausalLM(LlamaForCausalLM):
    graph_capture_blocker = TORCH_EXPERTS_BLOCKER

    @property
    def supports_graph_capture(self) -> bool:
        """Only packed MXFP4 experts run a kernel that reads nothing back (module doc)."""
        return all(isinstance(method := layer.mlp.experts.quant_method, Mxfp4MoEMethod) and method.packed
                   for layer in held_layers(self.model))

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__(config, max_positions, dtype)
        for layer in held_layers(self.model):
            attn = layer.self_attn
            first_q_row = attn.qkv_proj.shards["q"][2]
            attn.attn.add_sinks(first_q_row // attn.head_dim, config.num_attention_heads)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return GptOssMoE(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        modules = dict(self.named_modules())
        filled: set[str] = set()

        def remaining():
            for name, tensor in weights:
                match = _STACKED.match(name)
                if match is None or held_by_other_stage(self, name):
                    yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
                    continue
                experts = modules[match["prefix"]]
                stacked = match["name"] + (match["suffix"] or "")
                method = experts.quant_method
                if method is not None and match["suffix"] != "_bias":
                    method.load_stacked(experts, stacked, tensor)
                else:
                    experts.load_stacked(stacked, tensor)
                filled.add(f"{match['prefix']}.{stacked}")

        return load_packed_weights(self, remaining(), self.skips_weight) | filled
