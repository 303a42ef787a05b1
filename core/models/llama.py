"""Llama-family decoder models over packed tokens and the paged KV cache.

One implementation serves Llama 2/3 (incl. Llama-3 RoPE scaling), SmolLM2, TinyLlama, Mistral
(with its sliding window), Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm); the subclasses in
`qwen.py` only switch features on. Every projection is tensor parallel (`parallel.py`). Each
layer's attention keeps to the window the config gives it (`sliding_window.py`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..attention import ForwardContext
from ..distributed import get_pp
from ..loaders.packing import load_packed_weights
from .base import CausalLM
from .kernels import UsesLayerKernels
from .layers import Attention, RMSNorm, RotaryEmbedding
from .pipeline import IntermediateTensors, build_stage_layers, held_by_other_stage, stage_input, stage_layers
from .parallel import (
    PackedLinear,
    RowParallelLinear,
    gather_logits,
    stage_embedding,
    stage_lm_head,
)
from .sliding_window import layer_sliding_windows


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    """Self-attention over this rank's heads (all of them at tensor-parallel size 1)."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim(config)
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size},
                                     bias=qkv_bias, unit=self.head_dim)
        self.q_size, self.kv_size = self.qkv_proj.shards["q"][1], self.qkv_proj.shards["k"][1]
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              sliding_window=layer_sliding_windows(config)[layer_idx])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
        # A backend that fuses the rotation into its cache write gets q and k unrotated.
        rotation = self.rotary.deferred(positions, ctx, norms)
        if rotation is None:
            q, k = self.rotary(positions, q.view(-1, self.num_heads, self.head_dim),
                               k.view(-1, self.num_kv_heads, self.head_dim), norms)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v, ctx, rotation)
        return self.o_proj(out)


class GatedMLP(UsesLayerKernels, nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            gate_up = self.gate_up_proj(x)
            # A quantized down projection may form the activation as it loads it (one launch fewer).
            out = self.down_proj.forward_gated(gate_up)
            return self.down_proj(self.kernels.silu_and_mul(gate_up)) if out is None else out
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(UsesLayerKernels, nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 mlp: nn.Module, attention: type[DecoderAttention] = DecoderAttention):
        super().__init__()
        self.self_attn = attention(config, layer_idx, rotary, qkv_bias, qk_norm)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        if self.kernels is not None and self.kernels.decoder_layer is not None:
            fused = self.kernels.decoder_layer(self, positions, hidden, residual, ctx)
            if fused is not None:
                return fused
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """The decoder stack, or this pipeline stage's run of it (`corectl.models.pipeline`): only
    the first stage embeds tokens and only the last applies the final norm; a stage after the
    first continues from the previous stage's `IntermediateTensors`, and one before the last
    returns its own."""

    # Layers whose input (the residual stream: embeddings plus every earlier layer's output) the
    # forward also returns, for an EAGLE-3 head (corectl.spec_decode.eagle_heads): set at load.
    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(self, config, max_positions: int, dtype: torch.dtype, qkv_bias: bool, qk_norm: bool,
                 make_mlp: Callable[[object, int], nn.Module], attention: type[DecoderAttention] = DecoderAttention):
        super().__init__()
        pp = get_pp()
        self.embed_tokens = stage_embedding(config.vocab_size, config.hidden_size,
                                            bool(getattr(config, "tie_word_embeddings", False)))
        # One set of cos/sin tables for every layer: they are identical.
        rotary = RotaryEmbedding(config, head_dim(config), max_positions, dtype)
        self.layers = build_stage_layers(
            config.num_hidden_layers,
            lambda i: DecoderLayer(config, i, rotary, qkv_bias, qk_norm, make_mlp(config, i), attention))
        self.stage_layers = stage_layers(config.num_hidden_layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None

    def forward(self, input_ids, positions, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """[T, hidden] after the final norm; with `aux_hidden_layers`, [T, (1 + n) * hidden]: those
        rows, then each listed layer's input in layer order (one tensor, so that a captured CUDA
        graph's output holds them too)."""
        hidden, residual = stage_input(self.embed_tokens, input_ids, intermediate)
        aux = []
        for index in self.stage_layers:
            if index in self.aux_hidden_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[index](positions, hidden, residual, ctx)
        if self.norm is None:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return torch.cat([hidden, *aux], dim=-1) if aux else hidden


class LlamaForCausalLM(CausalLM):
    supports_pipeline_parallel = True
    qkv_bias = False
    qk_norm = False
    # Each layer's attention module (a subclass changes how q and k are rotated, e.g. Llama 4).
    attention_class = DecoderAttention

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = DecoderModel(config, max_positions, dtype, qkv_bias, self.qk_norm, self.make_mlp,
                                  self.attention_class)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = stage_lm_head(config.hidden_size, config.vocab_size, self.model.embed_tokens,
                                     self.tie_word_embeddings)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP (mixture-of-experts models choose per layer)."""
        return GatedMLP(config)

    def forward(self, input_ids, positions, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden).float(), self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.skips_weight)

    def skips_weight(self, name: str) -> bool:
        """Checkpoint tensors the model does not hold: rotary buffers, a tied head, other pipeline
        stages' parts."""
        return ("rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")
                or held_by_other_stage(self, name))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with a sliding window (`sliding_window`, every layer) where the config sets one."""
