"""The scheduler: which requests run each step, with how many tokens, in which KV blocks.

There are no prefill or decode phases, only tokens (vLLM V1's scheme). Every request has
`num_computed_tokens`; each step hands out at most `max_num_batched_tokens`, giving each request
up to `num_tokens - num_computed_tokens` tokens: 1 for a decode (its newest sampled token has no
K/V yet), the rest of the prompt (or as much as the budget allows) for a prefill. Running requests
are served first, in order, then waiting ones (prefix-cache lookup, then a chunk of the rest),
while fewer than `max_num_seqs` run. `num_computed_tokens` advances when a step is scheduled, so
chunked prefill and prefix hits need no special cases.

When a running request cannot get KV blocks, the newest running request (FCFS) or the one with
the largest (priority, arrival_time) is preempted: its blocks are freed, it restarts from zero at
the front of the waiting queue, and it later returns to the worker as a new request carrying
every token so far, which the worker recomputes (the same K/V, so greedy output is unchanged).

Async scheduling: the engine may schedule step N+1 before step N's sampled ids arrive. What the
steps in flight owe is counted in `inflight.py` (`StepsInFlight`): a request's tokens in flight
let step N+1 give it the next position while the worker feeds the id from the device. Tokens that
arrive for a request finished or aborted meanwhile are dropped, even if a new request has taken its
id; one that arrives for a request preempted meanwhile joins its tokens (it is recomputed with them
on resume). A request whose tokens in flight will end it by length is not scheduled again.

Pipeline parallelism (`pipeline_stages` > 1): a step never takes a request that one of the last
`stages - 1` steps in flight holds, and takes at most its share of the requests (`ceil(min(running
+ waiting, max_num_seqs) / stages)`), so the steps in the stages at once are micro-batches of
different requests. A request of an older step in flight goes on as under async scheduling, its
next id fed on the device (the last stage sends it to the first), unless a grammar constrains it:
its mask needs the token. Each continuing request's known tokens travel with its step
(`new_token_ids`): the stages before the last never read the ids the last one samples.

Structured outputs: `grammar_steps.py` (`GrammarSteps`) says which rows of a step carry grammar
masks and when they are filled.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..engine.messages import EngineCoreOutput, SchedulerStats
from ..errors import ConfigError, QueueFullError
from ..kv import KVCacheManager
from ..kv.sizing import blocks_per_sequence
from ..kv_transfer.base import KVConnectorScheduler
from ..lora.admission import AdapterAdmission
from ..multimodal.budget import ENCODER_CACHE_ROWS, EncoderBudget
from ..multimodal.cache_manager import EncoderCacheManager
from ..request import Request, RequestStatus
from ..spec_decode.scheduling import DraftPlanner
from ..step_messages import GrammarBitmask, SchedulerOutput
from .grammar_steps import GrammarSteps
from .inflight import StepsInFlight
from .stats import IterationCounts, lora_stats, spec_decode_stats
from .kv_loads import KVLoads
from .prompt_logprobs import PromptLogprobsBuffer
from .prefill_limits import PrefillLimits
from .request_queue import create_request_queue
from .step_plan import StepPlan
from .step_results import StepResults

if TYPE_CHECKING:
    from ..structured.manager import StructuredOutputManager


class Scheduler(StepResults):
    def __init__(self, config: EngineConfig, max_model_len: int, num_blocks: int,
                 structured: StructuredOutputManager | None = None, sliding_window: int | None = None,
                 defer_grammar: bool = False, connector: KVConnectorScheduler | None = None,
                 bidirectional_image_tokens: int | None = None):
        """`structured` serves requests that ask for structured output (None: refuse them);
        `sliding_window`: the window every layer of the model attends within, if one does
        (`ModelInfo.sliding_window`), so blocks before it go back to the pool as requests run;
        `defer_grammar`: steps leave their masks pending (async scheduling, see the module doc);
        `connector`: the scheduler half of a KV connector (`corectl.kv_transfer`), which loads prompt
        tokens from outside and hears of evicted prefix blocks and finished requests;
        `bidirectional_image_tokens`: the longest image whose tokens attend to each other both ways
        (`ModelInfo`, Gemma 3): no chunk and no prefix hit ends inside such an image."""
        self.connector = connector
        whole_images = bidirectional_image_tokens is not None
        if whole_images and config.max_num_batched_tokens < bidirectional_image_tokens:
            raise ConfigError("max_num_batched_tokens", f"{config.max_num_batched_tokens} tokens per step cannot hold "
                              f"one image of {bidirectional_image_tokens} tokens, which this model prefills in one "
                              "step (its image tokens attend to each other both ways); raise max_num_batched_tokens")
        self.whole_images = whole_images
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, sliding_window,
                                 on_evict=None if connector is None else connector.block_evicted,
                                 whole_images=whole_images)
        self.kv_loads = None if connector is None else KVLoads(connector, self.kv, config.block_size)
        capacity = self.kv.num_usable_blocks * config.block_size
        needed = blocks_per_sequence(max_model_len, config.block_size, sliding_window, config.max_num_batched_tokens)
        # A request that cannot fit the cache even alone would be preempted forever.
        if self.kv.num_usable_blocks < needed:
            raise ConfigError(
                "max_model_len",
                f"{max_model_len} tokens do not fit the KV cache ({self.kv.num_usable_blocks} blocks of "
                f"{config.block_size} = {capacity} tokens, {needed} blocks needed); lower max_model_len "
                "or give the KV cache more memory",
            )
        self.config = config
        self.max_model_len = max_model_len
        self.waiting = create_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, list[Request]] = {}
        # Ordered set of ids the worker must forget at the next step (finished, aborted, preempted).
        self._forget: dict[str, None] = {}
        self.in_flight = StepsInFlight()
        # Prompt tokens whose K/V this engine computed (a KV connector's come from `kv_loads`).
        self.prompt_tokens_computed = 0
        self._prompt_logprobs = PromptLogprobsBuffer()
        self.num_preemptions = 0
        self._iterations = IterationCounts()
        self.structured = structured
        self.grammar = GrammarSteps(structured, defer_grammar, self.in_flight)
        # A pooling engine's requests are prefill only: each ends with its pooled vector.
        self.pooling = config.runner == "pooling"
        # LoRA: no step mixes more than max_loras adapters (corectl/lora/admission.py).
        self.adapters = AdapterAdmission(config.max_loras) if config.enable_lora else None
        spec = config.speculative_config
        # Speculative decoding (n-gram drafts; see corectl/spec_decode/scheduling.py).
        self.drafts = None if spec is None or self.pooling else DraftPlanner(spec, max_model_len)
        # Pipeline parallelism: as many micro-batches in flight as stages, each of other requests.
        self.pipeline_stages = config.pipeline_parallel_size
        # Which images the worker's encoder cache holds (corectl/multimodal/cache_manager.py).
        self.encoder_cache = EncoderCacheManager(ENCODER_CACHE_ROWS)
        self.prefills = PrefillLimits(config, max_model_len)

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request that passed intake (`engine/intake.py`: a unique id, a prompt and max_tokens
        that fit the context); raises QueueFullError when the queue bound leaves no room."""
        limit = self.config.max_queued_requests
        # Samples of an already admitted request always join it: a request's n samples are all in or all out.
        if limit is not None and req.group_id not in self._groups and len(self.waiting) >= limit:
            raise QueueFullError(f"the request queue is full ({limit} requests waiting); retry later")
        if req.sampling_params.structured_outputs is not None:
            self.structured.add(req)  # intake refused grammars on an engine without a tokenizer
        self.waiting.add(req)
        self._requests[req.request_id] = req
        self._groups.setdefault(req.group_id, []).append(req)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish the given requests as aborted and free their blocks; unknown ids are ignored."""
        aborted = [req for req in map(self._requests.get, dict.fromkeys(req_ids)) if req is not None]
        running = {req for req in aborted if req.status == RequestStatus.RUNNING}
        if running:
            self.running = [req for req in self.running if req not in running]
        loading = {req for req in aborted if self.kv_loads is not None and self.kv_loads.discard(req)}
        if len(running) + len(loading) < len(aborted):
            self.waiting.remove({req for req in aborted if req not in running and req not in loading})
        for req in aborted:
            if req in running:
                self._forget[req.request_id] = None
            req.status = RequestStatus.FINISHED_ABORTED
            self._release(req)
        return aborted

    def reap_grammar_failures(self) -> list[EngineCoreOutput]:
        """End the waiting requests whose grammar failed to compile or overran the compile bound;
        their abort outputs carry the reason."""
        failed = self.structured.failures() if self.structured is not None else []
        self.abort_requests([req.request_id for req, _ in failed])
        return [EngineCoreOutput(req.request_id, [], finish_reason="abort", error=reason) for req, reason in failed]

    def get_request(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or KV-connector work due or under way (saves to issue, loads to hear of)."""
        return bool(self._requests) or (self.connector is not None and self.connector.has_work())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, and those waiting for a KV load (vLLM counts both as waiting)."""
        return len(self.waiting) + (0 if self.kv_loads is None else self.kv_loads.num_parked)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            iteration_tokens_counts=list(self._iterations.counts),
            iteration_tokens_sum=self._iterations.total,
            prompt_tokens_computed=self.prompt_tokens_computed,
            **({} if self.kv_loads is None else self.kv_loads.counters()),
            **lora_stats(self.adapters, self._requests),
            **spec_decode_stats(self.drafts),
        )

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(budget=self.config.max_num_batched_tokens, max_seqs=self._micro_batch_seqs(),
                        encoder=EncoderBudget(self.config.max_num_batched_tokens, self.encoder_cache,
                                              self.whole_images))
        self._schedule_running(plan)
        # After a preemption the cache is short: admitting new work would only preempt again.
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._emit(plan)

    def _micro_batch_seqs(self) -> int | None:
        """Under pipeline parallelism a step takes its share of the requests, so the next steps
        find others to fill the stages with (a request runs in one micro-batch at a time)."""
        if self.pipeline_stages == 1:
            return None
        active = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-active // self.pipeline_stages))

    def _schedule_running(self, plan: StepPlan) -> None:
        # Pipeline stages: the requests of the steps in the stages now (other micro-batches).
        in_stages = self.in_flight.held_by_latest(self.pipeline_stages - 1) if self.pipeline_stages > 1 else None
        index = 0
        while index < len(self.running) and not plan.full:
            req = self.running[index]
            if self._ends_by_length(req) or self._awaits_pooled(req) or self._awaits_verdict(req):
                index += 1
                continue
            if in_stages is not None and (req in in_stages or self._grammar_awaits_token(req)):
                # A prompt it leaves unfinished still counts.
                if req.num_computed_tokens < req.num_tokens:
                    self.prefills.occupy(req, plan)
                index += 1
                continue
            wanted = req.num_tokens + self.in_flight.num_tokens(req) - req.num_computed_tokens
            num_tokens = self._chunk(req, req.num_computed_tokens, wanted, plan)
            if num_tokens == 0:  # its images wait for encoder room: its prompt stays unfinished
                self.prefills.occupy(req, plan)
            if num_tokens == 0 or not self.prefills.admits(req, num_tokens < wanted, plan):
                index += 1
                continue
            drafts = self._drafts_for(req, num_tokens, plan.budget)
            new_ids = self.kv.allocate(req, num_tokens + len(drafts))
            if new_ids is None and drafts:
                # Speculation never preempts: without room for its drafts the request decodes plainly.
                drafts = []
                new_ids = self.kv.allocate(req, num_tokens)
            while new_ids is None:
                victim_index = self._victim_index()
                victim = self.running.pop(victim_index)
                self._preempt(victim, plan)
                if victim is req:
                    return
                if victim_index < index:
                    index -= 1
                new_ids = self.kv.allocate(req, num_tokens)
            plan.take(req, num_tokens + len(drafts))
            plan.running[req.request_id] = (req, new_ids)
            if drafts:
                plan.drafts[req.request_id] = drafts
            index += 1

    def _grammar_awaits_token(self, req: Request) -> bool:
        """Pipeline stages: a token of the request in flight decides its grammar's next mask (masks
        are not left pending there)."""
        return self.in_flight.num_tokens(req) > 0 and self.grammar.holds(req)

    def _chunk(self, req: Request, num_computed: int, wanted: int, plan: StepPlan) -> int:
        """The tokens of the `wanted` ones from `num_computed` on that `req` computes this step: within
        the budget, the prefill threshold and, for images, what the encoder cache holds or the step's
        encoder budget (the token budget) and the cache have room to encode."""
        num_tokens = self.prefills.cap(req, min(wanted, plan.budget))
        if not req.mm_inputs:
            return num_tokens
        return plan.encoder.fit(req, num_computed, num_tokens)

    def _drafts_for(self, req: Request, num_tokens: int, budget: int) -> list[int]:
        """Draft tokens for a request whose step computes only its newest token (speculation
        on); under a grammar, cut before the first one it refuses."""
        if (self.drafts is None or num_tokens != 1 or req.num_computed_tokens + 1 != req.num_tokens
                or not self.drafts.drafts_allowed(len(self.running)) or not self._may_draft(req)):
            return []
        return self.grammar.valid_drafts(req, self.drafts.drafts(req, budget))

    def _may_draft(self, req: Request) -> bool:
        return self.grammar.may_draft(req, self.drafts.proposer is not None)

    def _awaits_verdict(self, req: Request) -> bool:
        """Whether a speculating request still has tokens in flight (async scheduling): its next
        drafts and even its next position depend on what they turn out to be, so it sits this step
        out while the others overlap (docs/speculative.md, "Async scheduling")."""
        return self.drafts is not None and self.in_flight.num_tokens(req) > 0 and self._may_draft(req)

    def _ends_by_length(self, req: Request) -> bool:
        """Whether the request's tokens in flight already bring it to max_tokens or max_model_len."""
        in_flight = self.in_flight.num_tokens(req)
        if not in_flight:
            return False
        total = req.num_tokens + in_flight
        return total - req.num_prompt_tokens >= req.max_tokens or total >= self.max_model_len

    def _awaits_pooled(self, req: Request) -> bool:
        """A prefill-only request whose whole prompt is scheduled waits for its vector (async scheduling)."""
        return self.pooling and req.num_computed_tokens >= req.num_tokens

    def _victim_index(self) -> int:
        if self.config.scheduling_policy == "priority":
            running = self.running
            # Ties go to the later index: the newest of equals is preempted first.
            return max(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time, i))
        return len(self.running) - 1

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        plan.drop(req)
        self.kv.free(req)
        if not self.in_flight.num_tokens(req):
            # Resumed, it recomputes its prompt and reports its prompt logprobs again. With its first
            # token still on its way they travel with that token, and are not recomputed.
            self._prompt_logprobs.pop(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.encoder_cache.free(req.request_id)
        self._forget[req.request_id] = None
        self.waiting.prepend([req])
        plan.preempted = True

    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped: list[Request] = []
        if self.adapters is not None:
            self.adapters.begin(self.running)
        while self.waiting and not plan.full and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            # A request preempted while a step held it waits for that step's results (its token in
            # flight); the engine applies them before the next schedule, direct callers may not.
            if (self.in_flight.holds(req) or self._sibling_prefilling(req) or self.grammar.compiling(req)
                    or (self.adapters is not None and not self.adapters.admits(req))):
                skipped.append(self.waiting.pop())
                continue
            if self.kv.holds_blocks(req):
                # Its blocks were allocated for a KV load that has since finished or failed.
                wanted = req.num_tokens - req.num_computed_tokens
                num_tokens = self._chunk(req, req.num_computed_tokens, wanted, plan)
                if num_tokens and not self.prefills.admits(req, num_tokens < wanted, plan):
                    skipped.append(self.waiting.pop())
                    continue
                if num_tokens == 0 or self.kv.allocate(req, num_tokens) is None:
                    break
                self.waiting.pop()
                self._start(req, req.num_computed_tokens, num_tokens, plan)
                continue
            hit = self.kv.lookup_prefix(req)
            external, load_async = (0, False) if self.kv_loads is None else self.kv_loads.external_tokens(req, hit)
            wanted = req.num_tokens - hit.num_tokens - external
            num_tokens = 0 if load_async else self._chunk(req, hit.num_tokens + external, wanted, plan)
            if not load_async:
                if num_tokens == 0:
                    break  # no encoder room left this step: the image waits for the next
                if not self.prefills.admits(req, num_tokens < wanted, plan):
                    skipped.append(self.waiting.pop())
                    continue
            if self.config.encoder_only and num_tokens < req.num_tokens:
                break  # an encoder's prompt runs whole: it waits for a step with room for all of it
            if self.kv.allocate(req, external + num_tokens, hit) is None:
                break
            self.waiting.pop()
            if external:
                self.kv_loads.allocated(req, hit, external, load_async)
            if load_async:
                continue
            self._start(req, hit.num_tokens + external, num_tokens, plan)
        if plan.full and self.kv_loads is not None and len(self.running) < self.config.max_num_seqs:
            skipped += self.kv_loads.start_ahead(self.waiting, self._may_load_ahead)
        self.waiting.prepend(skipped)
        if self.adapters is not None:
            self.adapters.end()

    def _may_load_ahead(self, req: Request) -> bool:
        # Held back as in the loop above: a request whose step is in flight, or whose sibling fills
        # blocks it could share; also one holding blocks already (its load is under way or settled)
        # and one with an adapter, which loads in its turn (admitting it counts the adapter into this
        # step). A grammar still compiling does not hold its load back: the load only needs blocks.
        return not (self.in_flight.holds(req) or self.kv.holds_blocks(req) or self._sibling_prefilling(req)
                    or req.lora_request is not None)

    def _sibling_prefilling(self, req: Request) -> bool:
        """Whether another sample of the same request is still filling prompt blocks it could share.

        Only full blocks before the prompt's last token can be shared, so a sibling computing
        its final partial block no longer holds the others back.
        """
        if not self.kv.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return False
        group = self._groups[req.group_id]
        if len(group) == 1:
            return False
        block_size = self.config.block_size
        shareable = (req.num_prompt_tokens - 1) // block_size * block_size
        return any(
            s is not req and s.status == RequestStatus.RUNNING and s.num_computed_tokens < shareable for s in group
        )

    def _start(self, req: Request, num_computed: int, num_tokens: int, plan: StepPlan) -> None:
        """Run a waiting request from `num_computed` tokens (a prefix hit, loaded ones) for `num_tokens`."""
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)
        plan.take(req, num_tokens)
        plan.new.append(req)

    def _emit(self, plan: StepPlan) -> SchedulerOutput:
        """Build the step's message (counts before this step), then advance and commit."""
        new_requests = plan.new_request_data(self.kv)
        running = [req for req, _ in plan.running.values()]
        cached = plan.cached_request_data(running, with_token_ids=self.pipeline_stages > 1)
        grammar_bitmask, grammar_pending = self.grammar.for_step(running + plan.new, plan)
        if running or plan.new:
            self.in_flight.begin_step()
        for req in running + plan.new:
            self.prompt_tokens_computed += max(0, min(req.num_computed_tokens + plan.num_scheduled[req.request_id],
                                                      req.num_prompt_tokens) - req.num_computed_tokens)
            # Drafts count as computed only once accepted (`update`).
            req.num_computed_tokens += plan.known_tokens(req)
            self.in_flight.schedule(req)
            self.kv.commit(req)
        plan.encoder.commit(running + plan.new)
        finished = list(self._forget)
        self._forget.clear()
        self._iterations.count(sum(plan.num_scheduled.values()))
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=finished,
            grammar_bitmask=grammar_bitmask,
            grammar_pending=grammar_pending,
            spec_token_ids=plan.drafts,
            kv_transfer=None if self.connector is None else self.connector.build_metadata(),
            encoder_evicted=self.encoder_cache.take_evicted(),
        )

    def pending_grammar_bitmask(self) -> GrammarBitmask | None:
        """The masks of the last step, when it left them pending (`GrammarSteps.pending_bitmask`)."""
        return self.grammar.pending_bitmask()

    def _release(self, req: Request) -> None:
        """Forget a finished request: its blocks, its group membership, its unreported prompt
        logprobs; steps in flight that hold it now hold only its id."""
        self.in_flight.release(req)
        # Blocks whose last token id arrived after they were scheduled (async scheduling) are
        # cached now: a follow-up turn's prompt starts with this request's tokens. Any step that
        # reuses them runs after the steps in flight that write them.
        self.kv.commit(req)
        if self.connector is not None:
            if req.status != RequestStatus.FINISHED_ABORTED:
                self.connector.request_finished(req, self.kv.block_ids(req))
            self.connector.request_released(req)
        self.kv.free(req)
        self.encoder_cache.free(req.request_id)
        del self._requests[req.request_id]
        group = self._groups[req.group_id]
        group.remove(req)
        if not group:
            del self._groups[req.group_id]
        self._prompt_logprobs.pop(req.request_id)
        if self.structured is not None:
            self.structured.remove(req)
