"""EngineCore: the synchronous heart of the engine actor (scheduler, KV state and worker).

It owns the scheduler and KV cache manager: nothing else writes them. Clients talk to it through an
actor (in-process) or a socket (its own process); tests and the offline `LLM` may drive `step()`.

With async scheduling one step stays in flight across `step()` calls: each call schedules and
launches the next step, then reads the previous one's ids and returns its outputs, so the host's
scheduling and output handling run while the device computes.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from ..config import EngineConfig
from ..discovery import resolve_attention_backend, resolve_platform
from ..errors import InvalidRequestError
from ..loaders import ModelSource, resolve_model_source
from ..request import Request
from ..scheduler import Scheduler
from ..scheduler.output import SchedulerOutput
from ..worker.pending import PendingStep
from .intake import check_token_ids
from .messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger("corectl.engine")


@dataclass(frozen=True)
class EngineInfo:
    """What clients need to know about a running engine.

    `tokenizer_dir` is None when the engine runs without a tokenizer (token-id prompts only).
    """

    model: str
    model_dir: str
    tokenizer_dir: str | None
    platform: str
    device: str
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    architecture: str

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


class EngineCore:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        self.source: ModelSource = resolve_model_source(config)
        if self.source.tokenizer_dir is None and not config.skip_tokenizer_init:
            # Presets and bare dummy configs run without a tokenizer: the config as run says so.
            config = config.replace(skip_tokenizer_init=True)
        self.config = config
        platform = resolve_platform(config.platform)
        platform.check_config(config)
        hf = self.source.hf_config
        self.max_model_len = resolve_max_model_len(config, hf)
        self.eos_token_id, self.extra_eos_ids = _eos_token_ids(self.source)
        dtype = platform.resolve_dtype(config.dtype, self.source.model_dtype)
        backend_cls = resolve_attention_backend(platform, config.attention_backend, hf)
        self.worker = platform.worker_cls()(
            config, platform, self.source, dtype=dtype, max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id, attention_backend_cls=backend_cls,
        )
        info = self.worker.load_model()
        num_blocks = self.worker.profile_num_kv_blocks()
        self.worker.init_kv_cache(num_blocks)
        self.worker.warmup()
        self.scheduler = Scheduler(config, self.max_model_len, num_blocks)
        self.async_scheduling = (platform.capabilities().async_output if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        self.num_requests_received = 0
        tokenizer_dir = self.source.tokenizer_dir
        self.info = EngineInfo(
            model=config.model or "default", model_dir=str(self.source.model_dir),
            tokenizer_dir=None if tokenizer_dir is None else str(tokenizer_dir), platform=platform.name,
            device=platform.device_name(), dtype=dtype, max_model_len=self.max_model_len,
            num_kv_blocks=num_blocks, block_size=config.block_size, vocab_size=info.vocab_size,
            architecture=info.architecture,
        )
        logger.info(
            "engine ready: %s (%s) on %s, %s, %d KV tokens, max_model_len %d, %s scheduling, %.1f s",
            self.source.description, info.architecture, platform.name, dtype,
            self.info.kv_capacity_tokens, self.max_model_len, "async" if self.async_scheduling else "synchronous",
            time.monotonic() - started,
        )
        if tokenizer_dir is None:
            logger.info("no tokenizer: prompts must be token ids and outputs carry no text")

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a request; raises a CorectlError (invalid request, queue full) when it cannot be taken."""
        self.num_requests_received += 1
        self.scheduler.add_request(self._make_request(request))

    def _make_request(self, request: EngineCoreRequest) -> Request:
        params = request.sampling_params
        check_token_ids(request.prompt_token_ids, params, self.info.vocab_size)
        prompt_len = len(request.prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens; this model's context is {self.max_model_len} tokens "
                "and at least one must remain for the completion",
                param="prompt", code="context_length_exceeded",
            )
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=sorted(set(params.stop_token_ids or ()) | self.extra_eos_ids))
        remaining = self.max_model_len - prompt_len
        return Request(
            request.request_id, request.prompt_token_ids, params,
            eos_token_id=self.eos_token_id,
            max_tokens=min(params.max_tokens or remaining, remaining),
            priority=request.priority, arrival_time=request.arrival_time,
            group_id=request.group_id, sample_index=request.sample_index,
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        launches = not sched.is_empty or bool(sched.finished_req_ids)
        if not self.async_scheduling:
            outputs = self._complete(sched, self.worker.launch(sched)) if launches else []
        elif not launches:
            outputs = self._complete_in_flight()
        else:
            pending = self.worker.launch(sched)
            outputs = self._complete_in_flight()
            self._in_flight = (sched, pending)
        return EngineCoreOutputs(outputs=outputs, stats=self.scheduler.make_stats(), timestamp=time.monotonic(),
                                 num_requests_received=self.num_requests_received)

    def _complete_in_flight(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        sched, pending = self._in_flight
        self._in_flight = None
        return self._complete(sched, pending)

    def _complete(self, sched: SchedulerOutput, pending: PendingStep) -> list[EngineCoreOutput]:
        return self.scheduler.update(sched, pending.result())


def resolve_max_model_len(config: EngineConfig, hf) -> int:
    """The user's max_model_len, capped by what the model supports (and by a sliding window, since
    corectl attends over the full context)."""
    limits = [getattr(hf, "max_position_embeddings", None), getattr(hf, "sliding_window", None)]
    limit = min((v for v in limits if isinstance(v, int) and v > 0), default=None)
    if config.max_model_len is None:
        if limit is None:
            raise InvalidRequestError("the model config has no max_position_embeddings; pass max_model_len",
                                      param="max_model_len")
        return limit
    if limit is not None and config.max_model_len > limit:
        from ..errors import ConfigError

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
