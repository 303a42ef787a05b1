"""Gemma (v1) decoder models for corectl, built from corectl's public layers.

Gemma differs from Llama in four places, each following `transformers`' GemmaForCausalLM
operation for operation so greedy decoding is token-exact in fp32:
  - RMSNorm scales by (1 + weight), computed in fp32 and cast back afterwards;
  - the MLP gate uses GELU (tanh approximation) instead of SiLU;
  - token embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
  - head_dim comes from the config and need not be hidden_size / num_heads.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.activations import ACT2FN

from corectl.attention import ForwardContext
from corectl.models.base import CausalLM
from corectl.models.gemma import GemmaRMSNorm  # core's building blocks are there for plugins too
from corectl.loaders.packing import load_packed_weights
from corectl.models.layers import Attention, RotaryEmbedding
from corectl.models.parallel import PackedLinear


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary(positions, q.view(-1, self.num_heads, self.head_dim),
                      k.view(-1, self.num_kv_heads, self.head_dim))
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v, ctx)
        return self.o_proj(out)


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate": size, "up": size}, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        # GemmaConfig already maps the legacy "gelu" to the tanh approximation Gemma was trained with.
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, rotary: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), rotary, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GemmaModel(nn.Module):
    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # One cos/sin table for all layers: at Gemma-7B's 8192 positions a table per layer costs ~0.3 GB.
        self.rotary = RotaryEmbedding(config, config.head_dim, max_positions, dtype)
        # fp32 here, cast to the model dtype at use: bf16 Gemma multiplies by sqrt(3072) rounded to 55.5.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32),
                             persistent=False)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden, self.rotary, ctx)
        return self.norm(hidden)


class GemmaForCausalLM(CausalLM):
    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, max_positions, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, lambda name: self.tie_word_embeddings and name == "lm_head.weight")
