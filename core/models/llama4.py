"""Llama 4 text (`Llama4ForCausalLM`, `llama4_text` configs): Scout/Maverick's language model.

Following transformers' Llama4ForCausalLM operation for operation:
  - iRoPE: layers marked in `no_rope_layers` (1 = rotate) rotate q/k and attend within chunks of
    `attention_chunk_size` tokens (`layer_types` "chunked_attention": a query sees the keys of its
    own chunk); the others skip the rotation and attend to the whole context, their queries scaled
    by the attention temperature 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) at position p
    (`attn_temperature_tuning`);
  - the rotation pairs adjacent features (complex multiplication: (x[2i], x[2i+1])), not halves;
  - rotating layers L2-normalise q and k per head after the rotation (`use_qk_norm`, no weight);
  - `moe_layers` hold a mixture of experts: a router whose top-k logits pass through a sigmoid
    and scale the token *before* its experts (which then sum unweighted), plus a shared expert;
    the other layers a dense MLP of `intermediate_size_mlp`.

Checkpoints name the MLP `feed_forward` and stack the experts: `experts.gate_up_proj` [E, H, 2I]
(gate columns, then up) and `experts.down_proj` [E, I, H], loaded transposed into `FusedMoE`'s
layout. The vision tower is out of scope: a `Llama4ForConditionalGeneration` checkpoint (Scout and
Maverick as published) serves its text model, and image input is refused by the request intake.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from ..attention import ForwardContext
from ..loaders.packing import load_packed_weights
from .layers import Attention, RotaryEmbedding
from .llama import DecoderAttention, GatedMLP, LlamaForCausalLM
from .pipeline import held_by_other_stage
from .moe import TORCH_EXPERTS_BLOCKER, FusedMoE, fused_moe_torch

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated pair by pair (features 2i, 2i + 1 as one complex number) by angles whose
    cos/sin [T, 1, D / 2] are given; in fp32, cast back, as transformers does."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(DecoderAttention):
    """Llama's attention with iRoPE (module doc): chunked rotating layers, global no-rope layers."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool):
        super().__init__(config, layer_idx, rotary, qkv_bias, qk_norm=False)
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.qk_l2_norm = self.use_rope and config.use_qk_norm
        self.eps = config.rms_norm_eps
        self.temperature = None
        if not self.use_rope and config.attn_temperature_tuning:
            self.temperature = (float(config.attn_scale), float(config.floor_scale))
        chunked = config.layer_types[layer_idx] == "chunked_attention"
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              attention_chunk=config.attention_chunk_size if chunked else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            half = self.head_dim // 2
            cos = self.rotary.cos[positions, :half].unsqueeze(1)
            sin = self.rotary.sin[positions, :half].unsqueeze(1)
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        if self.qk_l2_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature is not None:
            attn_scale, floor_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v, ctx)
        return self.o_proj(out)


class Llama4Experts(FusedMoE):
    """Top-k experts whose inputs, not outputs, carry the sigmoid router scores (module doc)."""

    def run_experts(self, hidden: torch.Tensor, router_logits: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None) -> torch.Tensor:
        values, ids = torch.topk(router_logits, self.top_k, dim=-1)
        scores = torch.sigmoid(values.float()).to(hidden.dtype)
        ones = torch.ones_like(scores[:, :1], dtype=torch.float32)
        out = None
        for slot in range(self.top_k):
            part = fused_moe_torch(hidden * scores[:, slot:slot + 1], self.gate_up_proj, self.down_proj, ones,
                                   ids[:, slot:slot + 1], gate_up_scale, down_scale)
            out = part if out is None else out + part
        return out

    def load_stacked(self, name: str, loaded: torch.Tensor) -> None:
        """`gate_up_proj` [E, H, 2I] (gate columns, then up) or `down_proj` [E, I, H]: this rank's slice."""
        e, h, inter, rows = self.num_experts, self.hidden_size, self.intermediate_size, self.rows
        expected = (e, h, 2 * inter) if name == "gate_up_proj" else (e, inter, h)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"experts.{name}: expected {expected}, checkpoint has {tuple(loaded.shape)}")
        if name == "down_proj":
            self.down_proj.data.copy_(loaded.narrow(1, self.first_row, rows).transpose(1, 2))
            return
        for half, part in enumerate(loaded.chunk(2, dim=2)):
            self.gate_up_proj.data[:, half * rows:(half + 1) * rows].copy_(
                part.narrow(2, self.first_row, rows).transpose(1, 2))


class Llama4MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = Llama4Experts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                     config.num_experts_per_tok, renormalize=False)
        self.shared_expert = GatedMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(hidden) + self.experts(hidden, self.router(hidden))


class Llama4ForCausalLM(LlamaForCausalLM):
    supports_graph_capture = False
    graph_capture_blocker = TORCH_EXPERTS_BLOCKER
    attention_class = Llama4Attention

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if layer_idx in config.moe_layers:
            return Llama4MoE(config)
        return GatedMLP(SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size_mlp))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        modules = dict(self.named_modules())
        filled: set[str] = set()

        def remaining():
            for name, tensor in weights:
                name = name.replace(".feed_forward.", ".mlp.")
                match = _STACKED.match(name)
                if match is None or held_by_other_stage(self, name):
                    yield name, tensor
                    continue
                modules[match["prefix"]].load_stacked(match["name"], tensor)
                filled.add(f"{match['prefix']}.{match['name']}")

        return load_packed_weights(self, remaining(), self.skips_weight) | filled


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """A Llama 4 checkpoint as published (Scout, Maverick: `language_model.*` beside `vision_model.*`
    and `multi_modal_projector.*`), served as its text model on `config.text_config`. The tower's and
    projector's tensors are not loaded, and having no `encode_images` the model refuses image input
    by name (`ModelInfo.reads_images`)."""

    _VISION = ("vision_model.", "multi_modal_projector.")

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__(config.get_text_config(), max_positions, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name.removeprefix("language_model."), tensor) for name, tensor in weights
                                    if not name.startswith(self._VISION))
