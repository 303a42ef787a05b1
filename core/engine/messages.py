"""Every type that crosses the client<->engine boundary, in-process or over a socket.

What the engine is (`EngineInfo`), what a client asks for (`EngineCoreRequest`), what a step gives
back (`EngineCoreOutputs`), and the messages a transport carries between them: `ClientMessage` to
the engine, `EngineMessage` back. The in-process actor queues the same messages it would send.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ..kv.block_map import KVBlockMap
from ..lora.request import LoRARequest
from ..lora.shapes import BaseModelShape
from ..multimodal.inputs import MultiModalInput
from ..pooling import PoolingInfo
from ..sampling_params import SamplingParams
from ..step_messages import LogprobsLists


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
    # The grammar backend for structured outputs; None without a tokenizer (no structured output).
    structured_outputs_backend: str | None = None
    # What a pooling engine makes (`--runner pooling`); None for a generative engine.
    pooling: PoolingInfo | None = None
    # How the weights are served quantized ("gguf (Q4_1 int4 layers via cpu_int4pack)"); None: dense.
    quantization: str | None = None
    # What adapters are checked against when LoRA is enabled (`corectl.lora.intake`); None: no LoRA.
    lora: BaseModelShape | None = None
    # The token that holds an image's place in a prompt; None: the model reads no images.
    image_token_id: int | None = None

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    """One sequence to generate. The `n` samples of a user request are separate core requests
    sharing `group_id` (their prompt blocks are shared through the prefix cache)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    group_id: str | None = None
    sample_index: int = 0
    lora_request: LoRARequest | None = None
    mm_inputs: list[MultiModalInput] = []


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """Per-request result of one engine step: the token ids produced since the last output.

    `finish_reason` is "stop", "length" or "abort" once the request is done; `stop_reason` is the
    stop token id that ended it, if any. `num_cached_tokens` is the prefix-cache hit length.
    `first_scheduled_time` (`time.monotonic()` in the engine's process, a clock shared by the
    processes of one host) is when the request first got a step: it ends its queue time.
    `error` says why the engine ended a request it could not serve as asked (an "abort" whose
    cause is the request: a grammar that does not compile in time, or that allows no token); None
    for a full queue.
    `pooled` is a pooling engine's result (prefill-only requests finish with it, no tokens): the
    raw pooled vector as little-endian float32 bytes.
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    error: str | None = None
    pooled: bytes | None = None


# Upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total); a last bucket is +Inf.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    """Gauges and counters the scheduler exposes after each step (counters are cumulative)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # The adapters of the running and the waiting requests (vLLM's lora_requests_info gauge).
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Speculative decoding (vLLM's spec_decode_* counters): verified drafts (a request in a step),
    # their draft tokens, the accepted ones, and acceptances by draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # Tokens scheduled per step: steps by bucket of ITERATION_TOKENS_BUCKETS (plus +Inf), and their sum.
    iteration_tokens_counts: list[int] = []
    iteration_tokens_sum: int = 0
    # Where prompt tokens' K/V came from (vLLM's prompt_tokens_by_source): computed here, or loaded by
    # a KV connector (disaggregated prefill, host tier); loads that fell back to recomputing.
    prompt_tokens_computed: int = 0
    prompt_tokens_transferred: int = 0
    kv_load_failures: int = 0
    # KV connectors (corectl.kv_transfer): tokens the host tier gave back, bytes moved each way.
    kv_offload_hit_tokens: int = 0
    kv_transfer_bytes_loaded: int = 0
    kv_transfer_bytes_saved: int = 0


class EngineSnapshot(msgspec.Struct, array_like=True, gc=False):
    """A live view of the engine for operators, published at most a few times a second.

    `step_num_seqs` / `step_num_tokens` are the batch size and the scheduled tokens of the last
    steps (oldest first; `num_steps` counts every step so far); `token_budget` and `max_num_seqs`
    are their limits. `running_ids` lists the running core requests (at most `max_num_seqs`), so
    every other live request is waiting. `timestamp` is the engine's `time.monotonic()`.
    """

    timestamp: float
    num_steps: int
    step_num_seqs: list[int]
    step_num_tokens: list[int]
    token_budget: int
    max_num_seqs: int
    running_ids: list[str]
    blocks: KVBlockMap


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One step's outputs plus the scheduler's stats after it.

    `num_requests_received` counts the core requests the engine had taken in (admitted or refused)
    before this step, so a client can tell which of the requests it sent the stats already count.
    `snapshot` is set on the steps that publish one (see `EngineSnapshot`).
    Sleep mode: `sleep_level` is the engine's (0: awake), `controls_done` counts the `SleepEngine`
    and `WakeEngine` messages it carried out, and `control_errors` gives (number, error) of those
    among them that failed since the last report.
    """

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float
    num_requests_received: int = 0
    snapshot: EngineSnapshot | None = None
    sleep_level: int = 0
    controls_done: int = 0
    control_errors: list[tuple[int, str]] = msgspec.field(default_factory=list)


# -- what a transport carries (msgspec tagged unions, so one decoder reads either direction) -------

class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class ShutdownEngine(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class SleepEngine(msgspec.Struct, tag="sleep", array_like=True):
    """Sleep at `level` (1: weights to host memory, 2: weights dropped) once no request runs."""

    level: int


class WakeEngine(msgspec.Struct, tag="wake", array_like=True):
    """Bring back the weights and/or the KV cache (`tags`; None: both)."""

    tags: list[str] | None = None


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Forget every cached prefix once no request runs (vLLM's /reset_prefix_cache: benchmarks'
    passes then start cold)."""


EngineControl = SleepEngine | WakeEngine | ResetPrefixCache


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine could not start or its loop raised; `kind` names the exception class, `field` and
    `code` are a user error's `param`/`field` and `code`, so the client can raise it again."""

    kind: str
    message: str
    field: str | None = None
    code: str | None = None


class EngineStep(msgspec.Struct, tag="step", array_like=True):
    """One step's outputs; `num_messages_applied` counts the client messages the engine had applied
    before the step, so the client knows whether the engine still owes it a step."""

    outputs: EngineCoreOutputs
    num_messages_applied: int


ClientMessage = AddRequests | AbortRequests | SleepEngine | WakeEngine | ResetPrefixCache | ShutdownEngine
EngineMessage = EngineReady | EngineFailed | EngineStep
