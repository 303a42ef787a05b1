"""EAGLE and EAGLE-3 draft heads in their published checkpoint layouts, and the checks that a head
fits its target (the layouts vLLM's llama_eagle.py and llama_eagle3.py read).

EAGLE (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): a Llama config with one decoder layer; `fc`
(2h -> h, with a bias when the checkpoint has `fc.bias`, as EAGLE's training code makes it) over
concat(embedding of token p + 1, the target's final hidden state at p), then `layers.0` without
its input norm. Its output, un-normalised, gives the draft's logits through the target's LM head
and is the hidden state of the next draft step. The embedding and LM head are the target's.

EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `fc` (3h -> h, no bias) over the target's
hidden states at three layers (each layer's input, lowest first; layers 2, L // 2 and L - 3 of an
L-layer target, or the config's `eagle_aux_hidden_state_layer_ids`), one decoder layer
(`midlayer.*` or `layers.0.*`) whose attention reads concat(input_layernorm(embedding),
hidden_norm(hidden)) (2h) and whose residual is the fc output (`norm_before_residual`: the
normalised one), its own `norm` and `lm_head` over `draft_vocab_size` tokens, and `d2t`: draft
token i is target token i + d2t[i]. `t2d` (which target tokens the draft has) is not needed. The
embedding is the target's unless the checkpoint has its own `embed_tokens`. The next draft step
takes the layer's output before `norm`, without `fc`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..attention import ForwardContext
from ..errors import ConfigError
from ..loaders.checkpoint_files import tensor_names
from ..loaders.packing import load_packed_weights
from ..models.layers import RMSNorm, RotaryEmbedding
from ..models.llama import DecoderAttention, DecoderLayer, DecoderModel, GatedMLP, head_dim
from ..models.parallel import PackedLinear, ParallelLMHead, VocabParallelEmbedding, gather_logits

FIELD = "speculative_config"
EAGLE_METHODS = ("eagle", "eagle3")
# Checkpoint tensors a head does not hold: rotary buffers, t2d (EAGLE-3), the input norm that
# EAGLE skips, and (EAGLE) the copies of the target's embedding and LM head some repos ship.
_EAGLE_SKIPS = ("rotary_emb.inv_freq", "layers.0.input_layernorm.", "embed_tokens.", "lm_head.")
_EAGLE3_SKIPS = ("rotary_emb.inv_freq", "t2d")


def _qkv_bias(config) -> bool:
    """q/k/v biases: the config's `attention_bias`, or the checkpoint's (`eagle_qkv_bias`, a head
    for Qwen2, whose config does not say)."""
    return bool(getattr(config, "attention_bias", False) or getattr(config, "eagle_qkv_bias", False))


def _checkpoint_name(name: str) -> str:
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


class EagleHead(nn.Module):
    """EAGLE: fc over concat(embedding, target hidden), one Llama layer without its input norm."""

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        size = config.hidden_size
        self.fc = nn.Linear(2 * size, size, bias=bool(getattr(config, "eagle_fc_bias", False)))
        rotary = RotaryEmbedding(config, head_dim(config), max_positions, dtype)
        layer = DecoderLayer(config, 0, rotary, _qkv_bias(config), False, GatedMLP(config))
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])

    def embed(self, token_ids: torch.Tensor, target: nn.Module) -> torch.Tensor:
        return target.model.embed_tokens(token_ids)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows for the draft's logits, hidden state of the next draft step): both the layer's output."""
        out, residual = self.layers[0](positions, self.fc(torch.cat([embeds, hidden], dim=-1)), None, ctx)
        out = out + residual
        return out, out

    def draft_tokens(self, rows: torch.Tensor, target: nn.Module) -> torch.Tensor:
        return target.compute_logits(rows).argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((_checkpoint_name(name), tensor) for name, tensor in weights)
        return load_packed_weights(self, renamed, lambda name: any(s in name for s in _EAGLE_SKIPS))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over concat(normed embedding, normed hidden) (2h wide),
    the residual stream starting from the hidden input."""

    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        size, qkv_bias = config.hidden_size, _qkv_bias(config)
        self.self_attn = DecoderAttention(config, 0, rotary, qkv_bias, False)
        attn = self.self_attn
        attn.qkv_proj = PackedLinear(2 * size, attn.qkv_proj.full_sizes, bias=qkv_bias, unit=attn.head_dim)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(size, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        out = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), normed], dim=-1), ctx)
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Eagle3Head(nn.Module):
    """EAGLE-3: fc over three target layers' hidden states, one layer, its own norm and LM head
    over a draft vocabulary mapped to the target's by `d2t`."""

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        size = config.hidden_size
        target_size = getattr(config, "target_hidden_size", None) or size
        draft_vocab = draft_vocab_size(config)
        self.fc = nn.Linear(3 * target_size, size, bias=False)
        rotary = RotaryEmbedding(config, head_dim(config), max_positions, dtype)
        self.layers = nn.ModuleList([Eagle3Layer(config, rotary)])
        self.norm = RMSNorm(size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(size, draft_vocab)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        # Its own embedding when the checkpoint has one (`eagle_own_embedding`, set from its tensors).
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, size)
                             if getattr(config, "eagle_own_embedding", False) else None)

    def embed(self, token_ids: torch.Tensor, target: nn.Module) -> torch.Tensor:
        return (target.model.embed_tokens if self.embed_tokens is None else self.embed_tokens)(token_ids)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed rows for the draft's logits, the pre-norm rows for the next draft step);
        `from_target`: `hidden` holds the target's three layers (fc combines them)."""
        if from_target:
            hidden = self.fc(hidden)
        out, residual = self.layers[0](positions, embeds, hidden, ctx)
        return self.norm(out, residual)

    def draft_tokens(self, rows: torch.Tensor, target: nn.Module) -> torch.Tensor:
        # Split over tensor-parallel ranks, each holds a slice of the draft vocabulary.
        draft = gather_logits(self.lm_head(rows), draft_vocab_size(self.config)).argmax(dim=-1)
        return draft + self.d2t[draft]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                name = _checkpoint_name(name)
                if name == "d2t":
                    self.d2t.copy_(tensor)
                else:
                    yield name, tensor
        return load_packed_weights(self, renamed(), lambda name: any(s in name for s in _EAGLE3_SKIPS))


HEADS = {"eagle": EagleHead, "eagle3": Eagle3Head}
# How a checkpoint shows its layout: EAGLE-3's layer normalises the hidden states it reads
# (`hidden_norm`) and maps draft tokens to the target's (`d2t`); EAGLE's has neither.
_LAYOUTS = {"eagle": "EAGLE head (no hidden_norm, no d2t)", "eagle3": "EAGLE-3 head (hidden_norm and d2t)"}


def draft_vocab_size(config) -> int:
    return getattr(config, "draft_vocab_size", None) or config.vocab_size


def prepare_head(method: str, source, target: nn.Module, target_config, head_name: str,
                 target_name: str) -> type[nn.Module]:
    """The head class to build from `source` (a ModelSource) for this target, once its config is
    checked against the target's and completed from its tensor names; an EAGLE-3 head also
    points the target's hook at the layers it reads (`DecoderModel.aux_hidden_layers`)."""
    config = source.hf_config
    if not isinstance(getattr(target, "model", None), DecoderModel):
        raise ConfigError(FIELD, f"{method} heads run beside Llama-family targets (Llama, Mistral, Qwen2/3), whose "
                                 f"hidden states the engine exports; the target {target_name!r} is "
                                 f"{type(target).__name__}")
    names = {_checkpoint_name(name) for name in tensor_names(source.weight_files)}
    layout = "eagle3" if {"d2t", "layers.0.hidden_norm.weight"} & names else "eagle"
    if layout != method:
        raise ConfigError(FIELD, f"the head {head_name!r} is an {_LAYOUTS[layout]} but the method is {method!r}: "
                                 f"set \"method\": \"{layout}\" for it, or give an {_LAYOUTS[method]}")
    # What the config does not say: whether fc and q/k/v have biases, whether the head has its
    # own embedding (EAGLE-3).
    config.eagle_fc_bias = bool(getattr(config, "eagle_fc_bias", False)) or "fc.bias" in names
    config.eagle_qkv_bias = "layers.0.self_attn.q_proj.bias" in names
    config.eagle_own_embedding = method == "eagle3" and "embed_tokens.weight" in names
    check_head(method, config, target_config, head_name, target_name)
    if method == "eagle3":
        target.model.aux_hidden_layers = aux_layer_ids(config, target_config.num_hidden_layers)
    return HEADS[method]


def check_head(method: str, head, target, head_name: str, target_name: str) -> None:
    """Raise a ConfigError naming both sides when the head was not made for this target."""
    def refuse(what: str, ours, theirs) -> ConfigError:
        return ConfigError(FIELD, f"the {method} head {head_name!r} has {what} {ours} but the target {target_name!r} "
                                  f"has {theirs}: a head is trained for one target model")

    if head.vocab_size != target.vocab_size:
        raise refuse("a vocabulary of", head.vocab_size, target.vocab_size)
    expected = head.hidden_size if method == "eagle" else getattr(head, "target_hidden_size", None) or head.hidden_size
    if expected != target.hidden_size:
        raise refuse("hidden size", expected, target.hidden_size)
    if method == "eagle3" and head.hidden_size != target.hidden_size and not head.eagle_own_embedding:
        raise refuse("hidden size", head.hidden_size, f"embeddings of {target.hidden_size}")
    if head.num_hidden_layers != 1:
        raise ConfigError(FIELD, f"the {method} head {head_name!r} has {head.num_hidden_layers} decoder layers; "
                                 "corectl reads the published one-layer heads")
    nested = getattr(head, "eagle_config", None) or {}
    if getattr(head, "add_para_norm", False) or nested.get("use_aux_hidden_state", True) is False:
        raise ConfigError(FIELD, f"the {method} head {head_name!r} is a variant corectl does not read (HASS's "
                                 "add_para_norm, or an EAGLE-3 head without use_aux_hidden_state)")
    if method == "eagle3" and draft_vocab_size(head) > head.vocab_size:
        raise ConfigError(FIELD, f"the eagle3 head {head_name!r} has draft_vocab_size {draft_vocab_size(head)}, "
                                 f"more than its vocab_size {head.vocab_size}")


def aux_layer_ids(head, num_target_layers: int) -> tuple[int, ...]:
    """The three target layers whose inputs an EAGLE-3 head reads, ascending: the config's
    `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`), else vLLM's default
    (2, L // 2, L - 3)."""
    nested = getattr(head, "eagle_config", None) or {}
    ids = getattr(head, "eagle_aux_hidden_state_layer_ids", None) or nested.get("eagle_aux_hidden_state_layer_ids")
    layers = num_target_layers
    ids = tuple(ids) if ids else (2, layers // 2, layers - 3)
    if len(set(ids)) != 3 or not all(isinstance(i, int) and 0 <= i < layers for i in ids):
        raise ConfigError(FIELD, f"an eagle3 head reads three distinct layers of the {layers}-layer target, got "
                                 f"{list(ids)}: set eagle_aux_hidden_state_layer_ids in the head's config.json")
    return tuple(sorted(ids))
