"""The weights a plan counts: the engine's model built on the meta device with the quantization
methods the target binds, each quantized layer sized by the layout its method serves.

A quantized layer (a linear layer, or a mixture-of-experts layer's stacked experts) holds one
layout while the checkpoint loads (what its method's `create_weights` made: a dense weight to
quantize on the fly, GGUF codes a byte each) and another once `process_weights_after_loading`
repacked it (`LinearMethod.served_bytes`, `MoEMethod.served_bytes`). Every layer is
repacked only after the whole checkpoint is in, so loading holds every layer's loaded layout at
once: that is the load-time peak. The transient copies a method makes while repacking one layer
(a float copy of the weight it quantizes) are left out: one layer's worth, not the model's.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from .distributed import shard_range
from .errors import ConfigError
from .models.mla import MLAttention
from .models.moe import FusedMoE
from .models.parallel import PackedLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding
from .quantization.base import QuantizationConfig, layer_bytes, tensor_bytes
from .worker.worker import ModelInfo, build_model


@dataclass(frozen=True)
class WeightLayout:
    """A model's weight bytes in one layout, at world size 1.

    split: of `total`, the bytes tensor parallelism divides over ranks (the matrices of its split
    layers, and every tensor of such a layer when quantized); the rest (norms, biases of dense
    layers, and whatever layers every rank holds whole) is replicated.
    kv_head: the bytes one KV head's K and V projection rows take over all layers, which each rank
    holds again when ranks outnumber KV heads.
    """

    total: int
    split: int
    kv_head: int

    def per_rank(self, kv_heads_per_rank: int, num_kv_heads: int, tp: int) -> int:
        repeated = self.kv_head * (kv_heads_per_rank * tp - num_kv_heads)
        return math.ceil((self.split + repeated) / tp) + self.total - self.split


@dataclass(frozen=True)
class ModelWeights:
    """served: the weights as the engine serves them; loading: as they are held while the
    checkpoint loads (the same for dense models). num_params counts a quantized layer's weight as
    the dense matrix it stands for."""

    served: WeightLayout
    loading: WeightLayout
    buffer_bytes: int
    num_params: int
    # Of buffer_bytes, those a layer keeps per attention head, which the ranks divide (MLA's
    # absorbed up-projections); the rest (rotary tables) every rank holds whole.
    split_buffer_bytes: int = 0

    def buffer_bytes_per_rank(self, tp: int) -> int:
        return math.ceil(self.split_buffer_bytes / tp) + self.buffer_bytes - self.split_buffer_bytes


def kv_heads_per_rank(info: ModelInfo, tp: int) -> int:
    """A rank's KV heads as the engine shards them (one, shared, when ranks outnumber them)."""
    try:
        shard_range(info.num_heads, 0, tp)
        return shard_range(info.num_kv_heads, 0, tp)[1]
    except ValueError:
        raise ConfigError("tensor_parallel_size", f"{tp} must divide the model's {info.num_heads} attention heads, "
                          f"and divide or be a multiple of its {info.num_kv_heads} KV heads") from None


def rank_share(info: ModelInfo, weights: ModelWeights, tp: int) -> tuple[int, int, int]:
    """One of `tp` ranks' share of a model: (its KV heads, its served weight bytes, its KV cache
    bytes a token)."""
    kv_heads = kv_heads_per_rank(info, tp)
    return (kv_heads, weights.served.per_rank(kv_heads, info.num_kv_heads, tp),
            dataclasses.replace(info, num_kv_heads=kv_heads).kv_bytes_per_block(1))


def planned_model(model_cls: type[nn.Module], hf, dtype: torch.dtype, max_model_len: int,
                  quantization: QuantizationConfig | None, kernels: tuple[str, ...]) -> nn.Module:
    """The engine's model on the meta device; a method that looks up its platform kernel when it
    binds to a layer finds a stand-in (a planned model never runs)."""
    return build_model(model_cls, hf, dtype, "meta", max_model_len, quantization,
                       {name: _not_run for name in kernels})


def _not_run(*args, **kwargs) -> torch.Tensor:
    raise RuntimeError("a model built for planning does not run")


# The layers tensor parallelism splits over the ranks. Every other module's weights each rank holds
# whole: routers, a vision tower, an EAGLE head's fc, DeepSeek's low-rank projections.
_SPLIT_LAYERS = (PackedLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead, FusedMoE)


def _split_over_ranks(module: nn.Module) -> bool:
    return isinstance(module, _SPLIT_LAYERS) and not isinstance(module, ReplicatedLinear)


def _split_bytes(module: nn.Module, own: list[nn.Parameter]) -> int:
    """Of a split layer's own dense parameters, the bytes divided over the ranks: a column-parallel
    layer's rows with their biases; of the others the matrices (a row-parallel bias is whole on
    every rank)."""
    if isinstance(module, PackedLinear):
        return tensor_bytes(*own)
    return tensor_bytes(*(p for p in own if p.dim() > 1))


def size_weights(model: nn.Module, head_dim: int) -> ModelWeights:
    """The weights of a (meta) model; `head_dim` sizes a KV head's rows."""
    served, loading = _Tally(head_dim), _Tally(head_dim)
    buffers = split_buffers = num_params = 0
    seen: set[int] = set()
    for module in model.modules():
        split = _split_over_ranks(module)
        method = getattr(module, "quant_method", None)
        if method is not None:
            for tally, nbytes in ((served, method.served_bytes(module)), (loading, layer_bytes(module))):
                tally.add(module, nbytes if split else 0, 0 if split else nbytes)
            num_params += _dense_params(module)
            continue
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]  # a tied head: the embedding's
        seen.update(map(id, own))
        divided = _split_bytes(module, own) if split else 0
        for tally in (served, loading):
            tally.add(module, divided, tensor_bytes(*own) - divided)
        held = tensor_bytes(*module.buffers(recurse=False))
        buffers += held
        split_buffers += held if isinstance(module, MLAttention) else 0
        num_params += sum(p.numel() for p in own)
    return ModelWeights(served.layout(), loading.layout(), buffers, num_params, split_buffers)


def _dense_params(module: nn.Module) -> int:
    """The parameters of the dense layer a quantized one stands for."""
    if isinstance(module, FusedMoE):
        return module.num_experts * 3 * module.rows * module.hidden_size
    return module.out_features * module.in_features + (0 if module.bias is None else module.bias.numel())


@dataclass
class _Tally:
    head_dim: int
    total: int = 0
    split: int = 0
    kv_head: float = 0.0

    def add(self, module: nn.Module, split: int, replicated: int = 0) -> None:
        self.total += split + replicated
        self.split += split
        if "k" in (getattr(module, "full_sizes", None) or {}):  # a packed q/k/v projection
            self.kv_head += 2 * self.head_dim * split / module.out_features

    def layout(self) -> WeightLayout:
        return WeightLayout(self.total, self.split, round(self.kv_head))
