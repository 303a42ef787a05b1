"""EngineConfig: every engine option in one validated object."""
from __future__ import annotations

from typing import Any

import msgspec

from .errors import ConfigError
from .pooling import POOLING_TYPES, RUNNER_ALIASES, RUNNERS
from .kv_transfer.config import KVTransferConfig, resolve_kv_transfer_config
from .compilation import CompilationConfig, resolve_compilation_config
from .spec_decode.config import SpeculativeConfig, resolve_speculative_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("mp", "ray")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# vLLM's names: "fp8" is e4m3 with per-tensor scales; "float16" is IEEE fp16 (the CPU's fused attention).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "float16")
# What sampled logprobs report (vLLM's --logprobs-mode; corectl.sample.logprobs).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's allowed --max-lora-rank values.
LORA_RANKS = (8, 16, 32, 64, 128, 256)


def parse_layer_partition(text: str, num_stages: int, field: str) -> tuple[int, ...]:
    """Each stage's layer count from "5,4"; raises ConfigError naming `field` unless it lists
    `num_stages` positive counts."""
    try:
        counts = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        counts = ()
    if len(counts) != num_stages or min(counts, default=0) < 1:
        raise ConfigError(field, f"must list one positive layer count per pipeline stage ({num_stages}), "
                          f"comma separated like \"5,4\"; got {text!r}")
    return counts


class EngineConfig(msgspec.Struct, kw_only=True):
    """Engine options. A bad value raises `ConfigError` naming the field and what is allowed.

    model: local HF directory, a `.gguf` file, a hub id, a shape preset name (random weights only,
        see `corectl.loaders.presets`), or None for the embedded default model.
    max_model_len: context length; None takes the model's own (capped by `max_position_embeddings`).
    kv_cache_memory_gib: KV-cache budget on platforms without memory profiling (CPU); None lets
        the platform choose.
    gpu_memory_utilization: fraction of device memory the engine may use (weights + activations
        + KV cache) on platforms that profile memory.
    max_num_batched_tokens: token budget per scheduler step (chunked prefill splits longer prompts).
    kv_cache_dtype: "auto" stores K/V in the model's dtype; "fp8" (or "fp8_e4m3") in FP8 e4m3 with a
        per-tensor scale per layer (1.0 without calibrated scales), half the bytes of bf16, so the
        cache holds twice the tokens; the attention backend must support it (`triton` does);
        "float16" in IEEE fp16, half the bytes of fp32 (`torch_sdpa` on CPUs, whose fused attention
        widens each row to fp32 as it reads it; docs/performance.md, CPU section).
    async_scheduling: schedule and launch step N+1 before step N's sampled ids reach the host, so
        host work overlaps the device; None turns it on where the platform's device runs
        asynchronously (GPUs). Outputs are the same either way.
    tensor_parallel_size: ranks that split the model's heads, MLP rows and vocabulary (one device
        each); it must divide the attention heads.
    pipeline_parallel_size: pipeline stages, each holding a contiguous run of the model's layers
        (`tensor_parallel_size` ranks a stage, so `tensor_parallel_size x pipeline_parallel_size`
        ranks in all); the first stage embeds, the last samples, activations go stage to stage.
    pipeline_layer_partition: the layers of each stage, comma separated ("5,4": 5 then 4), summing
        to the model's layer count; None: vLLM's `VLLM_PP_LAYER_PARTITION` if set, else an even
        split (extra layers on the stages before the last, which also holds the LM head).
    distributed_executor_backend: how ranks are started: "mp" (one process per rank on this
        host) or "ray" (one Ray actor per rank in a placement group, on the cluster `RAY_ADDRESS`
        names, else a local one). None: in the engine's own process at tensor-parallel size 1,
        "mp" above it (above one rank in all, stages included).
    data_parallel_size: engine cores serving the same model behind one server, each with its own
        tensor-parallel group (`corectl.engine.dp`); the server routes each request to one of them.
        The offline `LLM` runs a single engine core.
    structured_outputs_backend: the grammar backend for requests with `structured_outputs`
        (a name registered through the `corectl_structured_output_backends` hook).
    structured_outputs_compile_timeout: seconds a request's grammar may take to compile (from its
        arrival) before the request ends with an error instead of waiting on.
    runner: "generate" (text), "pooling" (embeddings: every request is prefill only and ends with
        one pooled vector; see `corectl.pooling`), or "auto": pooling for sentence-transformers
        checkpoints and bare backbones (`Qwen3Model`). "embed" (vLLM's `--task embed`) means "pooling".
    pooling_type: LAST, MEAN or CLS for a pooling engine; None: the checkpoint's
        (`1_Pooling/config.json`), else LAST. MEAN and CLS need every prompt token's hidden state,
        so such an engine runs without prefix caching.
    normalize: L2-normalise pooled vectors; None: the checkpoint's (a Normalize module), else True.
    encoder_only: set by the engine for an encoder-only model (BERT; not a flag): each prompt is
        scheduled whole in one step (never chunked), the budget covers `max_model_len`, and
        prefix caching is off.
    enable_lora: serve LoRA adapters (`corectl.lora`, docs/lora.md): requests may name a `LoRARequest`.
    max_loras: adapters resident on the device at once (each step mixes at most this many);
        max_cpu_loras: adapters kept loaded in host memory (None: max_loras); max_lora_rank: the
        largest adapter rank served (8, 16, 32, 64, 128 or 256; device slots are sized by it);
        lora_dtype: the adapters' dtype on the device ("auto": the model's).
    kv_cache_memory_bytes: the KV cache's size in bytes on each device (vLLM's), on any platform:
        GPUs then size it by this instead of `gpu_memory_utilization` (it must fit what the weights
        and a worst-case step leave). `kv_cache_memory_gib` is the same budget in GiB; give one.
    long_prefill_token_threshold: a prompt longer than this is "long"; 0 (the default): none is.
        A step computes at most this many of any one prompt's tokens (vLLM's), so a long prompt
        leaves room in the step's budget for others.
    max_num_partial_prefills: prompts computed in chunks at once (vLLM's); more wait until one
        finishes its prompt. max_long_partial_prefills: of those, long ones (at most
        max_num_partial_prefills), so short prompts are not all stuck behind long ones.
    logprobs_mode: what sampled logprobs report (vLLM's `--logprobs-mode`): raw_logprobs (the
        default: log-softmax of the model's logits), raw_logits, processed_logprobs or
        processed_logits (after penalties, logit_bias and the other edits, temperature, top-k,
        top-p and min-p: the distribution the token was drawn from). Prompt logprobs stay raw.
    num_gpu_blocks_override: KV cache blocks to allocate whatever the memory profile allows (vLLM's,
        for tests of preemption and capacity; on any device); None: as the profile or
        `kv_cache_memory_gib` gives.
    disable_custom_all_reduce: tensor-parallel ranks sum every message with the group's collective
        (NCCL, gloo), not the platform's own all-reduce for small ones (vLLM's flag).
    compilation_config: which steps replay CUDA graphs and of which sizes, vLLM's `-O` /
        `--compilation-config` (a level, a dict or its JSON string; `corectl.compilation`); None:
        whole-step graphs for decodes, piecewise graphs for other steps. Kept as a
        `CompilationConfig`; `enforce_eager` overrides it.
    speculative_config: speculative decoding, vLLM's `--speculative-config` (a dict or its JSON
        string, see `corectl.spec_decode.config`); None: off. Checked here and kept as a
        `SpeculativeConfig`.
    kv_transfer_config: disaggregated prefill/decode through a KV connector, vLLM's
        `--kv-transfer-config` (a dict or its JSON string: `kv_connector`, `kv_role`,
        `kv_connector_extra_config`; see `corectl.kv_transfer`); None: off.
    kv_offload_bytes: bytes of host memory (pinned where the platform pins) that keep prefix-cache
        blocks the device evicts, brought back on a later hit instead of recomputed (vLLM's
        `--kv-offloading-size`, in GiB there); None: no host tier.
    stream_interval: a streamed request's output goes to its consumer once this many new tokens
        have gathered (vLLM's and SGLang's `--stream-interval`): the first token and the last
        output go at once. 1 (the default) sends every step's; more trades smoothness for less
        API-process work per token (one delta, SSE event and socket write per N tokens).
    enable_sleep_mode: the engine may sleep (`EngineCore.sleep`, corectl.worker.sleep): free its KV
        cache and offload (level 1) or drop (level 2) its weights until woken up.
    quantization: the quantization method (`corectl.quantization`; vLLM's names: fp8, awq, gptq,
        compressed-tensors, gguf, or a plugin's). None: the checkpoint's own `quantization_config`,
        and GGUF files kept quantized where the platform has the kernel (unless `dtype` is set);
        "none": dense weights (GGUF dequantized); "fp8" on a dense checkpoint quantizes on the fly.
    batch_invariant: a request's greedy output does not depend on what else shares its steps (alone,
        among many, after a prefix hit: the same tokens). The platform decides what that takes
        (`PlatformCaps.batch_invariance`): CPUs are row-invariant already; GPUs switch to GEMM and
        attention launches chosen by the layer's shape only, and refuse what has no such kernel
        (quantized weights, MoE, LoRA, tensor parallelism, speculative decoding); docs/performance.md.
    skip_tokenizer_init: load no tokenizer: prompts are token ids, outputs carry token ids and empty
        text. Shape presets, and dummy weights from a config with no tokenizer files beside it (and
        no `tokenizer` given), always run this way.
    """

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_queued_requests: int | None = None
    stream_interval: int = 1
    platform: str = "auto"
    attention_backend: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    compilation_config: CompilationConfig | list[str] | int | str | None = None
    disable_custom_all_reduce: bool = False
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    logprobs_mode: str = "raw_logprobs"
    batch_invariant: bool = False
    async_scheduling: bool | None = None
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: str | None = None
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    chat_template: str | None = None
    hf_overrides: dict[str, Any] | None = None
    # vLLM's: image-processor options for every image (Gemma 3's do_pan_and_scan, ...); a request's own win.
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs_backend: str = "xgrammar"
    structured_outputs_compile_timeout: float = 10.0
    runner: str = "auto"
    pooling_type: str | None = None
    normalize: bool | None = None
    encoder_only: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_dtype: str = "auto"
    speculative_config: SpeculativeConfig | str | None = None
    enable_sleep_mode: bool = False
    kv_transfer_config: KVTransferConfig | str | None = None
    kv_offload_bytes: int | None = None

    def __post_init__(self) -> None:
        self._check_choice("dtype", DTYPES)
        self._check_choice("load_format", LOAD_FORMATS)
        self._check_choice("scheduling_policy", POLICIES)
        self._check_choice("block_size", BLOCK_SIZES)
        self.runner = RUNNER_ALIASES.get(self.runner, self.runner)
        self._check_choice("runner", RUNNERS)
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
            self._check_choice("pooling_type", POOLING_TYPES)
        self._check_choice("kv_cache_dtype", KV_CACHE_DTYPES)
        if self.structured_outputs_backend == "auto":  # vLLM's default name: the built-in backend
            self.structured_outputs_backend = "xgrammar"
        self._check_positive("max_num_seqs")
        self._check_positive("max_num_batched_tokens")
        if self.max_model_len is not None:
            self._check_positive("max_model_len")
        if self.quantization is not None and (not isinstance(self.quantization, str) or not self.quantization):
            raise ConfigError("quantization", f"must be a method name or 'none', got {self.quantization!r}")
        if self.max_queued_requests is not None:
            self._check_positive("max_queued_requests")
        self._check_positive("stream_interval")
        if self.num_threads is not None:
            self._check_positive("num_threads")
        self._check_positive("tensor_parallel_size")
        self._check_positive("data_parallel_size")
        if self.distributed_executor_backend is not None:
            self._check_choice("distributed_executor_backend", EXECUTOR_BACKENDS)
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ConfigError("kv_cache_memory_gib", f"must be a positive number of GiB, got {self.kv_cache_memory_gib!r}")
        if not self.structured_outputs_compile_timeout > 0:
            raise ConfigError("structured_outputs_compile_timeout",
                              f"must be a positive number of seconds, got {self.structured_outputs_compile_timeout!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not self.platform or not isinstance(self.platform, str):
            raise ConfigError("platform", "must be 'auto' or a platform name (see `corectl plugins`)")
        self._check_lora()
        self.compilation_config = resolve_compilation_config(self.compilation_config)
        self.speculative_config = resolve_speculative_config(self.speculative_config, self.tensor_parallel_size)
        self.kv_transfer_config = resolve_kv_transfer_config(self.kv_transfer_config)
        if self.num_gpu_blocks_override is not None:
            self._check_positive("num_gpu_blocks_override")
        self._check_kv_budget()
        self._check_partial_prefills()
        self._check_choice("logprobs_mode", LOGPROBS_MODES)
        if self.kv_offload_bytes is not None:
            self._check_positive("kv_offload_bytes")
            if self.kv_transfer_config is not None:
                raise ConfigError("kv_offload_bytes", "the host tier is a KV connector of its own: give either "
                                  "--kv-offload-bytes or --kv-transfer-config, not both")
        self._check_pipeline()

    @property
    def kv_cache_budget_bytes(self) -> int | None:
        """The KV cache's size in bytes when one was given (`kv_cache_memory_bytes` or
        `kv_cache_memory_gib`), else None: a profiling platform sizes it by what is free."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return None if self.kv_cache_memory_gib is None else int(self.kv_cache_memory_gib * (1 << 30))

    @property
    def kv_cache_budget_field(self) -> str:
        """The option that set the KV budget, for error messages."""
        return "kv_cache_memory_bytes" if self.kv_cache_memory_bytes is not None else "kv_cache_memory_gib"

    def _check_kv_budget(self) -> None:
        if self.kv_cache_memory_bytes is None:
            return
        self._check_positive("kv_cache_memory_bytes")
        if self.kv_cache_memory_gib is not None:
            raise ConfigError("kv_cache_memory_bytes", "give the KV cache's size once: --kv-cache-memory-bytes or "
                              "--kv-cache-memory (GiB), not both")

    def _check_partial_prefills(self) -> None:
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold",
                              f"must be a whole number of tokens >= 0 (0: no threshold), got {self.long_prefill_token_threshold!r}")
        self._check_positive("max_num_partial_prefills")
        self._check_positive("max_long_partial_prefills")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ConfigError("max_long_partial_prefills", f"{self.max_long_partial_prefills} is more than "
                              f"max_num_partial_prefills={self.max_num_partial_prefills}")

    @property
    def world_size(self) -> int:
        """Ranks (devices) one engine runs: a tensor-parallel group per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_pipeline(self) -> None:
        self._check_positive("pipeline_parallel_size")
        if self.pipeline_layer_partition is not None:
            parse_layer_partition(self.pipeline_layer_partition, self.pipeline_parallel_size,
                                  "pipeline_layer_partition")
        spec = self.speculative_config
        if self.pipeline_parallel_size > 1 and spec is not None and spec.method not in ("ngram", "draft_model"):
            raise ConfigError("pipeline_parallel_size", f"{spec.method} speculation runs without pipeline stages (its "
                              "head reads the last stage's hidden states and the first stage's embeddings); use "
                              "the ngram or draft_model method, or --tensor-parallel-size")

    def _check_lora(self) -> None:
        self._check_positive("max_loras")
        self._check_choice("max_lora_rank", LORA_RANKS)
        self._check_choice("lora_dtype", DTYPES)
        if self.max_cpu_loras is not None:
            self._check_positive("max_cpu_loras")
            if self.max_cpu_loras < self.max_loras:
                raise ConfigError("max_cpu_loras", f"{self.max_cpu_loras} is below max_loras={self.max_loras}: every "
                                  "adapter on the device is also kept in host memory")

    def _check_choice(self, field: str, allowed: tuple) -> None:
        value = getattr(self, field)
        if value not in allowed:
            raise ConfigError(field, f"must be one of {', '.join(map(str, allowed))}; got {value!r}")

    def _check_positive(self, field: str) -> None:
        value = getattr(self, field)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(field, f"must be a positive integer, got {value!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, naming any unknown option."""
        known = set(cls.__struct_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown engine option; known options: {', '.join(sorted(known))}")
        try:
            return msgspec.convert(kwargs, cls)
        except msgspec.ValidationError as exc:
            field = str(exc).rsplit("$.", 1)[-1].rstrip("`") if "$." in str(exc) else "config"
            raise ConfigError(field, str(exc)) from exc

    def replace(self, **changes: Any) -> "EngineConfig":
        return msgspec.structs.replace(self, **changes)
