"""GGUF checkpoints served from their quantized blocks.

The config reads the file's tensor types; a linear layer whose checkpoint tensors (all shards of
a packed qkv or gate_up layer) are Q4_0, Q4_1 or Q4_K keeps them as int4 groups of 32,
w = q * scale + offset, and runs either the worker's 4-bit GEMM (kernel "w4a16", GPUs: codes
packed as int32 words, scales and float offsets [K/32, N] in fp16, or fp32 in fp32 models) or
torch's packed int4 GEMM (kernel "cpu_int4pack", CPUs). Where the worker also provides "w8a16"
(GPUs), a layer whose tensors are Q8_0 or Q6_K (or mix them with the int4 types, as Q4_K_M
files do for v and down) keeps int8 codes in groups of 32 (16 with Q6_K) with a scale, and an
offset where a member has one. Every other tensor (norms, the embedding and tied head, Q5_*
projections, and int8 formats on CPUs, whose per-group scales torch's int8 GEMM cannot take) is
dequantized while loading, as without quantization.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..loaders.gguf_blocks import GROUP, INT4_TYPES, INT8_GROUPS, SYMMETRIC, Int4Groups, Int8Groups
from ..loaders.gguf_weights import gguf_tensor_types, iter_gguf_weights
from ..loaders.packing import PACKED_MODULES
from .base import LinearMethod, QuantAxes, QuantizationConfig, tensor_bytes
from .gguf_int8 import GGUFInt8Method
from .int4 import register_w4a16, w4a16_bytes, w4a16_linear
from .int4_cpu import int4_linear, int4pack_bytes, register_int4pack
from .scope import kernel as provided_kernel


@dataclass(frozen=True)
class GGUFConfig(QuantizationConfig):
    name = "gguf"
    kernels = ("w4a16", "cpu_int4pack")
    # Hugging Face tensor name -> GGUF type name, for every tensor of the file.
    tensor_types: dict[str, str] = field(default_factory=dict)
    kept: frozenset[str] = frozenset()
    # Tensor name -> its layer's int8 group size, for layers served by "w8a16" (empty until bound
    # to a platform that provides it).
    int8_groups: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_checkpoint(cls, quant_config, source) -> "GGUFConfig":
        if source.gguf_file is None:
            raise ConfigError("quantization", "'gguf' serves GGUF files; this model is not one")
        types = gguf_tensor_types(source.gguf_file)
        return cls(tensor_types=types, kept=frozenset(_kept_tensors(types)))

    def bind(self, provided: tuple[str, ...], platform: str) -> "GGUFConfig":
        bound = super().bind(provided, platform)
        if "w8a16" not in provided:
            return bound
        return dataclasses.replace(bound, int8_groups=_int8_tensors(self.tensor_types))

    def linear_method(self, prefix: str, layer) -> LinearMethod | None:
        names = layer.checkpoint_weight_names(prefix)
        if all(name in self.kept for name in names):
            return GGUFInt4Method(self.kernel)
        if all(name in self.int8_groups for name in names):
            symmetric = all(self.tensor_types[name] in SYMMETRIC for name in names)
            return GGUFInt8Method(self.int8_groups[names[0]], not symmetric)
        return None

    def weight_stream(self, source) -> Iterator[tuple[str, torch.Tensor | Int4Groups | Int8Groups]]:
        return iter_gguf_weights(source.gguf_file, source.hf_config, self.kept, self.int8_groups)

    def describe(self) -> str:
        kinds = sorted({self.tensor_types[name] for name in self.kept})
        text = f"gguf ({'/'.join(kinds) or 'no'} int4 layers via {self.kernel}"
        if self.int8_groups:
            text += f"; {'/'.join(sorted({self.tensor_types[n] for n in self.int8_groups}))} int8 layers via w8a16"
        return text + ")"


def _packed_groups(types: dict[str, str]) -> list[list[str]]:
    """The projection weights of each linear layer, a packed layer's (q/k/v, gate/up) together."""
    groups: dict[str, list[str]] = {}
    for name in types:
        if not (name.endswith("_proj.weight") and ".layers." in name):
            continue
        stem, proj = name.removesuffix(".weight").rsplit(".", 1)
        packed = PACKED_MODULES.get(proj, (proj, None))[0]
        groups.setdefault(f"{stem}.{packed}", []).append(name)
    return list(groups.values())


def _kept_tensors(types: dict[str, str]) -> set[str]:
    """Projection weights whose whole layer is an int4 group format."""
    return {name for members in _packed_groups(types) if all(types[m] in INT4_TYPES for m in members)
            for name in members}


def _int8_tensors(types: dict[str, str]) -> dict[str, int]:
    """Projection weights of layers that are int8 group formats, not all int4 -> the layer's group."""
    found = {}
    for members in _packed_groups(types):
        kinds = {types[m] for m in members}
        if kinds <= INT8_GROUPS.keys() and not kinds <= set(INT4_TYPES):
            found.update(dict.fromkeys(members, min(INT8_GROUPS[kind] for kind in kinds)))
    return found


class GGUFInt4Method(LinearMethod):
    """Codes [N, K] (the `weight` the checkpoint fills), scales and mins [N, K/32] while loading;
    the bound kernel's layout after."""

    def __init__(self, kernel: str | None):
        self.gemm = provided_kernel("w4a16") if kernel == "w4a16" else None

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        if k % GROUP:
            raise ConfigError("model", f"{k} input features do not split into GGUF groups of {GROUP}")
        layer.register_quant_param("weight", torch.zeros(n, k, dtype=torch.uint8), QuantAxes(0, 1, 1, 1))
        # w4a16 serves scales and offsets as loaded: in fp16 for half-precision models, the file's
        # own precision for d and m (exact for Q4_0/Q4_1; Q4_K's d*sc products within 2**-12, where
        # bf16 would round every group to 2**-9 and add that to each weight), fp32 for fp32 models.
        # int4pack first folds them into its zero at code 8, in fp32 before its own rounding.
        group_dtype = torch.float16 if self.gemm is not None and dtype != torch.float32 else torch.float32
        for name in ("group_scales", "group_mins"):
            buffer = torch.zeros(n, k // GROUP, dtype=group_dtype)
            buffer.quant_axes, buffer.loaded_shards = QuantAxes(0, 1, 1, GROUP), set()
            layer.register_buffer(name, buffer)
        layer.weight.weight_loader = functools.partial(self._load, layer)

    @staticmethod
    def _load(layer, param, loaded: Int4Groups, shard_id: str | None = None) -> None:
        if not isinstance(loaded, Int4Groups):
            raise ValueError("a GGUF int4 layer loads int4 groups (corectl.loaders.gguf_weights), not a tensor")
        layer.load_sliced(param, loaded.codes, shard_id)
        layer.load_sliced(layer.group_scales, loaded.scales, shard_id)
        layer.load_sliced(layer.group_mins, loaded.mins, shard_id)

    def process_weights_after_loading(self, layer) -> None:
        codes, scales, mins = layer.weight.data, layer.group_scales, layer.group_mins
        del layer.weight, layer.group_scales, layer.group_mins
        if self.gemm is None:
            register_int4pack(layer, codes, scales, mins + 8 * scales)
            return
        g_idx = torch.arange(codes.shape[1], dtype=torch.int32, device=codes.device) // GROUP
        register_w4a16(layer, codes, scales.t(), mins.t(), g_idx, GROUP)

    def served_bytes(self, layer) -> int:
        """Loaded as a byte per code plus scales and mins; served packed: for w4a16 two codes a
        byte, the scales and mins as loaded and g_idx (int32); for int4pack its layout."""
        n, k = layer.out_features, layer.in_features
        if self.gemm is None:
            served = int4pack_bytes(n, k, GROUP)
        else:
            served = w4a16_bytes(n, k, tensor_bytes(layer.group_scales, layer.group_mins))
        return served + tensor_bytes(layer.bias)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            return int4_linear(x, layer.packed_weight, layer.scale_zero, GROUP, layer.bias)
        out = w4a16_linear(self.gemm, layer, x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])
