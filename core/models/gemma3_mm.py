"""Gemma 3 vision-language (`Gemma3ForConditionalGeneration`): a SigLIP vision tower and a projector
in front of Gemma 3's text model (`gemma.py`).

An image (the processor's fixed square, `vision_config.image_size`) becomes patches -> SigLIP
encoder -> average-pooled to `mm_tokens_per_image` rows -> RMS-normed ("soft embedding norm") ->
projected to the text width. The rows replace the image's placeholder tokens after the token
embeddings were scaled by sqrt(hidden), as transformers does. Within one image the prompt's tokens
attend to each other both ways at prefill (`bidirectional_image_tokens`): the scheduler keeps an
image's tokens in one chunk and the worker hands their spans to the attention backend
(`AttentionBatch.bidirectional_spans`). Numerics follow transformers operation for operation.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ..attention import ForwardContext
from ..distributed import get_pp
from ..loaders.packing import default_weight_loader, load_packed_weights
from ..multimodal.inputs import MultiModalInput
from .gemma import Gemma3ForCausalLM, GemmaRMSNorm
from .layers import activation
from .pipeline import IntermediateTensors

# Checkpoint prefixes, newest first: transformers >= 4.52 nests the parts under `model.`; the tower's
# own `vision_model.` level comes and goes with the SigLIP class's version.
_TOWER = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")
_LANGUAGE = ("model.language_model.", "language_model.model.")
_HEAD = ("language_model.lm_head.", "lm_head.")


class SiglipAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (proj(x).view(n, t, self.num_heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, -1))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, config.intermediate_size)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, dim)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class SiglipVisionTower(nn.Module):
    """[N, 3, S, S] pixels -> [N, (S / patch)^2, width]: patch embedding plus learned positions,
    the encoder layers (full attention within each image), a final LayerNorm."""

    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(config.num_channels, dim, config.patch_size, config.patch_size)
        num_patches = (config.image_size // config.patch_size) ** 2
        self.embeddings.position_embedding = nn.Embedding(num_patches, dim)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(dim, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.embeddings.patch_embedding(pixels.to(self.embeddings.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2) + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """Tower rows -> average-pooled to mm_tokens_per_image -> soft-embedding norm -> text width."""

    def __init__(self, config):
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        self.kernel = self.patches_per_side // int(config.mm_tokens_per_image ** 0.5)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        n, _, width = rows.shape
        grid = rows.transpose(1, 2).reshape(n, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(rows)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's text model on `config.text_config`; `vision_tower` and `multi_modal_projector`
    encode images."""

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__(config.get_text_config(), max_positions, dtype)
        self.hf_config = config
        # Pipeline stages: the first encodes images (it merges their rows).
        first = get_pp().is_first
        self.vision_tower = SiglipVisionTower(config.vision_config) if first else None
        self.multi_modal_projector = Gemma3Projector(config) if first else None
        # An image's tokens attend to each other both ways: the longest such run, for the scheduler.
        self.bidirectional_image_tokens = config.mm_tokens_per_image

    def forward(self, input_ids, positions, ctx: ForwardContext, intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, ctx, inputs_embeds, intermediate)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def encode_images(self, items: list[MultiModalInput]) -> list[torch.Tensor]:
        """Each image's mm_tokens_per_image rows, the images encoded as one batch."""
        device = self.multi_modal_projector.mm_input_projection_weight.device
        pixels = torch.cat([item.pixels() for item in items]).to(device)
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision = {} if self.vision_tower is None else {
            **{"vision_tower." + k: p for k, p in self.vision_tower.named_parameters()},
            **{"multi_modal_projector." + k: p for k, p in self.multi_modal_projector.named_parameters()}}
        loaded: set[str] = set()

        def language():
            for name, tensor in weights:
                local = _rename(name)
                if local.startswith("vision_tower.head."):
                    continue  # SigLIP's pooling head: Gemma 3 reads the tower's rows, not its pooled vector
                if local.startswith(("vision_tower.", "multi_modal_projector.")):
                    if self.vision_tower is None:  # a pipeline stage after the first
                        continue
                    if local not in vision:
                        raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in the vision model")
                    default_weight_loader(vision[local], tensor)
                    loaded.add(local)
                else:
                    yield local, tensor

        return load_packed_weights(self, language(), self.skips_weight) | loaded


def _rename(name: str) -> str:
    """A checkpoint tensor's name in this model, whichever transformers version saved it."""
    for prefixes, to in ((_TOWER, "vision_tower."), (_PROJECTOR, "multi_modal_projector."),
                         (_LANGUAGE, "model."), (_HEAD, "lm_head.")):
        for prefix in prefixes:
            if name.startswith(prefix):
                return to + name[len(prefix):]
    return name
