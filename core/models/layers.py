"""Building blocks shared by the built-in models.

Numerics follow the Hugging Face implementations operation for operation (RMSNorm in fp32, rotary
embedding as `x * cos + rotate_half(x) * sin` with cos/sin cast to the model dtype) so that greedy
decoding is token-exact against `transformers` in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from ..attention import ForwardContext, Rotation
from ..errors import ConfigError
from .kernels import UsesLayerKernels

__all__ = ["Attention", "RMSNorm", "RotaryEmbedding", "activation"]


def activation(name: str) -> nn.Module:
    """Hugging Face's activation module named `name` (its `ACT2FN`). Imported on first use:
    `transformers.activations` pulls in its modeling stack, seconds of start-up for every process."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class RMSNorm(UsesLayerKernels, nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.kernels is not None:
            return self._fused(x, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None):
        # The kernel normalises rows of a 2-D tensor; per-head norms (Qwen3's q/k) arrive as [T, H, D].
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:
            return self.kernels.rms_norm(rows, self.weight, self.eps, None).view(x.shape)
        out, summed = self.kernels.rms_norm(rows, self.weight, self.eps, residual.reshape(rows.shape))
        return out.view(x.shape), summed.view(x.shape)


class RotaryEmbedding(UsesLayerKernels, nn.Module):
    """cos/sin tables for every position up to `max_positions`, looked up by absolute position.

    `layer_type` picks one entry of a config whose `rope_parameters` differ per layer type
    (Gemma 3: "sliding_attention" and "full_attention" layers rotate with different bases).
    A `partial_rotary_factor` below 1 rotates the first `rotary_dim` features of each head and
    passes the rest (Phi-4-mini). LongRoPE (Phi-3/Phi-4) rotates positions below
    `original_max_position_embeddings` with the short factors and later ones with the long factors:
    a fixed table per position, so cached keys never change. transformers switches a whole forward
    on its last position, which agrees with this wherever the prompt fits the original length
    (decoding past it included); a prompt longer than that keeps short factors for its first
    positions here, where transformers would rotate all of them with the long ones."""

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype, layer_type: str | None = None):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {}
        if layer_type is not None:
            rope = rope[layer_type]
        rope_type = rope.get("rope_type", "default")
        self.rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        positions = torch.arange(max_positions, dtype=torch.float)[:, None]
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = self.rotary_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
        freqs = positions * inv_freq[None, :]
        if rope_type == "longrope":
            original = rope["original_max_position_embeddings"]
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=original + 1, layer_type=layer_type)
            freqs = torch.where(positions < original, freqs, positions * long_inv_freq[None, :])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)
        self.partial = self.rotary_dim < head_dim

    def deferred(self, positions: torch.Tensor, ctx: ForwardContext,
                 norms: tuple["RMSNorm", "RMSNorm"] | None = None) -> Rotation | None:
        """This rotation (and `norms`, as `forward` takes them) for the step's backend to apply as
        it stores the keys, where it `fuses_rotary` in this step and fused kernels rotate these
        heads here too (whole heads, every norm fusable); None: the layer rotates with `forward`."""
        kernels = None if self.partial else self.kernels
        if (kernels is None or (norms is not None and kernels.qk_norm_rotary is None)
                or not ctx.backend.fuses_rotary(ctx.metadata)):
            return None
        if norms is None:
            return Rotation(positions, self.cos, self.sin)
        q_norm, k_norm = norms
        return Rotation(positions, self.cos, self.sin, q_norm.weight, k_norm.weight, q_norm.eps)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                norms: tuple["RMSNorm", "RMSNorm"] | None = None):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated q, k (the same tensors, rotated in place, when
        fused kernels are installed). `norms`: per-head RMSNorms of q and k to apply first (Qwen3).
        The fused kernels rotate whole heads, so a partial rotation keeps the torch code."""
        kernels = None if self.partial else self.kernels
        if kernels is not None and norms is not None and kernels.qk_norm_rotary is not None:
            q_norm, k_norm = norms
            kernels.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.cos, self.sin)
            return q, k
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        if kernels is not None:
            kernels.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.partial:
            return _rotate_part(q, cos, sin, self.rotary_dim), _rotate_part(k, cos, sin, self.rotary_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Routes one layer's attention to the platform's backend and its slice of the paged KV cache.

    `sliding_window` (tokens, None = global) and `logits_soft_cap` are the layer's own
    (`corectl.attention.AttentionBackend.forward` says what they mean); `scale` defaults to
    head_dim ** -0.5; `attention_chunk` (tokens) keeps each query to its own chunk (Llama 4's local
    layers). A model with attention sinks calls `add_sinks`."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 scale: float | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, attention_chunk: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_chunk = attention_chunk
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks: nn.Parameter | None = None

    def add_sinks(self, first_head: int, total_heads: int) -> None:
        """A learned sink logit per query head (gpt-oss); this rank holds heads first_head.. of the
        checkpoint's `total_heads`, loaded from the checkpoint's per-layer `sinks` [total_heads]."""
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.first_head, self.total_heads = first_head, total_heads
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.total_heads,):
            raise ValueError(f"sinks: expected ({self.total_heads},), checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.first_head, self.num_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
                rotation: Rotation | None = None) -> torch.Tensor:
        """`rotation`: q and k still unrotated, for a backend that fuses it (`RotaryEmbedding.deferred`)."""
        extra = {} if rotation is None else {"rotation": rotation}
        if self.sinks is not None:
            _require(ctx.backend, "supports_sinks", "attention has sinks (gpt-oss)", "torch_sdpa on CPUs, triton on GPUs")
            extra["sinks"] = self.sinks
        if self.attention_chunk is not None:
            _require(ctx.backend, "supports_chunked_attention", "attention has chunked local layers (Llama 4)",
                     "torch_sdpa on CPUs, triton on GPUs")
            extra["attention_chunk"] = self.attention_chunk
        return ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale,
                                   sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap, **extra)


def _require(backend, flag: str, what: str, backends: str) -> None:
    if not getattr(backend, flag):
        raise ConfigError("model", f"this model's {what}, which the {backend.name!r} attention backend does not "
                          f"implement; use one that does ({backends})")
