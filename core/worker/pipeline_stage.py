"""This rank's pipeline stage in a step: receive the previous stage's activations, run the
stage's layers, send the result on (`corectl.models.pipeline` builds the layers).

Every stage gets the same `SchedulerOutput`, so each knows the step's token count and receives
exactly the [T, hidden] hidden states and residual the previous stage sends. Stages before the
last return nothing: the last one computes logits and samples (`ModelRunner.launch`).

The engine keeps twice as many steps in flight as stages follow the first (`steps_in_flight`), so
a micro-batch's next step is launched before the host has read its last one: the last stage sends
each step's sampled ids back to the first (`send_sampled`), which posts the receive as it launches
the step (`receive_sampled`) and feeds the ids to the request's next step on the device.

With a draft model the first stage alone drafts (the scheduler reserved placeholders, which the
other stages lay out as they are): the drafts travel stage to stage ahead of the activations to the
last, which verifies them (`pass_drafts`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ..attention import ForwardContext
from ..distributed import (
    get_pp,
    receive_from_last_stage,
    receive_from_previous_stage,
    send_to_first_stage,
    send_to_next_stage,
)
from ..models.pipeline import IntermediateTensors


def pipelined_steps(num_stages: int) -> int:
    """Steps in flight with `num_stages` (P) stages: the P - 1 in the stages besides the one launched
    next, and as many older ones whose requests those continue, so a micro-batch goes on P to
    2(P - 1) launches after its own step (the engine's depth, and the ids a stage keeps)."""
    return 2 * (num_stages - 1)


class PipelineStage:
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, streams: int = 2,
                 drafts_on_first: bool = False):
        """`streams`: the [T, hidden] tensors a stage hands the next (`CausalLM.pipeline_streams`);
        `drafts_on_first`: a draft model on the first stage proposes the drafts (`pass_drafts`)."""
        pp = get_pp()
        self.streams = streams
        self.drafts_on_first = drafts_on_first
        self.is_first, self.is_last = pp.is_first, pp.is_last
        # Steps whose sampled ids a later step may still take from the device.
        self.sampled_depth = pipelined_steps(pp.world_size)
        # The last stage's sends of sampled ids still under way (they hold their tensors).
        self._sends: deque = deque()
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
                       for _ in range(self.streams)]
        else:
            buffers = into.rows(num_tokens).tensors()
        return IntermediateTensors(*receive_from_previous_stage(buffers))

    def send(self, output: IntermediateTensors) -> None:
        send_to_next_stage(output.tensors())

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: ForwardContext, **extra) -> torch.Tensor | None:
        """The stage's part of the forward pass: the final hidden states on the last stage, else
        None once the activations are on their way to the next stage. `extra`: the model's other
        inputs (a vision-language model's `inputs_embeds`, the first stage's)."""
        output = model(input_ids, positions, ctx, intermediate=self.receive(input_ids.shape[0]), **extra)
        if self.is_last:
            return output
        self.send(output)
        return None

    def pass_drafts(self, drafts: torch.Tensor | None, count: int) -> torch.Tensor | None:
        """A draft model's tokens for a step ([count] int64, in the step's order), drafted on the
        first stage: it passes `drafts` on, later stages receive them ahead of the step's
        activations and pass them on, and the last, which verifies them, gets them back."""
        if not self.is_first:
            drafts = receive_from_previous_stage([torch.empty(count, dtype=torch.int64, device=self.device)])[0]
        if self.is_last:
            return drafts
        send_to_next_stage([drafts])
        return None

    def send_sampled(self, ids: torch.Tensor) -> None:
        """The last stage: send a step's sampled ids ([rows] int64) to the first stage."""
        self._sends.append(send_to_first_stage(ids.contiguous()))
        while len(self._sends) > self.sampled_depth:
            self._sends.popleft().wait()

    def receive_sampled(self, num_rows: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """The first stage: post the receive of a step's sampled ids; the tensor they land in and
        the wait that makes them readable."""
        ids = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        return ids, receive_from_last_stage(ids).wait
