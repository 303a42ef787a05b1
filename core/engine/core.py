"""EngineCore: the synchronous heart of the engine actor (scheduler, KV state and worker).

It owns the scheduler and KV cache manager: nothing else writes them. It also owns the engine loop's
rules, so every driver (the in-process actor, the engine process, the offline `LLM`) only moves
messages: `apply` (or `add_requests` / `abort_requests`) whatever arrived, `step()` while
`has_unfinished_requests()`, and wait for messages otherwise. A request the scheduler refuses
(its queue is full), or whose grammar does not compile in time, ends alone: the next `step()`
reports it first, as an abort (with an `error` in the second case).

With async scheduling one step stays in flight across `step()` calls: each call schedules and
launches the next step, then reads the previous one's ids and returns its outputs, so the host's
scheduling and output handling run while the device computes. With `P` pipeline stages,
`2(P - 1)` steps stay in flight: the last `P - 1` of them and the one launched next are
micro-batches of different requests that fill the stages, and the older ones are each
micro-batch's previous step, which the next continues before the host has read it (its ids travel
from the last stage to the first on the device): the host's work between a micro-batch's steps
overlaps the stages' instead of leaving them idle.
"""
from __future__ import annotations

import json
import logging
import time
from collections import deque

from ..config import EngineConfig
from ..discovery import (
    resolve_attention_backend,
    resolve_platform,
    resolve_structured_output_backend,
)
from ..errors import ConfigError, CorectlError, InvalidRequestError
from ..executor import StepHandle, WorkerSpec, create_executor
from ..kv.sizing import blocks_per_sequence
from ..kv_transfer.factory import check_kv_connector, scheduler_connector
from ..loaders import ModelSource, resolve_model_source
from ..lora.shapes import BaseModelShape
from ..models.bert import position_offset
from ..models.registry import resolve_model_class
from ..multimodal.inputs import is_multimodal
from ..multimodal.processors import check_processor_kwargs
from ..pooling import PoolingInfo, resolve_pooling
from ..quantization.selection import resolve_quantization
from ..request import Request
from ..scheduler import Scheduler
from ..scheduler.snapshot import SnapshotPublisher
from ..step_messages import SchedulerOutput
from ..worker.pipeline_stage import pipelined_steps
from ..worker.sleep import TAGS as SLEEP_TAGS
from ..structured.manager import StructuredOutputManager
from .messages import (
    AbortRequests,
    AddRequests,
    EngineControl,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    ResetPrefixCache,
    SleepEngine,
)

logger = logging.getLogger("corectl.engine")
# How long an idle loop sleeps on compiling grammars before it looks at its inbox again.
_IDLE_COMPILE_WAIT_S = 0.02


class EngineCore:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        if config.data_parallel_size != 1:
            raise ConfigError("data_parallel_size", "one EngineCore is one engine: data parallelism runs one per "
                              "engine behind a client (`corectl serve -dp`, `EngineClient.in_process`), not offline")
        self.source: ModelSource = resolve_model_source(config)
        if self.source.tokenizer_dir is None and not config.skip_tokenizer_init:
            # Presets and bare dummy configs run without a tokenizer: the config as run says so.
            config = config.replace(skip_tokenizer_init=True)
        self.pooling = resolve_pooling(config, self.source.model_dir, self.source.hf_config, resolve_model_class)
        config = _runner_config(config, self.pooling)
        self.config = config
        platform = resolve_platform(config.platform)
        platform.check_config(config)
        if config.batch_invariant and not platform.capabilities().batch_invariance:
            raise ConfigError("batch_invariant", f"platform {platform.name!r} has no batch-invariant kernels; "
                              "drop --batch-invariant")
        hf = self.source.hf_config
        check_processor_kwargs(hf, config.mm_processor_kwargs)
        self.max_model_len = resolve_max_model_len(config, hf)
        if config.encoder_only and config.max_num_batched_tokens < self.max_model_len:
            # Whole encoder prompts: any prompt the context admits fits one step.
            config = self.config = config.replace(max_num_batched_tokens=self.max_model_len)
        self.eos_token_id, self.extra_eos_ids = _eos_token_ids(self.source)
        dtype = platform.resolve_dtype(config.dtype, self.source.model_dtype)
        quantization = resolve_quantization(config, self.source, platform)
        backend_cls = resolve_attention_backend(platform, config.attention_backend, hf)
        backend_cls.check_kv_cache_dtype(config.kv_cache_dtype)
        check_kv_connector(config)
        self.executor = create_executor(WorkerSpec(
            config, platform, self.source, dtype=dtype, max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id, attention_backend_cls=backend_cls, quantization=quantization,
        ))
        info = self.executor.load_model()
        num_blocks = _kv_blocks(config, self.executor.profile_num_kv_blocks(), self.max_model_len, info.sliding_window)
        self.executor.init_kv_cache(num_blocks)
        self.executor.warmup()
        self.structured = self._structured_outputs(info.vocab_size)
        self.async_scheduling = _async_scheduling(config, platform.capabilities().async_output)
        # Pipeline stages never run a request in two steps at once, so its masks are known when scheduled.
        self.scheduler = Scheduler(config, self.max_model_len, num_blocks, self.structured,
                                   sliding_window=info.sliding_window,
                                   bidirectional_image_tokens=info.bidirectional_image_tokens,
                                   connector=scheduler_connector(config, info.kv_bytes_per_block(config.block_size)),
                                   defer_grammar=self.async_scheduling and config.pipeline_parallel_size == 1)
        self.snapshots = SnapshotPublisher(self.scheduler)
        self._depth = steps_in_flight(config, self.async_scheduling)
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle]] = deque()
        self.num_requests_received = 0
        self._refused: list[EngineCoreOutput] = []  # abort outputs the next step reports first
        # Sleep mode: controls wait for the running requests to finish, then run between steps.
        self.sleep_level = 0
        self._controls: list[EngineControl] = []
        self._controls_done = 0
        self._asleep_parts: set[str] = set()
        self._control_errors: list[tuple[int, str]] = []
        tokenizer_dir = self.source.tokenizer_dir
        self.info = EngineInfo(
            model=config.model or "default", model_dir=str(self.source.model_dir),
            tokenizer_dir=None if tokenizer_dir is None else str(tokenizer_dir), platform=platform.name,
            device=platform.device_name(), dtype=dtype, max_model_len=self.max_model_len,
            num_kv_blocks=num_blocks, block_size=config.block_size, vocab_size=info.vocab_size,
            architecture=info.architecture,
            structured_outputs_backend=None if self.structured is None else config.structured_outputs_backend,
            pooling=self.pooling,
            quantization=None if quantization is None else quantization.describe(),
            lora=BaseModelShape.of(hf, config.max_lora_rank) if config.enable_lora else None,
            image_token_id=hf.image_token_id if is_multimodal(hf) and info.reads_images else None,
        )
        logger.info(
            "engine ready: %s (%s) on %s, %s, %s weights, %d KV tokens, max_model_len %d, %s scheduling, %.1f s",
            self.source.description, info.architecture, platform.name, dtype, self.info.quantization or "dense",
            self.info.kv_capacity_tokens, self.max_model_len, "async" if self.async_scheduling else "synchronous",
            time.monotonic() - started,
        )
        if self.pooling is not None:
            logger.info("pooling model: %s pooling%s, %d-dimensional embeddings", self.pooling.pooling_type,
                        ", normalized" if self.pooling.normalize else "", self.pooling.hidden_size)
        if tokenizer_dir is None:
            logger.info("no tokenizer: prompts must be token ids and outputs carry no text")

    def _structured_outputs(self, vocab_size: int) -> StructuredOutputManager | None:
        """Grammars need the tokenizer's vocabulary: without one, structured output is refused."""
        if self.source.tokenizer_dir is None:
            return None
        backend_cls = resolve_structured_output_backend(self.config.structured_outputs_backend)
        stop_ids = [] if self.eos_token_id is None else [self.eos_token_id, *sorted(self.extra_eos_ids)]
        return StructuredOutputManager(backend_cls, str(self.source.tokenizer_dir), vocab_size, stop_ids,
                                       self.config.structured_outputs_compile_timeout)

    def apply(self, message: AddRequests | AbortRequests | EngineControl) -> None:
        """Apply one message a client sent."""
        if isinstance(message, AddRequests):
            self.add_requests(message.requests)
        elif isinstance(message, AbortRequests):
            self.abort_requests(message.request_ids)
        else:
            self._controls.append(message)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queue requests that passed intake (`engine/intake.py`, on the client's side).

        One the scheduler cannot take (its queue is full) is refused alone, as an abort output that
        the next `step()` reports first; the loop and the other requests go on.
        """
        for request in requests:
            self.num_requests_received += 1
            if self.sleep_level:
                self._refused.append(EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                                      error="the engine is asleep; wake it up first"))
                continue
            try:
                self.scheduler.add_request(self._make_request(request))
            except CorectlError as exc:
                logger.warning("engine refused request %s: %s", request.request_id, exc)
                error = str(exc) if isinstance(exc, InvalidRequestError) else None
                self._refused.append(EngineCoreOutput(request.request_id, [], finish_reason="abort", error=error))

    def _make_request(self, request: EngineCoreRequest) -> Request:
        params = request.sampling_params
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=sorted(set(params.stop_token_ids or ()) | self.extra_eos_ids))
        remaining = self.max_model_len - len(request.prompt_token_ids)
        return Request(
            request.request_id, request.prompt_token_ids, params,
            eos_token_id=self.eos_token_id,
            max_tokens=min(params.max_tokens or remaining, remaining),
            priority=request.priority, arrival_time=request.arrival_time,
            group_id=request.group_id, sample_index=request.sample_index, lora_request=request.lora_request,
            mm_inputs=request.mm_inputs,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: requests queued, running or in flight, or refusals to report."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight) or bool(self._refused)

    def step(self) -> EngineCoreOutputs:
        if self.sleep_level:
            # Nothing runs while asleep (requests are refused); the finished ids wait for waking.
            return self._report([])
        self._refused += self.scheduler.reap_grammar_failures()
        sched = self.scheduler.schedule()
        # A step that only carries KV-connector work still reaches the workers: they report there.
        launches = not sched.is_empty or bool(sched.finished_req_ids) or sched.kv_transfer is not None
        if not sched.is_empty:
            self.snapshots.record(sched)
        if not self._depth:
            outputs = self._complete(sched, self.executor.launch(sched)) if launches else []
        elif not launches:
            outputs = self._complete_in_flight()
        else:
            pending = self.executor.launch(sched)
            outputs = self._complete_in_flight() if len(self._in_flight) >= self._depth else []
            if sched.grammar_pending:
                # The step before is read, so every matcher is current: the masks are filled
                # while the device runs this step's forward pass, then it samples.
                self.executor.sample_pending(self.scheduler.pending_grammar_bitmask())
            self._in_flight.append((sched, pending))
        if not launches and not outputs and not self._in_flight and self.structured is not None:
            # Only grammars still compiling hold work back: sleep on them rather than spin.
            self.structured.wait_for_compile(_IDLE_COMPILE_WAIT_S)
        return self._report(outputs)

    def _report(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """The step's outputs after the refusals, with the stats; pending sleep-mode controls run
        here once no request is left."""
        if self._refused:
            outputs[:0], self._refused = self._refused, []
        if self._controls and not self.has_unfinished_requests():
            self._run_controls()
        now = time.monotonic()
        errors, self._control_errors = self._control_errors, []
        return EngineCoreOutputs(outputs=outputs, stats=self.scheduler.make_stats(), timestamp=now,
                                 num_requests_received=self.num_requests_received,
                                 snapshot=self.snapshots.poll(now), sleep_level=self.sleep_level,
                                 controls_done=self._controls_done, control_errors=errors)

    def _run_controls(self) -> None:
        """Sleep, wake up or reset the prefix cache, in the order asked; each failure is reported
        with its number."""
        for control in self._controls:
            self._controls_done += 1
            try:
                if isinstance(control, SleepEngine):
                    self.sleep(control.level)
                elif isinstance(control, ResetPrefixCache):
                    self.reset_prefix_cache()
                else:
                    self.wake_up(control.tags)
            except CorectlError as exc:
                self._control_errors.append((self._controls_done, str(exc)))
        self._controls.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix of the device's KV cache; no request may be running (the
        controls wait for that)."""
        if self.has_unfinished_requests():
            raise InvalidRequestError("the prefix cache can only be reset while no request runs")
        self.scheduler.kv.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        """Free the KV cache (its cached prefixes with it) and offload (1) or drop (2) the weights;
        no request may be running. Requests that arrive while asleep are refused."""
        if not self.config.enable_sleep_mode:
            raise ConfigError("enable_sleep_mode", "sleep mode is off; start the engine with --enable-sleep-mode")
        if self.has_unfinished_requests():
            raise InvalidRequestError("the engine can only sleep while no request runs")
        self.executor.sleep(level)
        self.scheduler.kv.reset_prefix_cache()
        self.sleep_level = level
        self._asleep_parts = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (None: both); awake once both are back."""
        if not self.sleep_level:
            return
        self.executor.wake_up(tags)
        self._asleep_parts -= set(tags or SLEEP_TAGS)
        if not self._asleep_parts:
            self.sleep_level = 0

    def _complete_in_flight(self) -> list[EngineCoreOutput]:
        """Read the oldest step in flight."""
        if not self._in_flight:
            return []
        sched, pending = self._in_flight.popleft()
        return self._complete(sched, pending)

    def _complete(self, sched: SchedulerOutput, pending: StepHandle) -> list[EngineCoreOutput]:
        return self.scheduler.update(sched, pending.result())


def _kv_blocks(config: EngineConfig, profiled: int, max_model_len: int, sliding_window: int | None) -> int:
    """The KV blocks to allocate: what the memory allows, or vLLM's `num_gpu_blocks_override`
    (for tests of preemption and capacity), which must still hold one sequence."""
    override = config.num_gpu_blocks_override
    if override is None:
        return profiled
    needed = blocks_per_sequence(max_model_len, config.block_size, sliding_window, config.max_num_batched_tokens)
    if override < needed:
        raise ConfigError("num_gpu_blocks_override", f"{override} blocks of {config.block_size} tokens hold less than "
                          f"one sequence of max_model_len={max_model_len} ({needed} blocks)")
    if override > profiled:
        logger.warning("num_gpu_blocks_override=%d is more than the %d KV blocks memory allows", override, profiled)
    return override


def _runner_config(config: EngineConfig, pooling: PoolingInfo | None) -> EngineConfig:
    """The config as the engine runs it: the runner decided, and the pooling the workers apply.
    MEAN and CLS pooling read hidden states that a prefix-cache hit would skip computing, so their
    engines run without prefix caching (LAST pooling never hits the prompt's last token)."""
    if pooling is None:
        return config.replace(runner="generate")
    if pooling.encoder:
        # An encoder attends over its whole prompt at once and keeps no KV cache to reuse.
        return config.replace(runner="pooling", pooling_type=pooling.pooling_type, normalize=pooling.normalize,
                              enable_prefix_caching=False, encoder_only=True)
    return config.replace(runner="pooling", pooling_type=pooling.pooling_type, normalize=pooling.normalize,
                          enable_prefix_caching=config.enable_prefix_caching and pooling.pooling_type == "LAST")


def _async_scheduling(config: EngineConfig, platform_default: bool) -> bool:
    """Whether steps overlap the host's work (with speculation too: a speculating request sits
    out the step after its own, see `Scheduler._awaits_verdict`)."""
    return platform_default if config.async_scheduling is None else config.async_scheduling


def steps_in_flight(config: EngineConfig, async_scheduling: bool) -> int:
    """Steps left in flight between `step()` calls: none under synchronous scheduling, one under
    async, and 2(P - 1) with P pipeline stages, whatever the scheduling (see the module doc)."""
    if config.pipeline_parallel_size > 1:
        return pipelined_steps(config.pipeline_parallel_size)
    return 1 if async_scheduling else 0


def resolve_max_model_len(config: EngineConfig, hf) -> int:
    """The user's max_model_len, capped by what the model supports (a sliding window is no cap:
    windowed layers attend within it at any length)."""
    limit = getattr(hf, "max_position_embeddings", None)
    limit = limit - position_offset(hf) if isinstance(limit, int) and limit > 0 else None
    if config.max_model_len is None:
        if limit is None:
            raise InvalidRequestError("the model config has no max_position_embeddings; pass max_model_len",
                                      param="max_model_len")
        return limit
    if limit is not None and config.max_model_len > limit:
        raise ConfigError("max_model_len", f"{config.max_model_len} exceeds the model's limit of {limit} tokens")
    return config.max_model_len


def _eos_token_ids(source: ModelSource) -> tuple[int | None, frozenset[int]]:
    """The primary EOS id and any extra ones (e.g. Llama-3's end-of-turn ids) from the checkpoint."""
    eos = None
    gen_path = source.model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(source.hf_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        return None, frozenset()
    return ids[0], frozenset(ids[1:])
