"""Multi-head latent attention (DeepSeek V2/V3's MLA) over a latent paged cache, up-projections absorbed.

As transformers computes it: q from `q_proj` (V2-Lite) or `q_a_proj` -> RMSNorm -> `q_b_proj`,
[nope | rope] per head; a latent `kv_a_proj_with_mqa` [kv_lora_rank | rope] whose first part is
RMSNormed into c_kv and expanded per head by `kv_b_proj` into keys' nope part (W_UK) and values
(W_UV), the rope part rotated once and shared by every head. Only the rope features rotate
(pairwise for V2 and V3's `rope_interleave`, halves otherwise); YaRN's mscale enters the scale.

Here the expansion never happens. The cache holds each token's [c_kv | rotated k_rope] once
(`KVCacheLayout(1, rank + rope, parts=1)`: 576 numbers per token and layer at V2/V3 shapes,
against 2 x heads x 192 expanded), and attention runs in the latent space: q_nope W_UK^T is a
latent query, q_latent . c_kv + q_rope . k_rope the score (the same number as q . k expanded), the
softmax-weighted c_kv the latent output, W_UV per head then o_proj its projection. Prefill and
decode both take this absorbed form (`AttentionBackend.forward_latent`), so chunked prefills and
prefix-cache hits read the same latent rows; it costs prefill more arithmetic per key than an
expanded kernel would (rank + rope against nope + rope per head). W_UK and W_UV are read out of
`kv_b_proj` once its weights are loaded (`absorb_weights`), through the layer's own forward, so a
quantized `kv_b_proj` (FP8, block-FP8) is dequantized once into them by its own method.
"""
from __future__ import annotations

import torch
from torch import nn

from ..attention import ForwardContext, KVCacheLayout
from .layers import RMSNorm, RotaryEmbedding, _rotate_half
from .llama4 import rotate_pairs
from .parallel import RowParallelLinear


def latent_cache_layout(config) -> KVCacheLayout:
    """One row per token and layer: the latent and the shared rotary key part."""
    return KVCacheLayout(1, config.kv_lora_rank + config.qk_rope_head_dim, parts=1)


class MLAttention(nn.Module):
    """Multi-head latent attention over the latent cache, up-projections absorbed (module doc)."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, interleave: bool):
        super().__init__()
        h, hidden = config.num_attention_heads, config.hidden_size
        self.layer_idx, self.num_heads = layer_idx, h
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope + self.rope
        bias = getattr(config, "attention_bias", False)
        # At one rank (the model refuses more) a RowParallelLinear is a plain linear layer that a
        # quantization method can serve: V3's FP8 checkpoints quantize these projections too.
        if config.q_lora_rank is None:
            # `q_full_proj` holds the checkpoint's `q_proj` (the packed loader would take that name).
            self.q_full_proj = RowParallelLinear(hidden, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = RowParallelLinear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = RowParallelLinear(config.q_lora_rank, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = RowParallelLinear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = RowParallelLinear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(h * self.v_dim, hidden, bias=bias)
        self.rotary, self.interleave = rotary, interleave
        # Imported here: transformers' DeepSeek module costs ~1.5 s, paid only by a DeepSeek engine.
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

        self.scale = yarn_apply_mscale(getattr(config, "rope_parameters", None) or {}, self.qk_dim ** -0.5)
        # Filled by `absorb_weights` once the weights are loaded; buffers, so `corectl plan` counts them.
        self.register_buffer("w_uk", torch.empty(h, self.nope, self.rank), persistent=False)
        self.register_buffer("w_uv", torch.empty(h, self.rank, self.v_dim), persistent=False)

    @torch.no_grad()
    def absorb_weights(self) -> None:
        """W_UK and W_UV out of the loaded `kv_b_proj`, read as its output on the identity (W^T)."""
        norm = self.kv_a_layernorm.weight
        eye = torch.eye(self.rank, dtype=norm.dtype, device=norm.device)
        w = self.kv_b_proj(eye).t().reshape(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk.copy_(w[:, :self.nope])
        self.w_uv.copy_(w[:, self.nope:].transpose(1, 2))

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary.cos[positions].unsqueeze(1), self.rotary.sin[positions].unsqueeze(1)
        if self.interleave:
            half = self.rope // 2
            return rotate_pairs(x, cos[..., :half], sin[..., :half])
        return x * cos + _rotate_half(x) * sin

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h = hidden.shape[0], self.num_heads
        if hasattr(self, "q_full_proj"):
            q = self.q_full_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rot = q.view(t, h, self.qk_dim).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        k_rot = self._rotate(k_rot.reshape(t, 1, self.rope), positions).view(t, self.rope)
        rows = torch.cat((self.kv_a_layernorm(latent), k_rot), dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, self._rotate(q_rot, positions)), dim=-1)
        out = ctx.backend.forward_latent(query, rows, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale,
                                         value_dim=self.rank)
        out = torch.bmm(out.transpose(0, 1), self.w_uv).transpose(0, 1)
        return self.o_proj(out.reshape(t, h * self.v_dim))
