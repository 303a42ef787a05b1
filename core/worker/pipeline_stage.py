"""This rank's pipeline stage in a step: receive the previous stage's activations, run the
stage's layers, send the result on (`corectl.models.pipeline` builds the layers).

Every stage gets the same `SchedulerOutput`, so each knows the step's token count and receives
exactly the [T, hidden] hidden states and residual the previous stage sends. Stages before the
last return nothing: the last one computes logits and samples (`ModelRunner.launch`).
"""
from __future__ import annotations

import torch

from ..attention import ForwardContext
from ..distributed import get_pp, receive_from_previous_stage, send_to_next_stage
from ..models.pipeline import IntermediateTensors


class PipelineStage:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        pp = get_pp()
        self.is_first, self.is_last = pp.is_first, pp.is_last
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    def receive(self, num_tokens: int, into: IntermediateTensors | None = None) -> IntermediateTensors | None:
        """The previous stage's activations for `num_tokens` rows (into `into`'s first rows when
        given: a captured graph's static inputs); None on the first stage."""
        if self.is_first:
            return None
        if into is None:
            buffers = [torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                       for _ in range(2)]
        else:
            buffers = [t[:num_tokens] for t in into.tensors()]
        return IntermediateTensors(*receive_from_previous_stage(buffers))

    def send(self, output: IntermediateTensors) -> None:
        send_to_next_stage(output.tensors())

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor | None:
        """The stage's part of the forward pass: the final hidden states on the last stage, else
        None once the activations are on their way to the next stage."""
        output = model(input_ids, positions, ctx, self.receive(input_ids.shape[0]))
        if self.is_last:
            return output
        self.send(output)
        return None
