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

V2 (and V3 with `rope_interleave`) rotates the rope features in pairs (2i, 2i + 1). With dense
projections, loading reorders their rope output rows into halves (evens, then odds) in q's and
k's projection alike: scores are unchanged (the same permutation on both sides of each dot
product) and the rotation becomes the rotate-half one that `RotaryEmbedding` and the installed
rotary kernel run, one launch for q and k a layer in place of about twenty small torch kernels.
Quantized projections keep their rows and the pairwise torch rotation.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..attention import ForwardContext, KVCacheLayout
from ..distributed import get_tp, shard_range
from .layers import RMSNorm, RotaryEmbedding
from .llama4 import rotate_pairs
from .parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear


def yarn_softmax_scale(rope_parameters: dict, scale: float) -> float:
    """transformers' `yarn_apply_mscale` (DeepSeek V2/V3): YaRN's mscale of `mscale_all_dim`,
    squared, into the softmax scale. Written out rather than imported: importing transformers'
    modeling code for the first time while the worker builds a model (its `_no_random_init` stands
    in for torch's init functions) makes transformers record the stand-ins as torch's, and every
    transformers model made later in the process would skip its initialisation."""
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    if rope_parameters.get("rope_type", "default") == "default" or not mscale_all_dim:
        return scale
    factor = rope_parameters["factor"]
    mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


def latent_cache_layout(config) -> KVCacheLayout:
    """One row per token and layer: the latent and the shared rotary key part."""
    return KVCacheLayout(1, config.kv_lora_rank + config.qk_rope_head_dim, parts=1)


class MLAttention(nn.Module):
    """Multi-head latent attention over the latent cache, up-projections absorbed (module doc)."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, interleave: bool):
        super().__init__()
        h, hidden = config.num_attention_heads, config.hidden_size
        tp = get_tp()
        # Tensor parallelism splits the heads: each rank expands, attends and projects its own,
        # from the latent every rank computes and caches whole; o_proj sums the ranks' parts.
        self.layer_idx, self.num_heads = layer_idx, shard_range(h, tp.rank, tp.world_size)[1]
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope + self.rope
        bias = getattr(config, "attention_bias", False)
        if config.q_lora_rank is None:
            # `q_full_proj` holds the checkpoint's `q_proj` (the packed loader would take that name).
            self.q_full_proj = ColumnParallelLinear(hidden, h * self.qk_dim, bias=False, unit=self.qk_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, h * self.qk_dim, bias=False, unit=self.qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, h * (self.nope + self.v_dim), bias=False,
                                              unit=self.nope + self.v_dim)
        self.o_proj = RowParallelLinear(h * self.v_dim, hidden, bias=bias)
        self.rotary, self.interleave = rotary, interleave
        self.scale = yarn_softmax_scale(getattr(config, "rope_parameters", None) or {}, self.qk_dim ** -0.5)
        # Filled by `absorb_weights` once the weights are loaded; buffers, so `corectl plan` counts them.
        self.register_buffer("w_uk", torch.empty(self.num_heads, self.nope, self.rank), persistent=False)
        self.register_buffer("w_uv", torch.empty(self.num_heads, self.rank, self.v_dim), persistent=False)

    @torch.no_grad()
    def absorb_weights(self) -> None:
        """W_UK and W_UV out of the loaded `kv_b_proj`, read as its output on the identity (W^T);
        pairwise-rotated rope features of dense projections reordered into halves (module doc)."""
        norm = self.kv_a_layernorm.weight
        eye = torch.eye(self.rank, dtype=norm.dtype, device=norm.device)
        w = self.kv_b_proj(eye).t().reshape(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk.copy_(w[:, :self.nope])
        self.w_uv.copy_(w[:, self.nope:].transpose(1, 2))
        q_proj = self.q_full_proj if hasattr(self, "q_full_proj") else self.q_b_proj
        if self.interleave and all(layer.quant_method is None for layer in (q_proj, self.kv_a_proj_with_mqa)):
            self._rope_rows_to_halves(q_proj, self.kv_a_proj_with_mqa)
            self.interleave = False

    def _rope_rows_to_halves(self, q_proj: nn.Module, kv_a_proj: nn.Module) -> None:
        """Reorder the rope output rows of both projections from pairs (2i, 2i + 1) to halves (i,
        i + rope / 2): the same permutation of q's and k's rope features leaves every score as it
        was, and a pair rotation of the old order is a rotate-half of the new one."""
        order = torch.cat((torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2))).to(q_proj.weight.device)
        per_head = q_proj.weight.view(self.num_heads, self.qk_dim, -1)[:, self.nope:]
        per_head.copy_(per_head[:, order])
        for tensor in (kv_a_proj.weight, getattr(kv_a_proj, "bias", None)):
            if tensor is not None:
                tensor[self.rank:].copy_(tensor[self.rank:][order])

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, rope] and k [T, 1, rope] rotated: rotate-half by the shared rotary module (the
        installed kernel rotates both in place, in one launch), pairwise where the rows keep pairs."""
        if not self.interleave:
            return self.rotary(positions, q, k)
        cos, sin = self.rotary.cos[positions].unsqueeze(1), self.rotary.sin[positions].unsqueeze(1)
        half = self.rope // 2
        return rotate_pairs(q, cos[..., :half], sin[..., :half]), rotate_pairs(k, cos[..., :half], sin[..., :half])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h = hidden.shape[0], self.num_heads
        if hasattr(self, "q_full_proj"):
            q = self.q_full_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rot = q.view(t, h, self.qk_dim).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        q_rot, k_rot = self._rotate(positions, q_rot, k_rot.unsqueeze(1))
        rows = torch.cat((self.kv_a_layernorm(latent), k_rot.squeeze(1)), dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_rot), dim=-1)
        out = ctx.backend.forward_latent(query, rows, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale,
                                         value_dim=self.rank)
        out = torch.bmm(out.transpose(0, 1), self.w_uv).transpose(0, 1)
        return self.o_proj(out.reshape(t, h * self.v_dim))
