"""Gemma 2 and Gemma 3 (text) decoder models over packed tokens and the paged KV cache.

Both follow `transformers`' Gemma2ForCausalLM / Gemma3ForCausalLM operation for operation, so greedy
decoding is token-exact in fp32. What differs from Llama (`llama.py`):
  - RMSNorm scales by (1 + weight), in fp32, and casts back afterwards (`GemmaRMSNorm`);
  - token embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
  - four norms per layer: before and after attention, before and after the MLP;
  - the MLP gate is GELU with the tanh approximation (`hidden_activation`);
  - scores are scaled by `query_pre_attn_scalar ** -0.5`, not head_dim ** -0.5;
  - local and global layers (`layer_types`, from `sliding_window_pattern` in older configs): local
    ones attend within `sliding_window` tokens (`sliding_window.py`);
  - Gemma 2: attention scores and final logits are soft-capped (`attn_logit_softcapping`,
    `final_logit_softcapping`: c * tanh(x / c));
  - Gemma 3: per-head RMSNorm of q and k before the rotation, and rotary bases per layer type
    (`rope_parameters["sliding_attention"]`, the old `rope_local_base_freq`, for local layers).

Every projection, the embedding and the head are tensor parallel (`parallel.py`), as in Llama, and
pipeline stages split the layers as Llama's do (one residual stream travels between stages).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..attention import ForwardContext
from ..distributed import get_pp
from ..loaders.packing import load_packed_weights
from .base import CausalLM
from .layers import Attention, RotaryEmbedding, activation
from .parallel import PackedLinear, RowParallelLinear, gather_logits, stage_embedding, stage_lm_head
from .pipeline import IntermediateTensors, build_stage_layers, held_by_other_stage, stage_layers
from .sliding_window import layer_sliding_windows


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        # Checkpoints store the offset from 1, so zeros are the identity scale.
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Scaling before the cast back (Llama casts first) is what Gemma was trained with.
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        self.head_dim = config.head_dim
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias,
                                     unit=self.head_dim)
        self.q_size, self.kv_size = self.qkv_proj.shards["q"][1], self.qkv_proj.shards["k"][1]
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=config.query_pre_attn_scalar ** -0.5,
                              sliding_window=layer_sliding_windows(config)[layer_idx],
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v, ctx)
        return self.o_proj(out)


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate": size, "up": size}, bias=False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)
        self.act = activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_idx, rotary, qk_norm)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), ctx)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


def _rotaries(config, max_positions: int, dtype: torch.dtype) -> list[RotaryEmbedding]:
    """Each layer's rotary tables: one set per layer type when `rope_parameters` differ per type
    (Gemma 3), else one set for all layers."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    rope = getattr(config, "rope_parameters", None) or {}
    per_type = all(kind in rope for kind in layer_types)
    tables = {kind: RotaryEmbedding(config, config.head_dim, max_positions, dtype, kind if per_type else None)
              for kind in (set(layer_types) if per_type else {None})}
    return [tables[kind if per_type else None] for kind in layer_types]


class GemmaDecoderModel(nn.Module):
    """The decoder stack, or this pipeline stage's run of it: the first stage embeds, the last
    (which keeps the tied embedding for its head) applies the final norm, and a stage hands the
    next its one residual stream (`pipeline_streams` 1)."""

    def __init__(self, config, max_positions: int, dtype: torch.dtype, qk_norm: bool, tied: bool):
        super().__init__()
        pp = get_pp()
        self.embed_tokens = stage_embedding(config.vocab_size, config.hidden_size, tied)
        # fp32 here, cast to the model dtype at use, as transformers does (bf16 rounds sqrt(hidden)).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)
        rotaries = _rotaries(config, max_positions, dtype)
        self.layers = build_stage_layers(config.num_hidden_layers,
                                         lambda i: GemmaDecoderLayer(config, i, rotaries[i], qk_norm))
        self.stage_layers = stage_layers(config.num_hidden_layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)

    def forward(self, input_ids, positions, ctx: ForwardContext, inputs_embeds: torch.Tensor | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """`inputs_embeds`: scaled token embeddings with image rows merged in (Gemma 3's vision model)."""
        if intermediate is not None:
            hidden = intermediate.hidden
        else:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for index in self.stage_layers:
            hidden = self.layers[index](positions, hidden, ctx)
        return IntermediateTensors(hidden) if self.norm is None else self.norm(hidden)


class Gemma2ForCausalLM(CausalLM):
    qk_norm = False
    supports_pipeline_parallel = True
    pipeline_streams = 1

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.model = GemmaDecoderModel(config, max_positions, dtype, self.qk_norm, self.tie_word_embeddings)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.lm_head = stage_lm_head(config.hidden_size, config.vocab_size, self.model.embed_tokens,
                                     self.tie_word_embeddings)

    def forward(self, input_ids, positions, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, ctx, intermediate=intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.lm_head(hidden), self.config.vocab_size).float()
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.skips_weight)

    def skips_weight(self, name: str) -> bool:
        """Checkpoint tensors the model does not hold: rotary buffers, a tied head, other pipeline
        stages' parts."""
        return ("rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight")
                or held_by_other_stage(self, name))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (`gemma3_text` configs): Gemma 2's layout plus q/k norms and per-type
    rotary bases; its configs set no soft caps, which the shared code honours where they do."""

    qk_norm = True
