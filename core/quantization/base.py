"""The quantization contract: a config chosen per checkpoint picks a linear method per layer.

vLLM's split, written for this engine. A `QuantizationConfig` is read from the checkpoint
(`quantization_config` in config.json, or the tensor types of a GGUF file) or chosen with
`--quantization`; at engine start it is bound to one kernel the platform provides
(`PlatformCaps.quantization_kernels`). When the model is built, every quantizable linear layer
(`corectl.models.parallel`'s column- and row-parallel layers) asks it for a `LinearMethod` by the
layer's module name; the method owns the layer's weight layout (its parameters), how each
checkpoint tensor reaches them (per-rank slices included) and how the layer computes. A
mixture-of-experts layer (`corectl.models.moe.FusedMoE`) is no linear layer: it asks for a
`MoEMethod` the same way, and a config that gives none leaves the experts dense.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..loaders.source import ModelSource


@dataclass(frozen=True)
class QuantAxes:
    """Where a quantized parameter's rows and columns sit, so the layer slices it per rank.

    `out_axis` holds output features, `out_pack` of them per element (8 when eight 4-bit values
    share an int32 along the outputs); `in_axis`/`in_pack` likewise for input features (a group's
    scale covers `group_size` inputs). None: the parameter does not span that dimension and is
    copied whole. `per_shard`: one entry per packed shard (a per-tensor scale of q, k and v).
    """

    out_axis: int | None = 0
    out_pack: int = 1
    in_axis: int | None = 1
    in_pack: int = 1
    per_shard: bool = False


class LinearMethod(abc.ABC):
    """How one linear layer stores, loads and applies its weight.

    `create_weights` registers the layer's parameters (each with a `QuantAxes` as `quant_axes`;
    the layer's `load_sliced` fills them from checkpoint tensors, narrowed to the rank's slice)
    and is called once the layer's output/input sizes are known. `process_weights_after_loading`
    turns what was loaded into the layout the kernel reads, registering what it keeps as
    parameters or buffers (so the model's tensors are what it holds). `apply` computes
    `x @ W.T + bias`; `apply_gated` optionally fuses a gated MLP's activation into it (a
    row-parallel down projection). `served_bytes` states the size of that served layout, for
    `corectl plan`.
    """

    @abc.abstractmethod
    def create_weights(self, layer: torch.nn.Module, dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack what was loaded into the kernel's layout; nothing by default."""

    @abc.abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def apply_gated(self, layer: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        """The layer applied to silu(gate) * up of the packed `gate_up` activations [..., 2K]
        (gate first) in one fused step, or None where the method has no fused form (the default:
        the model runs its activation kernel, then `apply`)."""
        return None

    def served_bytes(self, layer: torch.nn.Module) -> int:
        """Bytes the layer holds once `process_weights_after_loading` ran, computed from what
        `create_weights` made (on the meta device when `corectl plan` asks, so from shapes and
        dtypes alone; the layer's bias included). By default the layer's tensors as created: a
        method whose repacking changes the size (quantizing a dense weight, packing codes)
        overrides it. Planning counts the layer's tensors as created as what it holds while the
        checkpoint loads (all layers at once: repacking starts once every weight is in)."""
        return layer_bytes(layer)


class MoEMethod(abc.ABC):
    """How one mixture-of-experts layer (`corectl.models.moe.FusedMoE`) stores, loads and applies
    its stacked experts; the contract of `LinearMethod`, for the experts of a layer.

    `create_weights` registers the stacked parameters through the layer's
    `register_expert_param` (which attaches the per-expert, per-rank loader the parameter's
    layout needs). `unused_tensors` names per-expert checkpoint tensors (by their last name part,
    e.g. "input_scale") the method reads past. `apply` returns this rank's partial output, before
    the layer's all-reduce.
    """

    unused_tensors: ClassVar[tuple[str, ...]] = ()
    # Why the layers this method serves cannot run inside CUDA graphs (it reads values back to the
    # host); "" where they can. `bind_linear_methods` keeps such a model's decode steps eager.
    graph_capture_blocker: ClassVar[str] = ""

    @abc.abstractmethod
    def create_weights(self, layer: torch.nn.Module, dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack what was loaded into the kernel's layout; nothing by default."""

    @abc.abstractmethod
    def apply(self, layer: torch.nn.Module, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor: ...

    def served_bytes(self, layer: torch.nn.Module) -> int:
        """Bytes the layer holds once repacked (`LinearMethod.served_bytes`'s contract)."""
        return layer_bytes(layer)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the given tensors (None counts nothing: an absent bias)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def layer_bytes(layer: torch.nn.Module) -> int:
    """Bytes of a module's own parameters and buffers (not its children's)."""
    return tensor_bytes(*layer.parameters(recurse=False), *layer.buffers(recurse=False))


@dataclass(frozen=True)
class QuantizationConfig(abc.ABC):
    """One quantization scheme of one checkpoint; picklable (it travels to every rank).

    `kernels` lists the kernel names the scheme runs on, best first; `kernel` is the one bound at
    engine start (`bind`), from those the platform provides.
    """

    name: ClassVar[str] = ""
    kernels: ClassVar[tuple[str, ...]] = ()
    kernel: str | None = None

    @classmethod
    @abc.abstractmethod
    def from_checkpoint(cls, quant_config: dict[str, Any] | None, source: "ModelSource") -> "QuantizationConfig":
        """Build from the checkpoint's `quantization_config` (None when the user asked for the
        method on a checkpoint that has none: on-the-fly quantization); raise ConfigError when
        the checkpoint is not one this method reads."""

    @abc.abstractmethod
    def linear_method(self, prefix: str, layer: torch.nn.Module) -> LinearMethod | None:
        """The method for the layer named `prefix`; None keeps it unquantized."""

    def moe_method(self, prefix: str, layer: torch.nn.Module) -> MoEMethod | None:
        """The method for the mixture-of-experts layer named `prefix`; None (the default: a
        scheme that does not cover experts) keeps its experts dense."""
        return None

    def weight_stream(self, source: "ModelSource") -> Iterator[tuple[str, Any]] | None:
        """(name, tensor) pairs to load instead of the checkpoint's safetensors (GGUF reads its
        blocks from the file); None loads the safetensors."""
        return None

    def bind(self, provided: tuple[str, ...], platform: str) -> "QuantizationConfig":
        """This config with the first of its `kernels` in `provided`; ConfigError when none is."""
        for kernel in self.kernels:
            if kernel in provided:
                return dataclasses.replace(self, kernel=kernel)
        raise ConfigError(
            "quantization",
            f"{self.name!r} runs on kernels {', '.join(self.kernels)}; platform {platform!r} provides "
            f"{', '.join(provided) or 'none'}; run it on a platform that provides one",
        )

    def describe(self) -> str:
        return f"{self.name} ({self.kernel})"



class QuantizableLayer(abc.ABC):
    """A layer a quantization config can serve: the linear layers (`corectl.models.quantizable`)
    and a mixture-of-experts layer's experts (`corectl.models.moe.FusedMoE`). Built inside a
    `quantization_scope` it defers its dense weights; `bind_linear_methods` asks it for its
    method, so the scope never needs to know the layer classes (they sit above it)."""

    quant_method: LinearMethod | MoEMethod | None = None

    @abc.abstractmethod
    def quant_method_for(self, config: QuantizationConfig, prefix: str) -> LinearMethod | MoEMethod | None:
        """The method `config` gives this layer (named `prefix` in the model); None keeps it dense."""

    @abc.abstractmethod
    def set_quant_method(self, method: LinearMethod | MoEMethod | None, dtype: torch.dtype,
                         device: torch.device) -> None:
        """Give the layer its method (None: materialise the dense weights it deferred)."""

    def check_loaded(self, prefix: str) -> None:
        """Raise naming a quantized parameter the checkpoint did not fill. Nothing to check by
        default: a layer whose loader counts what arrived (`load_moe_weights`) reports it there."""


# Kernels a worker hands the methods (name -> callable), beside the torch ops core calls itself.
KernelTable = dict[str, Callable[..., torch.Tensor]]
