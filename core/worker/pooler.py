"""Pooling a step's hidden states into one vector per finished prompt (a pooling engine's worker).

On a pooling engine every request is prefill only: its prompt runs in one or more chunks, and the
step that runs its last chunk pools it. LAST takes the last prompt token's hidden state, CLS the
first token's (kept from the first chunk), MEAN the mean over every prompt token: each chunk's
rows are summed in fp32 into the request's running sum (`CachedRequestState.pooled_partial`,
written through `RequestStates.keep_pooled`, the states' one writer), so
chunked prefill gives the same vector as one pass. A preempted request is forgotten with its
partial state and recomputed from its first token (MEAN and CLS engines run without prefix caching,
so nothing is skipped).

The vectors are raw (fp32, neither truncated nor normalised): the client finishes them
(`corectl.pooling.finish_embedding`). A sequence classifier's head maps them to class logits here.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .request_states import HostStep, RequestStates

ToDevice = Callable[[list[np.ndarray]], list[torch.Tensor]]


class Pooler:
    def __init__(self, pooling_type: str, head: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.pooling_type = pooling_type
        self._pool = {"LAST": self._last, "MEAN": self._mean, "CLS": self._cls}[pooling_type]
        # A sequence classifier's head (the model's `classify`): pooled vectors -> fp32 class logits.
        self._head = head

    def pool(self, host: HostStep, hidden: torch.Tensor, states: RequestStates,
             to_device: ToDevice) -> torch.Tensor | None:
        """fp32 vectors [F, hidden] of the requests whose prompt ends this step, in
        `host.sample_req_ids` order; None when none does. `hidden` may carry padding rows past
        the step's tokens (a replayed graph), which are ignored."""
        hidden = hidden[: host.num_tokens]
        vectors = self._pool(host, hidden, states, to_device)
        if not host.sample_req_ids:
            return None
        return vectors if self._head is None else self._head(vectors)

    def _last(self, host: HostStep, hidden: torch.Tensor, states: RequestStates, to_device: ToDevice) -> torch.Tensor:
        if host.samples_every_row:
            return hidden.float()
        (rows,) = to_device([np.array(host.sample_rows, dtype=np.int64)])
        return hidden.index_select(0, rows).float()

    def _mean(self, host: HostStep, hidden: torch.Tensor, states: RequestStates, to_device: ToDevice) -> torch.Tensor:
        request_states = [states[req_id] for req_id in host.req_ids]
        segments = np.repeat(np.arange(host.num_seqs), host.query_lens)
        ends = set(host.sample_req_ids)
        finishing = [i for i, s in enumerate(request_states) if s.req_id in ends]
        counts = np.array([request_states[i].num_prompt_tokens for i in finishing], dtype=np.float32)
        segments_t, finishing_t, counts_t = to_device([segments, np.array(finishing, dtype=np.int64), counts])
        sums = torch.zeros(host.num_seqs, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segments_t, hidden.float())
        carried = [i for i, s in enumerate(request_states) if s.pooled_partial is not None]
        if carried:
            sums[carried] += torch.stack([request_states[i].pooled_partial for i in carried])
        for i, state in enumerate(request_states):
            states.keep_pooled(state, sums[i])
        return sums.index_select(0, finishing_t) / counts_t[:, None]

    def _cls(self, host: HostStep, hidden: torch.Tensor, states: RequestStates, to_device: ToDevice) -> torch.Tensor:
        vectors = []
        finishing = set(host.sample_req_ids)
        for req_id, q_start in zip(host.req_ids, host.query_starts):
            state = states[req_id]
            if state.num_computed_tokens == 0:
                # A clone: a replayed graph's output buffer is overwritten by the next step.
                states.keep_pooled(state, hidden[q_start].float().clone())
            if req_id in finishing:
                vectors.append(state.pooled_partial)
        return torch.stack(vectors) if vectors else hidden.new_zeros((0, hidden.shape[1]), dtype=torch.float32)
