"""The worker's own copy of each running request, kept in sync from SchedulerOutput diffs, and the
host arrays of one step built from it.

Per step the Python work is one short loop over the scheduled requests; everything per token or
per block is numpy over whole arrays. Block ids live in a persistent host table (one row per
request, appended to as blocks arrive, as vLLM's persistent batch keeps them), so a step gathers
its rows in one take instead of re-reading every request's list.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..multimodal.inputs import MultiModalInput
from ..sample.metadata import is_plain_greedy, reads_output_ids, reads_prompt_ids
from ..sample.seeding import position_seed
from ..sampling_params import SamplingParams
from ..step_messages import NewRequestData, SchedulerOutput


# The id a pipeline stage before the last keeps for a computed position whose id only reached it
# on the device (it never reads them back: its ids serve as inputs, and computed ones are done).
DEVICE_FED_ID = -1


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    table_row: int
    # Seeded requests: one generator per output position a step samples (more than one when it
    # verifies speculative drafts), reseeded for its position each step (`seeded_generators`).
    generators: list[torch.Generator] | None = None
    # Tokens launched steps sampled whose ids this worker has not read back yet (at most 1 when a
    # step is built; a pipeline stage before the last learns them from the scheduler, see
    # `apply`); they follow `token_ids`.
    num_unread_tokens: int = 0
    # What the sampler needs from this request, fixed with its parameters.
    plain_greedy: bool = False
    reads_prompt: bool = False
    reads_output: bool = False
    # A pooling engine's state between a prompt's chunks: the fp32 running sum of its hidden
    # states (MEAN) or its first token's (CLS); see `corectl.worker.pooler`.
    pooled_partial: torch.Tensor | None = None
    # The prompt's images (`corectl.multimodal.step` merges their encoder rows into the step).
    mm_inputs: list[MultiModalInput] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def seeded_generators(self, count: int = 1) -> list[torch.Generator] | None:
        """Generators for the next `count` output positions, each seeded from (seed, its position)
        alone (None for an unseeded request).

        A counter-based stream: the numbers drawn for an output position depend on the request's
        seed and that position only, never on what else is batched, how the logits are padded, a
        prefix-cache hit, a preemption, or how many drafts a step verifies.
        """
        if self.generators is None:
            return None
        while len(self.generators) < count:
            self.generators.append(torch.Generator(device=self.generators[0].device))
        first = len(self.token_ids) + self.num_unread_tokens - self.num_prompt_tokens
        seed = self.sampling_params.seed
        for offset, generator in enumerate(self.generators[:count]):
            generator.manual_seed(position_seed(seed, first + offset))
        return self.generators[:count]

    def seeded_generator(self) -> torch.Generator | None:
        """The generator of the next output position (`seeded_generators`)."""
        generators = self.seeded_generators(1)
        return None if generators is None else generators[0]


class BlockTable:
    """Block ids of every live request, one int32 row each, zero past a row's blocks (block 0 is
    the null block). Grows in both directions on demand."""

    def __init__(self, rows: int = 64, width: int = 64):
        self.table = np.zeros((rows, width), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self.table.shape[0])
        row = self._free_rows.pop()
        self.write(row, 0, block_ids)
        return row

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(width=max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = block_ids

    def release(self, row: int, num_blocks: int) -> None:
        self.table[row, :num_blocks] = 0
        self._free_rows.append(row)

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """A fresh [len(rows), width] array of those rows' first `width` block ids."""
        if width > self.table.shape[1]:
            self._grow(width=width)
        return self.table[rows, :width]

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.table.shape
        grown = np.zeros((rows or old_rows, width or old_width), dtype=np.int32)
        grown[:old_rows, :old_width] = self.table
        self._free_rows.extend(range(grown.shape[0] - 1, old_rows - 1, -1))
        self.table = grown


@dataclass
class HostStep:
    """One step's model inputs as host arrays: B requests in `req_ids` order, their T new tokens
    packed one request after another."""

    req_ids: list[str]
    input_ids: np.ndarray          # int64 [T]
    positions: np.ndarray          # int64 [T]
    slot_mapping: np.ndarray       # int64 [T]
    query_start_loc: np.ndarray    # int32 [B + 1]
    seq_lens: np.ndarray           # int32 [B]
    block_tables: np.ndarray       # int32 [B, W], W = blocks of the longest sequence
    query_lens: list[int]
    seq_lens_list: list[int]
    query_starts: list[int]
    max_query_len: int
    max_seq_len: int
    sample_req_ids: list[str]      # requests whose last token is in this step
    sample_rows: list[int]         # the token row of each one's last token
    # Token rows fed from the device (async scheduling): their ids are the previous step's unread
    # samples, so `input_ids` holds 0 there until the runner copies them in on the device.
    device_fed_req_ids: list[str] = field(default_factory=list)
    device_fed_rows: list[int] = field(default_factory=list)
    # A verify step (speculative decoding): each sampled request's draft tokens, in
    # `sample_req_ids` order. Its last 1 + len(drafts) rows are all sampled (`sample_rows`).
    sample_drafts: list[list[int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.req_ids)

    @property
    def verifies(self) -> bool:
        return any(self.sample_drafts)

    def logits_rows(self) -> dict[str, int]:
        """Each sampled request's first row among the sampled rows (the logits' rows)."""
        rows, row = {}, 0
        for req_id, drafts in itertools.zip_longest(self.sample_req_ids, self.sample_drafts, fillvalue=()):
            rows[req_id] = row
            row += 1 + len(drafts)
        return rows

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def samples_every_row(self) -> bool:
        """Every token row is sampled, in order (a pure-decode step): no row selection needed."""
        return len(self.sample_rows) == self.num_tokens


class RequestStates:
    """Per-request state owned by the worker, and its only writer: it applies each step's diff
    before the forward pass and records what launched steps sample (`expect_sampled` at launch,
    `receive_sampled` when the host reads the ids)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.states: dict[str, CachedRequestState] = {}
        self.block_table = BlockTable()
        # Requests asking for prompt logprobs with prompt positions still to compute them for.
        self.awaiting_prompt_logprobs: set[str] = set()

    def apply(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self._forget(req_id)
        for new in sched.new_requests:
            self._forget(new.req_id)
            self.states[new.req_id] = self._make_state(new)
        cached = sched.cached_requests
        for req_id, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.states[req_id]
            if new_blocks:
                self.block_table.write(state.table_row, len(state.block_ids), new_blocks)
                state.block_ids.extend(new_blocks)
            state.num_computed_tokens = computed
        for req_id, computed, tokens in zip(cached.req_ids, cached.num_computed_tokens, cached.new_token_ids):
            # Pipeline stages: the step's tokens the host knows, in place (the last stage and a
            # prompt's later chunks have them already). A stage before the last never reads what
            # the last samples: positions before `computed` whose ids it took on the device hold
            # DEVICE_FED_ID. Every id placed so is one fewer unread (the stage's count of tokens holds).
            state = self.states[req_id]
            token_ids = state.token_ids
            total = len(token_ids) + state.num_unread_tokens
            token_ids.extend([DEVICE_FED_ID] * (computed - len(token_ids)))
            token_ids[computed:computed + len(tokens)] = tokens
            # A verify step emitted its accepted drafts too, past the one token the stage counted;
            # its request waited for that verdict, so none of its tokens is in flight now.
            state.num_unread_tokens = max(0, total - len(token_ids))

    def expect_sampled(self, states: list[CachedRequestState]) -> None:
        """A step being launched samples one token for each of these requests; its id stays on
        the device (and the next step is built as if it were known) until `receive_sampled`."""
        for state in states:
            state.num_unread_tokens += 1

    def receive_sampled(self, states: list[CachedRequestState], token_ids: list[int]) -> None:
        """The host has read the ids that `expect_sampled` announced, one per state, in order."""
        for state, token in zip(states, token_ids):
            # A request forgotten since launch (finished, aborted, preempted) is nobody's state
            # any more: the scheduler decides what becomes of its token.
            if self.states.get(state.req_id) is state:
                state.token_ids.append(token)
                state.num_unread_tokens -= 1

    def receive_verified(self, states: list[CachedRequestState], token_ids: list[list[int]]) -> None:
        """The host has read what a verify step emitted: each state's accepted drafts and the
        token after them, in place of the one token `expect_sampled` announced."""
        for state, tokens in zip(states, token_ids):
            if self.states.get(state.req_id) is state:
                state.token_ids.extend(tokens)
                state.num_unread_tokens -= 1

    def keep_pooled(self, state: CachedRequestState, partial: torch.Tensor) -> None:
        """A pooling request's running state once this step's chunk is in (`corectl.worker.pooler`)."""
        state.pooled_partial = partial

    def prompt_logprobs_done(self, req_id: str) -> None:
        """Every prompt position of the request has had its logprobs computed."""
        self.awaiting_prompt_logprobs.discard(req_id)

    def build_step(self, sched: SchedulerOutput, block_size: int,
                   drafts: dict[str, list[int]] | None = None) -> HostStep:
        """The host arrays of a non-empty step whose diff has been applied; `drafts`: the step's
        draft tokens when they are not the scheduler's own (`spec_token_ids`)."""
        drafts_of = sched.spec_token_ids if drafts is None else drafts
        req_ids = list(sched.num_scheduled_tokens)
        query_lens = list(sched.num_scheduled_tokens.values())
        token_ids: list[int] = []
        starts, rows, query_starts, sample_req_ids, sample_rows = [], [], [], [], []
        fed_req_ids, fed_rows, sample_drafts = [], [], []
        for req_id, n in zip(req_ids, query_lens):
            state = self.states[req_id]
            start = state.num_computed_tokens
            query_starts.append(len(token_ids))
            drafts = drafts_of.get(req_id, [])
            num_known = n - len(drafts)
            known = state.token_ids[start:start + num_known]
            token_ids += known
            if len(known) < num_known:
                if len(known) + 1 < num_known or not state.num_unread_tokens:
                    raise RuntimeError(f"request {req_id!r}: {num_known} tokens scheduled from position {start}, "
                                       f"only {len(known)} known and {state.num_unread_tokens} unread")
                fed_req_ids.append(req_id)
                fed_rows.append(len(token_ids))
                token_ids.append(0)
            token_ids += drafts
            starts.append(start)
            rows.append(state.table_row)
            if start + num_known == len(state.token_ids) + state.num_unread_tokens:
                sample_req_ids.append(req_id)
                sample_rows.extend(range(len(token_ids) - 1 - len(drafts), len(token_ids)))
                sample_drafts.append(drafts)
        lens = np.array(query_lens, dtype=np.int64)
        seq_lens = np.array(starts, dtype=np.int64) + lens
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int32)
        query_start_loc[1:] = np.cumsum(lens)
        # Position of token t of request i: t - query_start[i] + start[i].
        positions = np.arange(len(token_ids), dtype=np.int64) + np.repeat(seq_lens - lens - query_start_loc[:-1], lens)
        max_seq_len = int(seq_lens.max())
        tables = self.block_table.gather(rows, -(-max_seq_len // block_size))
        token_rows = np.repeat(np.arange(len(req_ids)), lens)
        blocks = tables[token_rows, positions // block_size].astype(np.int64)
        return HostStep(
            req_ids=req_ids,
            input_ids=np.array(token_ids, dtype=np.int64),
            positions=positions,
            slot_mapping=blocks * block_size + positions % block_size,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=tables,
            query_lens=query_lens,
            seq_lens_list=seq_lens.tolist(),
            query_starts=query_starts,
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
            sample_req_ids=sample_req_ids,
            sample_rows=sample_rows,
            device_fed_req_ids=fed_req_ids,
            device_fed_rows=fed_rows,
            sample_drafts=sample_drafts if sched.spec_token_ids else [],
        )

    def _forget(self, req_id: str) -> None:
        self.awaiting_prompt_logprobs.discard(req_id)
        state = self.states.pop(req_id, None)
        if state is not None:
            self.block_table.release(state.table_row, len(state.block_ids))

    def _make_state(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        # A resumed request already reported its prompt logprobs before it was preempted.
        if (params.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens
                and new.num_computed_tokens < new.num_prompt_tokens):
            self.awaiting_prompt_logprobs.add(new.req_id)
        generators = None
        if params.seed is not None and not params.greedy:
            generators = [torch.Generator(device=self.device)]
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            table_row=self.block_table.add(new.block_ids),
            generators=generators,
            plain_greedy=is_plain_greedy(params),
            reads_prompt=reads_prompt_ids(params),
            reads_output=reads_output_ids(params),
            mm_inputs=list(new.mm_inputs),
        )

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.states[req_id]
