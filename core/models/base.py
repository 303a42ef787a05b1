"""The contract every model implementation meets (built-in or from a plugin)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..attention import ForwardContext
from ..errors import ConfigError


class CausalLM(nn.Module):
    """A decoder-only LM over packed tokens.

    `forward` takes the T tokens of a step (all sequences concatenated) and returns hidden states
    [T, hidden]; `compute_logits` maps selected hidden rows to fp32 logits [N, vocab].
    `load_weights` takes (Hugging Face parameter name, tensor) pairs and returns the names of
    the model parameters it filled. `supports_graph_capture` False keeps a model's decode steps
    out of CUDA graphs (its forward reads values back to the host, e.g. the torch MoE path), and
    `graph_capture_blocker` says why, for the log line.
    `supports_pipeline_parallel` True: the model builds only its pipeline stage's layers
    (`corectl.models.pipeline`), and `forward` takes and returns `IntermediateTensors` between
    stages, `pipeline_streams` tensors of them (2: hidden states and residual; 1: one stream). A
    model that does not shard its layers for tensor parallelism says why in `tensor_parallel_blocker`
    (`check_tensor_parallel` refuses it by that reason, in the model and in `corectl plan`).
    """

    supports_graph_capture: bool = True
    graph_capture_blocker: str = ""
    supports_pipeline_parallel: bool = False
    pipeline_streams: int = 2
    tensor_parallel_blocker: str = ""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        raise NotImplementedError

    def after_loading(self) -> None:
        """Called once every weight is loaded and quantized layers are processed, to derive what the
        forward needs from them (DeepSeek's absorbed MLA up-projections); nothing by default."""


def check_tensor_parallel(model_cls: type, world_size: int) -> None:
    """Refuse `world_size` > 1 ranks for a model class with a `tensor_parallel_blocker`."""
    blocker = getattr(model_cls, "tensor_parallel_blocker", "")
    if world_size > 1 and blocker:
        raise ConfigError("tensor_parallel_size", f"{model_cls.__name__} runs on one rank only: {blocker}")
