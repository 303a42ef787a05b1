"""Pipeline stages in a model: which of its layers this rank builds, and which checkpoint tensors
it therefore skips.

A model splits its decoder layers into contiguous runs, one per stage (`layer_partition`): an
even split by default with the extra layers on the stages before the last (which also holds the
final norm and LM head), as vLLM does, or the counts the user gave (`pipeline_layer_partition`,
vLLM's `VLLM_PP_LAYER_PARTITION`). A model builds its layer list with `build_stage_layers`:
the other stages' layers are `OtherStageLayer` placeholders, so the list keeps checkpoint
indices (`layers.7...` names layer 7 on every stage) and holds no weights for them.

Between stages the activations travel as `IntermediateTensors` (hidden states and residual);
the worker sends and receives them (`corectl.worker.pipeline_stage`).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import EngineConfig, parse_layer_partition
from ..distributed import get_pp
from ..errors import ConfigError

# vLLM's variable; `pipeline_layer_partition` takes precedence.
PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
_ABSENT = object()


@dataclass
class IntermediateTensors:
    """A stage's output that the next stage continues from: [T, hidden] each. A model whose layers
    carry one stream (Gemma adds each sublayer's normed output to it) has no separate residual
    (`CausalLM.pipeline_streams` 1)."""

    hidden: torch.Tensor
    residual: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden] if self.residual is None else [self.hidden, self.residual]

    def rows(self, count: int) -> IntermediateTensors:
        """The first `count` rows of each tensor."""
        return IntermediateTensors(*(t[:count] for t in self.tensors()))


class OtherStageLayer(nn.Identity):
    """A decoder layer that another pipeline stage holds: no weights, never run."""


def layer_partition(num_layers: int, num_stages: int, partition: tuple[int, ...] | None = None) -> list[range]:
    """Each stage's layers. `partition`: the user's counts (`check_pipeline_parallel` has checked
    that they sum to `num_layers`)."""
    if partition is None:
        counts = [num_layers // num_stages] * num_stages
        # The last stage also runs the norm and the LM head: the extra layers go before it.
        for stage in range(num_layers % num_stages):
            counts[-2 - stage] += 1
    else:
        counts = list(partition)
    starts = [sum(counts[:stage]) for stage in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def stage_layers(num_layers: int) -> range:
    """The layers this rank's stage holds (all of them without pipeline stages)."""
    pp = get_pp()
    if pp.world_size == 1:
        return range(num_layers)
    return layer_partition(num_layers, pp.world_size, pp.partition)[pp.rank]


def build_stage_layers(num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """Layer i from `build(i)` for this stage's layers, a placeholder for the others."""
    mine = stage_layers(num_layers)
    return nn.ModuleList(build(i) if i in mine else OtherStageLayer() for i in range(num_layers))


def held_layers(decoder: nn.Module) -> list[nn.Module]:
    """The layers this stage holds of a decoder built with `build_stage_layers` (its `layers` and
    `stage_layers`): every one without stages."""
    return [decoder.layers[index] for index in decoder.stage_layers]


def stage_input(embed: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                intermediate: IntermediateTensors | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (hidden, residual) a stage's first layer takes: the embedded tokens and no residual yet
    on the first stage, the previous stage's activations on a later one."""
    if intermediate is None:
        return embed(input_ids), None
    return intermediate.hidden, intermediate.residual


def held_by_other_stage(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a part of the model this stage does not hold: a
    layer of another stage, or a module that is None here (the embedding after the first stage,
    the norm and LM head before the last)."""
    module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, _ABSENT)
        if module is None or isinstance(module, OtherStageLayer):
            return True
        if module is _ABSENT:  # a checkpoint name the module tree spells differently (packed q/k/v)
            return False
    return False


def resolve_layer_partition(config: EngineConfig) -> tuple[int, ...] | None:
    """The user's per-stage layer counts: the config's, else vLLM's environment variable."""
    if config.pipeline_parallel_size == 1:
        return None
    if config.pipeline_layer_partition is not None:
        return parse_layer_partition(config.pipeline_layer_partition, config.pipeline_parallel_size,
                                     "pipeline_layer_partition")
    text = os.environ.get(PARTITION_ENV)
    return None if not text else parse_layer_partition(text, config.pipeline_parallel_size, PARTITION_ENV)


def check_pipeline_parallel(hf_config, model_cls: type, config: EngineConfig, partition: tuple[int, ...] | None) -> None:
    """Refuse, before any rank starts, stages the model (or the engine's mode) cannot be split into."""
    num_stages = config.pipeline_parallel_size
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ConfigError("pipeline_parallel_size", f"{model_cls.__name__} does not build its layers per pipeline "
                          "stage; use --tensor-parallel-size, or pipeline_parallel_size 1")
    num_layers = hf_config.num_hidden_layers
    if num_layers < num_stages:
        raise ConfigError("pipeline_parallel_size", f"{num_stages} stages need at least one layer each; the model "
                          f"has {num_layers}")
    if partition is not None and sum(partition) != num_layers:
        raise ConfigError("pipeline_layer_partition", f"{','.join(map(str, partition))} sums to {sum(partition)} "
                          f"layers; the model has {num_layers}")
