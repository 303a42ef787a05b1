"""Hardware-neutral model runner: builds a step's inputs, runs the model, samples.

Platforms subclass it only for what differs (how host arrays reach the device and results come
back, graphs); the input construction and sampling logic live here once. A step reads the
device back once, for the sampled ids: inputs travel as whole arrays, and the rows to sample are
selected with an uploaded index, never a Python list (which torch would copy synchronously).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..attention import AttentionBackend, AttentionBatch, ForwardContext, longest_first
from ..distributed import first_rank_copy
from ..multimodal.step import MultiModalStep
from ..platform import PlatformCaps
from ..sample import Sampler, SamplingMetadata, compute_prompt_logprobs
from ..sample.grammar import apply_grammar_bitmask
from ..sample.metadata import PLAIN_GREEDY, UnreadOutputTokens
from ..sample.random_sampling import RaceKernel
from ..sample.transfer import DeviceTarget, to_device
from ..spec_decode.draft_model import DraftModelProposer, DraftRequest
from ..spec_decode.eagle import EagleProposer
from ..spec_decode.rejection import VerifyLayout
from ..spec_decode.verify import expand_rows, verify
from ..step_messages import GrammarBitmask, LogprobsLists, ModelRunnerOutput, SchedulerOutput
from .inflight import HostFetch, InflightStep, PooledRows, SampledRows, fetch_now
from .pipeline_stage import PipelineStage
from .pooler import Pooler
from .request_states import DEVICE_FED_ID, CachedRequestState, HostStep, RequestStates
from .sampled_ids import RecentSampledIds

if TYPE_CHECKING:
    from ..lora.manager import AdapterManager

_PROMPT_LOGPROB_CHUNK = 512


@dataclass
class StepInputs:
    """A step's device tensors beside the host arrays they came from."""

    host: HostStep
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionBatch
    # Token rows whose hidden states are sampled; None when every row is (pure decode).
    logits_indices: torch.Tensor | None


def logits_index(host: HostStep) -> np.ndarray | None:
    """The token rows to sample, as an index to upload; None when every row is, in order."""
    if not host.sample_rows or host.samples_every_row:
        return None
    return np.array(host.sample_rows, dtype=np.int64)


class ModelRunner:
    """`caps` are the platform's: how the sampler draws and whether host data bound for the device
    can be staged in pinned memory; `logprobs_mode` what sampled logprobs report (`--logprobs-mode`);
    `race` the worker's one-pass exponential race (`Worker.race_kernel`), None for the torch form."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 block_size: int, vocab_size: int, eos_token_id: int | None, caps: PlatformCaps, *,
                 logprobs_mode: str = "raw_logprobs", race: RaceKernel | None = None):
        self.model = model
        self.backend = backend
        self.device = device
        self.target = DeviceTarget(device, caps.pinned_memory)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.sampler = Sampler(caps.sampling_draw, logprobs_mode, race)
        self.states = RequestStates(device)
        self.kv_caches: list[torch.Tensor] = []
        # Recent steps' sampled ids on the device, for the steps that continue their requests.
        self.sampled = RecentSampledIds()
        # Set by the worker on a pooling engine: steps pool finished prompts instead of sampling.
        self.pooler: Pooler | None = None
        # Set by the worker when LoRA is on: the adapter manager (corectl.lora.manager).
        self.lora: AdapterManager | None = None
        # A launched step's logits waiting for their grammar masks (`grammar_pending`).
        self._awaiting_masks: tuple[HostStep, torch.Tensor, InflightStep] | None = None
        # Set by the worker for draft-model and EAGLE speculation: fills the scheduler's draft
        # placeholders, and sees each step's hidden states (EAGLE's head reads them).
        self.drafter: DraftModelProposer | EagleProposer | None = None
        # The drafter is whole on each of several tensor-parallel ranks (draft_tensor_parallel_size 1).
        self.drafts_alone = False
        # Under pipeline parallelism: moves activations between stages (`attach_stage`).
        self.stage: PipelineStage | None = None
        # A vision-language model's image rows and M-RoPE positions (corectl.multimodal.step).
        self.multimodal = MultiModalStep(model, self.to_device) if hasattr(model, "encode_images") else None

    def attach_stage(self, stage: PipelineStage) -> None:
        """Run as one pipeline stage: a request goes on several steps after its own, so the ids of
        as many steps stay at hand."""
        self.stage = stage
        self.sampled = RecentSampledIds(stage.sampled_depth)

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step and wait for its sampled ids."""
        return self.launch(sched).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> InflightStep:
        """Queue a step's forward pass and sampling on the device; the ids come with `result()`.

        Launched steps may be unread when the next is launched (one, or 2(P - 1) with P pipeline
        stages): their ids feed the rows of the new step that decode their requests
        (`HostStep.device_fed_rows`). A step whose grammar masks are pending stops at its logits;
        `sample_pending` samples it.
        """
        if self._awaiting_masks is not None:
            raise RuntimeError("a step was launched before the previous one received its grammar masks")
        self.states.apply(sched)
        if self.lora is not None:
            self.lora.apply(sched)
        if self.drafter is not None:
            self.drafter.forget(sched.finished_req_ids)
        if self.multimodal is not None:
            self.multimodal.forget(sched.finished_req_ids, sched.encoder_evicted)
        if sched.is_empty:
            return InflightStep.done()
        inputs = self.upload(self.states.build_step(sched, self.block_size, self._drafts(sched)))
        self._feed_unread_ids(inputs)
        drafts = self._pass_drafts(inputs.host)
        hidden = self._run_with_adapters(inputs)
        if hidden is None:  # a stage before the last: the next stage goes on from here
            self._expect_from_last_stage(inputs.host)
            return InflightStep.done()
        if self.drafter is not None:
            hidden = self.drafter.observe(inputs.host, hidden, self.states)
        if self.pooler is not None:
            return self._pool(inputs.host, hidden)
        prompt_logprobs = self._prompt_logprobs(inputs, hidden, sched)
        if not inputs.host.sample_req_ids:
            return InflightStep.done(prompt_logprobs)
        if inputs.logits_indices is not None:
            hidden = hidden.index_select(0, inputs.logits_indices)
        logits = self.model.compute_logits(hidden)
        if sched.grammar_pending:
            step = InflightStep(None, prompt_logprobs)
            self._awaiting_masks = (inputs.host, logits, step)
            return step
        if sched.grammar_bitmask is not None:
            self._apply_grammar(inputs.host, logits, sched.grammar_bitmask)
        return InflightStep(self._sample(inputs.host, logits, drafts), prompt_logprobs)

    @torch.inference_mode()
    def sample_pending(self, grammar: GrammarBitmask | None) -> None:
        """Mask and sample the launched step that waits for its grammar masks."""
        if self._awaiting_masks is None:
            raise RuntimeError("grammar masks arrived for no step waiting for them")
        host, logits, step = self._awaiting_masks
        self._awaiting_masks = None
        if grammar is not None:
            self._apply_grammar(host, logits, grammar)
        step.set_sampled(self._sample(host, logits))

    def _drafts(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """The step's draft tokens: the scheduler's (n-gram), or the draft model's in place of its
        placeholders. A drafting request has no token in flight (under async scheduling it sits out
        the step after its own), so its tokens are known here."""
        if self.drafter is None or not sched.spec_token_ids:
            return sched.spec_token_ids
        states = self.states
        if self.stage is not None:
            for req_id in sched.spec_token_ids:
                self._restore_accepted(req_id, states[req_id].token_ids)
        drafts = self.drafter.propose([
            DraftRequest(req_id, states[req_id].token_ids, states[req_id].num_prompt_tokens, len(placeholders))
            for req_id, placeholders in sched.spec_token_ids.items()
        ])
        return self._first_ranks(drafts) if self.drafts_alone else drafts

    def _first_ranks(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """The drafts the stage's first tensor-parallel rank proposed, on every rank: a draft held
        whole by each rank runs alone there, and one rank's last bits (a GEMM its own timing
        chose) must not part its verify step from the others'."""
        flat = [token for tokens in drafts.values() for token in tokens]
        if not flat:
            return drafts
        agreed = iter(first_rank_copy(torch.tensor(flat, dtype=torch.int64, device=self.device)).tolist())
        return {req_id: [next(agreed) for _ in tokens] for req_id, tokens in drafts.items()}

    def _restore_accepted(self, req_id: str, token_ids: list[int]) -> None:
        """The first of several stages: the drafts the last one accepted hold DEVICE_FED_ID here (the
        scheduler sends a continuing request's tokens from its computed position on), and they are
        the drafter's own last proposals."""
        start, drafts = self.drafter.last_proposal(req_id)
        for position, token in enumerate(drafts, start):
            if position < len(token_ids) and token_ids[position] == DEVICE_FED_ID:
                token_ids[position] = token

    def _pass_drafts(self, host: HostStep) -> torch.Tensor | None:
        """Pipeline stages with a draft model on the first: the step's drafts (in the step's order),
        sent on toward the last stage, which gets them back to verify; None elsewhere (the other
        stages lay the scheduler's placeholders out in their place, which their layers never read)."""
        stage = self.stage
        if stage is None or not stage.drafts_on_first or not host.verifies:
            return None
        flat = [token for drafts in host.sample_drafts for token in drafts]
        drafts = self.to_device([np.array(flat, dtype=np.int64)])[0] if stage.is_first else None
        return stage.pass_drafts(drafts, len(flat))

    def _pool(self, host: HostStep, hidden: torch.Tensor) -> InflightStep:
        """A pooling engine's step: the vectors of the prompts it finished start for the host."""
        vectors = self.pooler.pool(host, hidden, self.states, self.to_device)
        if vectors is None:
            return InflightStep.done()
        return InflightStep(None, {}, PooledRows(host.sample_req_ids, self.fetch_to_host([vectors])))

    def _apply_grammar(self, host: HostStep, logits: torch.Tensor, grammar: GrammarBitmask) -> None:
        """Forbid what each constrained row's grammar does not allow next, before the sampler reads
        the logits (logprobs included, as vLLM does); the other rows are not touched."""
        row_of = host.logits_rows()
        counts = grammar.num_rows or [1] * len(grammar.req_ids)
        # A verify step's request has a mask row per verified position, over its consecutive logits rows.
        rows = [row_of[req_id] + j for req_id, count in zip(grammar.req_ids, counts) for j in range(count)]
        # A copy: torch will not share the read-only buffer of the message's bytes.
        arrays = [np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(len(rows), grammar.width).copy()]
        if rows != list(range(logits.shape[0])):
            arrays.append(np.array(rows, dtype=np.int64))
        bitmask, *index = self.to_device(arrays)
        apply_grammar_bitmask(logits, bitmask, index[0] if index else None)

    def _feed_unread_ids(self, inputs: StepInputs) -> None:
        """Write the ids earlier steps sampled, still on the device, into the rows fed from them
        (pipeline stages after the first read activations, not ids)."""
        host = inputs.host
        if not host.device_fed_rows or (self.stage is not None and not self.stage.is_first):
            return
        ids = self.sampled.gather(host.device_fed_req_ids, self.to_device)
        if host.device_fed_rows == list(range(len(ids))):
            inputs.input_ids[:len(ids)].copy_(ids)
            return
        (rows,) = self.to_device([np.array(host.device_fed_rows, dtype=np.int64)])
        inputs.input_ids.index_copy_(0, rows, ids)

    def _expect_from_last_stage(self, host: HostStep) -> None:
        """A stage before the last: the step samples a token for each of `host.sample_req_ids`
        that the host has not seen; the first stage starts receiving their ids from the last."""
        if not host.sample_req_ids or self.pooler is not None:
            return
        self.states.expect_sampled([self.states[r] for r in host.sample_req_ids])
        if self.stage.is_first:
            ids, arrival = self.stage.receive_sampled(len(host.sample_req_ids))
            self.sampled.record(ids, host.sample_req_ids, arrival)

    def _run_with_adapters(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass, with the step's LoRA adapters in place when LoRA is on."""
        if self.lora is None:
            return self.run_model(inputs)
        self.lora.prepare(inputs.host, self.to_device)
        try:
            return self.run_model(inputs)
        finally:
            self.lora.finish_step()

    def run_model(self, inputs: StepInputs) -> torch.Tensor | None:
        """The forward pass over the step's tokens (None on a pipeline stage before the last);
        platforms override to replay captured graphs."""
        # The indices come from the runner's own block tables: validating them would only read
        # them back from the device, a host sync per step.
        if self.multimodal is not None:
            inputs.attn.bidirectional_spans = self.multimodal.bidirectional_spans(inputs.host, self.states)
        metadata = self.backend.build_metadata(inputs.attn, check_indices=False)
        ctx = ForwardContext(self.backend, metadata, self.kv_caches)
        positions, extra = inputs.positions, {}
        if self.multimodal is not None:
            embeds, positions = self.multimodal.prepare(inputs.host, inputs.input_ids, positions, self.states,
                                                        embeds=self.stage is None or self.stage.is_first)
            extra = {"inputs_embeds": embeds}
        if self.stage is not None:
            return self.stage.run(self.model, inputs.input_ids, positions, ctx, **extra)
        return self.model(inputs.input_ids, positions, ctx, **extra)

    def upload(self, host: HostStep) -> StepInputs:
        """Move the step's host arrays to the device as the model and attention backend take them."""
        arrays = [host.input_ids, host.positions, host.slot_mapping, host.query_start_loc, host.seq_lens,
                  host.block_tables]
        ordered = host.max_query_len == 1 and self.backend.uses_decode_order(host.num_seqs, 1, host.max_seq_len)
        if ordered:
            arrays.append(longest_first(host.seq_lens))
        index = logits_index(host)
        tensors = self.to_device(arrays if index is None else [*arrays, index])
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables = tensors[:6]
        attn = AttentionBatch(
            decode_order=tensors[6] if ordered else None,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_lens_host=host.query_lens,
            seq_lens_host=host.seq_lens_list,
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
            block_size=self.block_size,
        )
        return StepInputs(host, input_ids, positions, attn, None if index is None else tensors[-1])

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Host arrays as device tensors; on the CPU they are shared, not copied."""
        return [torch.from_numpy(a).to(self.device, non_blocking=True) for a in arrays]

    def _sample(self, host: HostStep, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> SampledRows:
        """`drafts`: a verify step's draft tokens where the host step holds placeholders (`_pass_drafts`)."""
        if host.verifies:
            return self._verify(host, logits, drafts)
        states = [self.states[r] for r in host.sample_req_ids]
        out = self.sampler(logits, self._sampling_metadata(states))
        self.states.expect_sampled(states)
        self._record_sampled(out.sampled_token_ids, host.sample_req_ids)
        tensors, num_logprobs = [out.sampled_token_ids], None
        if out.logprobs is not None:
            tensors += [out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks]
            num_logprobs = [s.sampling_params.logprobs or 0 for s in states]
        return SampledRows(self.states, states, self.fetch_to_host(tensors), num_logprobs)

    def _verify(self, host: HostStep, logits: torch.Tensor, drafts: torch.Tensor | None) -> SampledRows:
        """A verify step (speculative decoding): each request's accepted drafts and one more token.
        Under async scheduling only the requests without drafts feed the next step from the device
        (a drafting one waits for its verdict), and their one token is column 0."""
        states = [self.states[r] for r in host.sample_req_ids]
        layout = VerifyLayout.build(host.sample_drafts, self.target)
        if drafts is not None:
            layout.draft_ids.masked_scatter_(~layout.is_bonus, drafts)
        verified, logprobs = verify(logits, self._sampling_metadata(states, host.sample_drafts), layout, self.sampler)
        self.states.expect_sampled(states)
        self._record_sampled(verified.token_ids[:, 0], host.sample_req_ids)
        tensors, num_logprobs = [verified.token_ids, verified.num_emitted], None
        if logprobs is not None:
            tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
            num_logprobs = [s.sampling_params.logprobs or 0 for s, d in zip(states, host.sample_drafts)
                            for _ in range(len(d) + 1)]
        rows = [len(d) + 1 for d in host.sample_drafts]
        return SampledRows(self.states, states, self.fetch_to_host(tensors), num_logprobs, rows)

    def _record_sampled(self, ids: torch.Tensor, req_ids: list[str]) -> None:
        """Keep a step's sampled ids for the steps that continue its requests; the last of several
        pipeline stages sends them to the first."""
        self.sampled.record(ids, req_ids)
        if self.stage is not None:
            self.stage.send_sampled(ids)

    def fetch_to_host(self, tensors: list[torch.Tensor]) -> HostFetch:
        """Start copying a step's results to the host; platforms with an asynchronous device
        override this so the copy does not wait for work queued after it."""
        return fetch_now(tensors)

    def _sampling_metadata(self, states: list[CachedRequestState],
                           drafts: list[list[int]] | None = None) -> SamplingMetadata:
        """One row per state; with `drafts` (a verify step) one per verified position of each."""
        if all(s.plain_greedy for s in states):
            return PLAIN_GREEDY
        # Token histories are copied only for the rows whose penalties or min_tokens read them.
        params = [s.sampling_params for s in states]
        prompts = [s.token_ids[: s.num_prompt_tokens] if s.reads_prompt else () for s in states]
        outputs = [s.output_token_ids if s.reads_output else () for s in states]
        if drafts is None:
            generators = [s.seeded_generator() for s in states]
            unread = self._unread_output_tokens(states)
        else:
            per_position = [s.seeded_generators(len(d) + 1) for s, d in zip(states, drafts)]
            rows = expand_rows(params, prompts, outputs, per_position, drafts)
            params, prompts, outputs, generators = rows.params, rows.prompt_token_ids, rows.output_token_ids, rows.generators
            unread = self._unread_output_tokens(states, rows.first_rows)
        return SamplingMetadata.build(params=params, prompt_token_ids=prompts, output_token_ids=outputs,
                                      generators=generators, eos_token_id=self.eos_token_id,
                                      vocab_size=self.vocab_size, target=self.target, unread=unread)

    def _unread_output_tokens(self, states: list[CachedRequestState],
                              first_rows: list[int] | None = None) -> UnreadOutputTokens | None:
        """The history rows' tokens that the previous step sampled and the host has not read;
        `first_rows`: each state's row (a verify step's; only requests without drafts have one)."""
        unread = [i for i, s in enumerate(states) if s.num_unread_tokens and s.reads_output]
        if not unread:
            return None
        rows = unread if first_rows is None else [first_rows[i] for i in unread]
        return UnreadOutputTokens(rows, self.sampled.gather([states[i].req_id for i in unread], self.to_device))

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor,
                         sched: SchedulerOutput) -> dict[str, LogprobsLists]:
        result: dict[str, LogprobsLists] = {}
        awaiting = self.states.awaiting_prompt_logprobs
        if not awaiting:
            return result
        for req_id, q_start in zip(inputs.host.req_ids, inputs.host.query_starts):
            if req_id not in awaiting:
                continue
            state = self.states[req_id]
            start = state.num_computed_tokens
            end = min(start + sched.num_scheduled_tokens[req_id], state.num_prompt_tokens - 1)
            if end > start:
                rows = hidden[q_start: q_start + end - start]
                targets = to_device(state.token_ids[start + 1: end + 1], torch.int64, self.target)
                result[req_id] = self._chunked_prompt_logprobs(rows, targets, state.sampling_params.prompt_logprobs)
            if end >= state.num_prompt_tokens - 1:
                self.states.prompt_logprobs_done(req_id)
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
