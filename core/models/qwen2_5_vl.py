"""Qwen2.5-VL: a ViT with window attention and a patch merger in front of a Qwen2 language model
whose rotary embedding is M-RoPE (three position rows: temporal, height, width).

The tower takes the images of a step packed one after another (each its own attention segment)
and returns, per image, one row per placeholder token; the worker merges them into the prompt's
embeddings (`corectl.multimodal.step`). Text tokens carry the same position on all three rows; an
image's tokens carry their grid coordinates offset by the text before them, and every token after
an image continues from the image's largest coordinate (`mrope_positions`). Numerics follow
transformers' `Qwen2_5_VLForConditionalGeneration` operation for operation.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..attention import ForwardContext
from ..distributed import get_pp
from ..loaders.packing import default_weight_loader, load_packed_weights
from ..multimodal.inputs import MultiModalInput
from .layers import RMSNorm, RotaryEmbedding, _rotate_half, activation
from .llama import LlamaForCausalLM, head_dim
from .pipeline import IntermediateTensors, held_layers

# Checkpoint prefixes: transformers >= 4.52 nests both parts under `model.`, older files do not.
_VISUAL = ("model.visual.", "visual.")
_LANGUAGE = ("model.language_model.", "model.")


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over three position rows: frequency i of a head rotates by the row its `mrope_section`
    assigns (temporal, height, width in turn). One position row is the ordinary rotation."""

    def __init__(self, config, head_size: int, max_positions: int, dtype: torch.dtype):
        super().__init__(config, head_size, max_positions, dtype)
        section = config.rope_parameters["mrope_section"]
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(section), output_size=sum(section))
        self.register_buffer("row_of_feature", torch.cat([rows, rows]), persistent=False)

    def deferred(self, positions: torch.Tensor, ctx, norms=None):
        # A backend's fused rotation takes one position row: three rows rotate here.
        return super().deferred(positions, ctx, norms) if positions.dim() == 1 else None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, norms=None):
        if positions.dim() == 1:
            return super().forward(positions, q, k, norms)
        features = torch.arange(self.cos.shape[-1], device=positions.device)
        by_feature = positions[self.row_of_feature]            # [D, T]: each feature's position row
        cos = self.cos[by_feature.T, features].unsqueeze(1)
        sin = self.sin[by_feature.T, features].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        dtype = q.dtype
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(dtype)
        out = torch.empty_like(q)
        # Each image (and each window of a windowed block) attends within itself only; segments of
        # one length (most windows of an image) run as one batched call.
        starts, lengths = np.asarray(cu_seqlens[:-1]), np.diff(cu_seqlens)
        for length in np.unique(lengths):
            rows = torch.from_numpy((starts[lengths == length][:, None] + np.arange(length)).reshape(-1))
            rows = rows.to(x.device)
            heads = [t[rows].view(-1, int(length), self.num_heads, t.shape[-1]).transpose(1, 2) for t in (q, k, v)]
            out[rows] = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(-1, self.num_heads, q.shape[-1])
        return self.proj(out.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, 1e-6)
        self.norm2 = RMSNorm(config.hidden_size, 1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, context_dim: int, merge_size: int):
        super().__init__()
        self.hidden_size = context_dim * merge_size ** 2
        self.ln_q = RMSNorm(context_dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class VisionTransformer(nn.Module):
    """Patches -> blocks (windowed, except `fullatt_block_indexes`) -> merged tokens."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(config.in_channels, config.hidden_size, bias=False,
                                          kernel_size=[config.temporal_patch_size, *[config.patch_size] * 2])
        spatial_dim = config.hidden_size // config.num_heads // 2
        theta = config.rope_parameters["rope_theta"] if getattr(config, "rope_parameters", None) else 10000.0
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge)

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        weight = self.patch_embed.proj.weight
        x = F.linear(pixels.to(weight.dtype).view(-1, self.patch_dim), weight.view(weight.shape[0], -1))
        window_index, cu_windows = self._window_index(grids)
        unit = self.merge ** 2
        x = x.view(-1, unit, x.shape[-1])[window_index].view(-1, x.shape[-1])
        freqs = self._rotary_freqs(grids).to(x.device)
        freqs = freqs.view(-1, unit, freqs.shape[-1])[window_index].view(-1, freqs.shape[-1])
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        cu_full = np.cumsum([0] + [h * w for t, h, w in grids for _ in range(t)]).tolist()
        for index, block in enumerate(self.blocks):
            full = index in self.config.fullatt_block_indexes
            x = block(x, cu_full if full else cu_windows, cos, sin)
        return self.merger(x)[torch.argsort(window_index)]

    def _rotary_freqs(self, grids: list[list[int]]) -> torch.Tensor:
        """[patches, head_dim / 2]: each patch's height then width frequencies, patches ordered
        merge block by merge block as the processor lays them out."""
        rows = []
        m = self.merge
        for t, h, w in grids:
            hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            blocks = (h // m, m, w // m, m)
            pos = np.stack([p.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1) for p in (hpos, wpos)], -1)
            rows.append(np.tile(pos, (t, 1)))
        pos = torch.from_numpy(np.concatenate(rows))
        freqs = pos[..., None].float() * self.inv_freq.cpu()
        return freqs.flatten(1)

    def _window_index(self, grids: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """The merged-token order that groups each window's tokens, and the window bounds (patches)."""
        window = self.config.window_size // self.merge // self.config.patch_size
        unit = self.merge ** 2
        order, bounds, first = [], [0], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = np.arange(t * gh * gw).reshape(t, gh, gw)
            for frame in index:
                for top in range(0, gh, window):
                    for left in range(0, gw, window):
                        cell = frame[top:top + window, left:left + window].reshape(-1)
                        order.append(cell + first)
                        bounds.append(bounds[-1] + cell.size * unit)
            first += t * gh * gw
        return torch.from_numpy(np.concatenate(order)), bounds


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """The language model is Qwen2 on `config.text_config`; `visual` encodes images. In pipeline
    stages the first holds the vision tower (it merges the image rows) and every stage computes
    M-RoPE's positions for its layers."""

    qkv_bias = True

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        text = config.get_text_config()
        super().__init__(text, max_positions, dtype)
        self.hf_config = config
        rotary = MRotaryEmbedding(text, head_dim(text), max_positions, dtype)
        for layer in held_layers(self.model):
            layer.self_attn.rotary = rotary
        self.visual = VisionTransformer(config.vision_config) if get_pp().is_first else None
        self.merge = config.vision_config.spatial_merge_size

    def forward(self, input_ids, positions, ctx: ForwardContext, intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """`inputs_embeds`: the step's token embeddings with image rows merged in (None: text only)."""
        if intermediate is None and inputs_embeds is not None:
            intermediate = IntermediateTensors(inputs_embeds)  # the embedded tokens, no residual yet
        return self.model(input_ids, positions, ctx, intermediate)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def encode_images(self, items: list[MultiModalInput]) -> list[torch.Tensor]:
        """Each image's rows for its placeholder tokens, the images encoded as one batch."""
        device = self.visual.patch_embed.proj.weight.device
        pixels = torch.cat([item.pixels() for item in items]).to(device)
        out = self.visual(pixels, [item.grid_thw for item in items])
        return list(out.split([item.length for item in items]))

    def mrope_positions(self, num_tokens: int, items: list[MultiModalInput]) -> tuple[np.ndarray, int]:
        """[3, num_tokens] positions of a prompt whose images are `items`, and the offset of every
        later position from its index (a token at index p >= num_tokens sits at p + offset)."""
        rows, current, last = [], 0, 0
        for item in items:
            rows.append(np.arange(item.offset - last)[None].repeat(3, 0) + current)
            current += item.offset - last
            t, h, w = item.grid_thw[0], item.grid_thw[1] // self.merge, item.grid_thw[2] // self.merge
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
            rows.append(grid + current)
            current += max(h, w)
            last = item.end
        rows.append(np.arange(num_tokens - last)[None].repeat(3, 0) + current)
        table = np.concatenate(rows, axis=1)
        return table, int(table.max()) + 1 - num_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        visual = {} if self.visual is None else dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def language():
            for name, tensor in weights:
                prefix = next((p for p in _VISUAL if name.startswith(p)), None)
                if prefix is None:
                    yield _language_name(name), tensor
                    continue
                if self.visual is None:  # a pipeline stage after the first
                    continue
                local = name[len(prefix):]
                if local not in visual:
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in the vision tower")
                default_weight_loader(visual[local], tensor)
                loaded.add("visual." + local)

        return load_packed_weights(self, language(), self.skips_weight) | loaded


def _language_name(name: str) -> str:
    for prefix in _LANGUAGE:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name
