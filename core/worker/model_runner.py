"""Hardware-neutral model runner: builds a step's inputs, runs the model, samples.

Platforms subclass it only for what differs (device setup, graphs, pinned buffers); the input
construction and sampling logic live here once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionBackend, AttentionBatch, ForwardContext
from ..sample import Sampler, SamplingMetadata, compute_prompt_logprobs
from ..wire import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from .input_batch import CachedRequestState, RequestStates

_PROMPT_LOGPROB_CHUNK = 512
_EMPTY_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionBatch
    req_ids: list[str]
    query_starts: list[int]
    sample_req_ids: list[str]
    sample_rows: list[int]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 block_size: int, vocab_size: int, eos_token_id: int | None):
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.sampler = Sampler()
        self.states = RequestStates(device)
        self.kv_caches: list[torch.Tensor] = []

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.states.apply(sched)
        if sched.is_empty:
            return _EMPTY_OUTPUT
        inputs = self.prepare_inputs(sched)
        ctx = ForwardContext(self.backend, self.backend.build_metadata(inputs.attn), self.kv_caches)
        hidden = self.run_model(inputs, ctx)
        prompt_logprobs = self._prompt_logprobs(inputs, hidden, sched)
        if not inputs.sample_req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return self._sample(inputs, logits, prompt_logprobs)

    def run_model(self, inputs: StepInputs, ctx: ForwardContext) -> torch.Tensor:
        """The forward pass; platforms override to replay captured graphs."""
        return self.model(inputs.input_ids, inputs.positions, ctx)

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        req_ids = list(sched.num_scheduled_tokens)
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, query_starts, tables = [], [], [], []
        sample_req_ids, sample_rows = [], []
        for req_id in req_ids:
            state = self.states[req_id]
            start, n = state.num_computed_tokens, sched.num_scheduled_tokens[req_id]
            query_starts.append(len(token_ids))
            token_ids.extend(state.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(state.block_ids)
            if start + n == len(state.token_ids):
                sample_req_ids.append(req_id)
                sample_rows.append(len(token_ids) - 1)
        attn = self._attention_batch(positions, query_lens, seq_lens, tables)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True),
            positions=attn.positions_tensor,
            attn=attn.batch,
            req_ids=req_ids,
            query_starts=query_starts,
            sample_req_ids=sample_req_ids,
            sample_rows=sample_rows,
        )

    def _attention_batch(self, positions, query_lens, seq_lens, tables) -> "_AttnInputs":
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        req_index = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        slots = table[req_index, pos // self.block_size].long() * self.block_size + pos % self.block_size
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        batch = AttentionBatch(
            query_start_loc=starts.to(self.device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(self.device, non_blocking=True),
            block_tables=table.to(self.device, non_blocking=True),
            slot_mapping=slots.to(self.device, non_blocking=True),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        return _AttnInputs(batch, pos.to(self.device, non_blocking=True))

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, prompt_logprobs) -> ModelRunnerOutput:
        states = [self.states[r] for r in inputs.sample_req_ids]
        meta = self._sampling_metadata(states)
        out = self.sampler(logits, meta)
        sampled = out.sampled_token_ids.tolist()
        for state, token in zip(states, sampled):
            state.token_ids.append(token)
        logprobs = None
        if out.logprobs is not None:
            logprobs = out.logprobs.to_lists([s.sampling_params.logprobs or 0 for s in states])
        return ModelRunnerOutput(
            req_ids=inputs.sample_req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            generators=[s.seeded_generator() for s in states],
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor,
                         sched: SchedulerOutput) -> dict[str, LogprobsLists]:
        result: dict[str, LogprobsLists] = {}
        for req_id, q_start in zip(inputs.req_ids, inputs.query_starts):
            state = self.states[req_id]
            k = state.sampling_params.prompt_logprobs
            if k is None or state.prompt_logprobs_done:
                continue
            start = state.num_computed_tokens
            end = min(start + sched.num_scheduled_tokens[req_id], state.num_prompt_tokens - 1)
            if end <= start:
                state.prompt_logprobs_done = True
                continue
            rows = hidden[q_start: q_start + end - start]
            targets = torch.tensor(state.token_ids[start + 1: end + 1], device=self.device)
            result[req_id] = self._chunked_prompt_logprobs(rows, targets, k)
            state.prompt_logprobs_done = end >= state.num_prompt_tokens - 1
        return result

    def _chunked_prompt_logprobs(self, rows: torch.Tensor, targets: torch.Tensor, k: int) -> LogprobsLists:
        token_ids, logprobs, ranks = [], [], []
        for lo in range(0, rows.shape[0], _PROMPT_LOGPROB_CHUNK):
            hi = lo + _PROMPT_LOGPROB_CHUNK
            part = compute_prompt_logprobs(self.model.compute_logits(rows[lo:hi]), targets[lo:hi], k)
            lists = part.to_lists([k] * part.ranks.shape[0])
            token_ids += lists.token_ids
            logprobs += lists.logprobs
            ranks += lists.ranks
        return LogprobsLists(token_ids=token_ids, logprobs=logprobs, ranks=ranks)


@dataclass
class _AttnInputs:
    batch: AttentionBatch
    positions_tensor: torch.Tensor
