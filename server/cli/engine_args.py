"""Command-line flags for every EngineConfig option, shared by `serve`, `generate` and `bench`."""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

from corectl.config import (
    BLOCK_SIZES,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    LORA_RANKS,
    POLICIES,
    EngineConfig,
)
from corectl.errors import ConfigError
from corectl.json_option import decode_json_option
from corectl.pooling import POOLING_TYPES, RUNNER_ALIASES, RUNNERS

# field -> (flag, help, argparse extras); the field order here is the order in --help.
_MODEL = "model loading"
_CACHE = "KV cache and scheduling"
_PLATFORM = "platform"
_PARALLEL = "parallelism"
_POOLING = "pooling (embedding models)"
_LORA = "LoRA adapters"
_SPEC = "speculative decoding"
_KV = "disaggregated prefill/decode and KV offloading"
_BYTE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "KI": 2**10, "MI": 2**20, "GI": 2**30}


def byte_count(text: str) -> int:
    """A size in bytes: a number, optionally followed by K, M, G (powers of 10) or Ki, Mi, Gi (of 2)."""
    number = text.rstrip("KMGikmgBb")
    unit = text[len(number):].upper().removesuffix("B")
    if unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8GiB, 500M or 1048576)")
    return int(float(number) * _BYTE_UNITS[unit])


_READABLE = re.compile(r"(-?\d+(?:\.\d+)?)([kmgtKMGT]?)")


def human_readable_int(text: str) -> int:
    """vLLM's human-readable integers: 25.6k = 25,600 (k, m, g, t: powers of 1000), 32K = 32,768
    (K, M, G, T: powers of 1024, whole numbers only), or a plain integer (its sign left for the
    option to judge). Unlike `byte_count` (--kv-offload-bytes: K, M, G decimal, Ki, Mi, Gi binary),
    the case of the letter picks the base, as in vLLM."""
    match = _READABLE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (use e.g. 4096, 32k or 8G)")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
        return int(number)
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: binary suffixes ({suffix}) take whole numbers; use "
                                             f"{suffix.lower()} for a decimal one")
        return int(number) * 1024 ** power
    return round(float(number) * 1000 ** power)


def _gib(text: str) -> int:
    return int(float(text) * 2**30)


# field -> (flag or flags, group, help, argparse extras)
# vLLM's other names for the dtypes.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
ENGINE_FLAGS: dict[str, tuple[str | tuple[str, ...], str, str, dict[str, Any]]] = {
    "tokenizer": ("--tokenizer", _MODEL, "tokenizer directory (default: the model's)", {}),
    "skip_tokenizer_init": ("--skip-tokenizer-init", _MODEL, "load no tokenizer: prompts must be token ids and "
                            "outputs carry no text (automatic for presets and dummy configs without "
                            "tokenizer files)", {"action": "store_true"}),
    "revision": ("--revision", _MODEL, "hub revision (branch, tag or commit)", {}),
    "download_dir": ("--download-dir", _MODEL, "hub cache directory", {}),
    "load_format": ("--load-format", _MODEL, "weight format; 'dummy' makes random weights", {"choices": LOAD_FORMATS}),
    "quantization": (("--quantization", "-q"), _MODEL, "quantization method: fp8 (on the fly or an FP8 checkpoint), "
                     "awq, gptq, compressed-tensors, gguf, a plugin's, or 'none' for dense weights (unset: the "
                     "checkpoint's own; GGUF files stay 4-bit where the platform has the kernel unless --dtype is "
                     "given; see `corectl plugins`)", {}),
    "dtype": ("--dtype", _MODEL, "compute dtype ('auto': the platform's best for this model; vLLM's 'half' and "
              "'float' too)", {"choices": DTYPES, "type": lambda value: _DTYPE_ALIASES.get(value, value)}),
    "max_model_len": ("--max-model-len", _MODEL, "context length (default: the model's); 32k = 32,000, "
                      "32K = 32,768", {"type": human_readable_int}),
    "chat_template": ("--chat-template", _MODEL, "chat template (Jinja string or .jinja file) overriding the model's", {}),
    "hf_overrides": ("--hf-overrides", _MODEL, "JSON object merged into the model config", {"type": json.loads}),
    "mm_processor_kwargs": ("--mm-processor-kwargs", _MODEL, "JSON object of image-processor options for every "
                            "image, vLLM's (Gemma 3: '{\"do_pan_and_scan\": true}' and the pan_and_scan_* "
                            "limits); a request's mm_processor_kwargs override them", {"type": json.loads}),
    "seed": ("--seed", _MODEL, "seed for dummy weights and unseeded sampling", {"type": int}),
    "block_size": ("--block-size", _CACHE, "tokens per KV block", {"type": int, "choices": BLOCK_SIZES}),
    "kv_cache_dtype": ("--kv-cache-dtype", _CACHE, "KV cache storage: 'auto' (the model's dtype), 'fp8' (e4m3 "
                       "with per-tensor scales: twice bf16's tokens; the triton attention backend) or 'float16' "
                       "(twice fp32's tokens; the CPU's torch_sdpa backend)",
                       {"choices": KV_CACHE_DTYPES}),
    "kv_cache_memory_gib": ("--kv-cache-memory", _CACHE, "KV cache size in GiB (on GPUs instead of "
                            "--gpu-memory-utilization; CPU default 2)", {"type": float}),
    "kv_cache_memory_bytes": ("--kv-cache-memory-bytes", _CACHE, "KV cache size in bytes per device, vLLM's "
                              "(8G = 8 GiB, 8g = 8e9, as vLLM reads them; on GPUs instead of "
                              "--gpu-memory-utilization)",
                              {"type": human_readable_int}),
    "num_gpu_blocks_override": ("--num-gpu-blocks-override", _CACHE, "KV cache blocks to allocate whatever the "
                                "memory profile allows (vLLM's; for tests of preemption and capacity)", {"type": int}),
    "gpu_memory_utilization": ("--gpu-memory-utilization", _CACHE, "fraction of GPU memory to use", {"type": float}),
    "max_num_seqs": ("--max-num-seqs", _CACHE, "most sequences in one step", {"type": int}),
    "max_num_batched_tokens": ("--max-num-batched-tokens", _CACHE, "token budget of one step (8k, 8K too)",
                               {"type": human_readable_int}),
    "long_prefill_token_threshold": ("--long-prefill-token-threshold", _CACHE, "most tokens of one prompt a step "
                                     "computes, and the length over which a prompt is long (0: none)",
                                     {"type": human_readable_int}),
    "max_num_partial_prefills": ("--max-num-partial-prefills", _CACHE, "prompts computed in chunks at once "
                                 "(above 1: the rest wait; the threshold defaults to 4%% of the context)",
                                 {"type": int}),
    "max_long_partial_prefills": ("--max-long-partial-prefills", _CACHE, "of those, prompts over the threshold "
                                  "(fewer lets short prompts pass long ones)", {"type": int}),
    "logprobs_mode": ("--logprobs-mode", _CACHE, "what sampled logprobs report: raw_logprobs (default), "
                      "raw_logits, processed_logprobs or processed_logits (after penalties, temperature and "
                      "top-k/p: the distribution sampled from)", {"choices": LOGPROBS_MODES}),
    "enable_prefix_caching": ("--enable-prefix-caching", _CACHE, "reuse KV blocks of shared prefixes",
                              {"action": argparse.BooleanOptionalAction}),
    "scheduling_policy": ("--scheduling-policy", _CACHE, "queue order", {"choices": POLICIES}),
    "max_queued_requests": ("--max-queued-requests", _CACHE, "reject (429) beyond this many waiting requests",
                            {"type": int}),
    "stream_interval": ("--stream-interval", _CACHE, "tokens gathered before a stream gets them (the first "
                        "token and the end go at once): 1 sends every token, more costs the API process "
                        "less per token", {"type": int}),
    "platform": ("--platform", _PLATFORM, "auto, cpu, cuda, rocm or a plugin's platform", {}),
    "attention_backend": ("--attention-backend", _PLATFORM, "attention backend (default: the platform's)", {}),
    "enforce_eager": ("--enforce-eager", _PLATFORM, "disable CUDA graphs", {"action": "store_true"}),
    "batch_invariant": ("--batch-invariant", _PLATFORM, "greedy output independent of the batch a request shares "
                        "(GPUs: shape-fixed GEMM and attention kernels, slower; CPUs: always so)",
                        {"action": "store_true"}),
    "enable_sleep_mode": ("--enable-sleep-mode", _PLATFORM, "allow the engine to sleep (free the KV cache and "
                          "offload or drop the weights) and wake up: POST /sleep, /wake_up, LLM.sleep()",
                          {"action": "store_true"}),
    "async_scheduling": ("--async-scheduling", _PLATFORM, "schedule the next step while the device runs this one "
                         "(default: on where the device runs asynchronously)",
                         {"action": argparse.BooleanOptionalAction}),
    "num_threads": ("--num-threads", _PLATFORM, "CPU threads for torch", {"type": int}),
    "structured_outputs_backend": ("--structured-outputs-backend", _PLATFORM, "grammar backend for structured "
                                   "outputs: xgrammar, a plugin's, or 'auto' (xgrammar); vLLM's "
                                   "--structured-outputs-config '{\"backend\": ...}' and --guided-decoding-backend "
                                   "name it too", {}),
    "disable_custom_all_reduce": ("--disable-custom-all-reduce", _PARALLEL, "sum tensor-parallel messages of "
                                  "every size with NCCL (or gloo), not the one-shot all-reduce for small ones",
                                  {"action": "store_true"}),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp"), _PARALLEL,
                             "ranks (devices) that split the model; must divide its attention heads", {"type": int}),
    "pipeline_parallel_size": (("--pipeline-parallel-size", "-pp"), _PARALLEL,
                               "pipeline stages, each holding a run of the model's layers on its own "
                               "tensor-parallel ranks; must not exceed the layer count", {"type": int}),
    "pipeline_layer_partition": ("--pipeline-layer-partition", _PARALLEL,
                                 "layers of each stage, e.g. 5,4 (unset: VLLM_PP_LAYER_PARTITION, else even)", {}),
    "data_parallel_size": (("--data-parallel-size", "-dp"), _PARALLEL,
                           "engine cores serving the model behind this server, each with its own "
                           "tensor-parallel ranks; requests go to the engine holding their prefix, else "
                           "the least loaded", {"type": int}),
    "runner": (("--runner", "--task"), _POOLING, "generate text, or pool prompts into embeddings "
               "(pooling; 'embed' is vLLM's older --task spelling); auto: pooling for sentence-transformers "
               "checkpoints and bare backbones (e.g. Qwen3Model)", {"choices": (*RUNNERS, *RUNNER_ALIASES)}),
    "pooling_type": ("--pooling-type", _POOLING, "how a pooling model pools a prompt's hidden states "
                     "(default: the checkpoint's 1_Pooling config, else LAST); MEAN and CLS turn prefix caching off",
                     {"type": str.upper, "choices": POOLING_TYPES}),
    "normalize": ("--normalize", _POOLING, "L2-normalise embeddings (default: the checkpoint's Normalize module, "
                  "else on)", {"action": argparse.BooleanOptionalAction}),
    "distributed_executor_backend": ("--distributed-executor-backend", _PARALLEL,
                                     "how ranks start: one process each on this host (mp), or Ray actors "
                                     "(ray; RAY_ADDRESS names the cluster); unset: mp above one rank",
                                     {"choices": EXECUTOR_BACKENDS}),
    "enable_lora": ("--enable-lora", _LORA, "serve LoRA adapters (docs/lora.md)", {"action": "store_true"}),
    "max_loras": ("--max-loras", _LORA, "adapters on the device at once (one step mixes at most this many)",
                  {"type": int}),
    "max_cpu_loras": ("--max-cpu-loras", _LORA, "adapters kept loaded in host memory (unset: --max-loras)",
                      {"type": int}),
    "max_lora_rank": ("--max-lora-rank", _LORA, "the largest adapter rank served (device slots are sized by it)",
                      {"type": int, "choices": LORA_RANKS}),
    "lora_dtype": ("--lora-dtype", _LORA, "the adapters' dtype on the device ('auto': the model's)",
                   {"choices": DTYPES}),
    "speculative_config": ("--speculative-config", _SPEC, "vLLM's JSON form, e.g. '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4}', a draft model or an EAGLE head: '{\"method\": "
                           "\"draft_model\" | \"eagle\" | \"eagle3\", \"model\": PATH, \"num_speculative_tokens\": 3}' "
                           "(docs/speculative.md)", {}),
    "kv_transfer_config": ("--kv-transfer-config", _KV, "a KV connector, vLLM's JSON form: '{\"kv_connector\": "
                           "\"SharedMemoryConnector\", \"kv_role\": \"kv_producer\"}' on a prefill instance, kv_consumer "
                           "on a decode one, behind `corectl proxy` (docs/distributed.md)", {}),
    "kv_offload_bytes": ("--kv-offload-bytes", _KV, "host memory keeping the prefix-cache blocks the device evicts, "
                         "brought back on a later hit (e.g. 16GiB; vLLM's --kv-offloading-size takes GiB)",
                         {"type": byte_count}),
}


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False,
                    defaults: dict[str, Any] | None = None) -> None:
    """Add every engine flag; `defaults` replaces EngineConfig's defaults for this subcommand."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="HF directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    else:
        parser.add_argument("--model", default=None,
                            help="HF directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    config_defaults = EngineConfig()
    for field, (flags, group, help_text, extra) in ENGINE_FLAGS.items():
        grp = groups.setdefault(group, parser.add_argument_group(group))
        default = (defaults or {}).get(field, getattr(config_defaults, field))
        grp.add_argument(*((flags,) if isinstance(flags, str) else flags), dest=field, default=default,
                         help=f"{help_text} (default: {default})", **extra)
    groups[_KV].add_argument("--kv-offloading-size", dest="kv_offload_bytes", type=_gib, default=argparse.SUPPRESS,
                             metavar="GIB", help="vLLM's name for --kv-offload-bytes, in GiB")
    _add_compilation_flags(groups[_PLATFORM])
    _add_vllm_engine_flags(groups[_PLATFORM])


def _add_vllm_engine_flags(group: argparse._ArgumentGroup) -> None:
    """vLLM's engine flags whose meaning corectl covers another way, or refuses past its default."""
    group.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                       help="vLLM's structured-outputs config: its 'backend' is honoured")
    group.add_argument("--guided-decoding-backend", default=None, metavar="NAME",
                       help="vLLM's older name for the structured-outputs backend")
    group.add_argument("--tokenizer-mode", default="auto", metavar="auto|hf",
                       help="vLLM's tokenizer mode: corectl loads the Hugging Face (fast) tokenizer, so auto or hf")
    group.add_argument("--kv-offloading-backend", default="native", metavar="native",
                       help="vLLM's choice of host tier for --kv-offloading-size: corectl's own (native); "
                            "lmcache is not built in")
    group.add_argument("--cpu-offload-gb", type=float, default=0.0, metavar="GIB",
                       help="vLLM's weight offloading to host memory: not built, so 0 only")
    group.add_argument("--model-impl", default="auto", metavar="auto|vllm",
                       help="vLLM's choice of model code: corectl runs its own implementation of each "
                            "architecture (`corectl plugins`), so auto or vllm")
    group.add_argument("--rope-scaling", type=json.loads, default=None, metavar="JSON",
                       help="vLLM's older flag: the config's rope_scaling (as --hf-overrides '{\"rope_scaling\": ...}')")
    group.add_argument("--rope-theta", type=float, default=None, metavar="THETA",
                       help="vLLM's older flag: the config's rope_theta")
    group.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", type=json.loads,
                       default=None, metavar="JSON",
                       help="vLLM's pooler config: its pooling_type and normalize set --pooling-type and --normalize")
    group.add_argument("--hf-token", nargs="?", const=True, default=None, metavar="TOKEN",
                       help="Hugging Face token for gated or private repos (HF_TOKEN for this command's "
                            "processes); bare, the one `huggingface-cli login` stored, as without the flag")


def _vllm_engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options vLLM's spellings set (`_add_vllm_engine_flags`), checked."""
    if args.tokenizer_mode not in ("auto", "hf"):
        raise ConfigError("tokenizer_mode", f"corectl loads Hugging Face tokenizers ('auto' or 'hf'); "
                                            f"{args.tokenizer_mode!r} is not available")
    if args.model_impl not in ("auto", "vllm"):
        raise ConfigError("model_impl", f"corectl runs its own implementation of each architecture it serves "
                                        f"(`corectl plugins` lists them); {args.model_impl!r} is not available")
    if args.kv_offloading_backend != "native":
        raise ConfigError("kv_offloading_backend", f"the host tier is corectl's own ('native'); "
                                                   f"{args.kv_offloading_backend!r} is not available")
    if args.cpu_offload_gb != 0:
        raise ConfigError("cpu_offload_gb", "weights are not offloaded to host memory here; the model must fit "
                                            "the devices (see `corectl plan`, or use -tp/-pp or quantization)")
    values = {**_rope_overrides(args), **_pooler_values(args)}
    backends = [] if args.guided_decoding_backend is None else [args.guided_decoding_backend]
    if args.structured_outputs_config is not None:
        config = decode_json_option("structured_outputs_config", args.structured_outputs_config)
        if not isinstance(config, dict):
            raise ConfigError("structured_outputs_config", f"must be a JSON object, got {config!r}")
        backends += [config["backend"]] if "backend" in config else []
    if len(set(backends)) > 1:
        raise ConfigError("structured_outputs_config", f"two structured-outputs backends given: {backends}")
    return {**values, "structured_outputs_backend": backends[0]} if backends else values


def _rope_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's --rope-scaling and --rope-theta, merged into --hf-overrides (which win where both set a key)."""
    rope = {key: value for key, value in (("rope_scaling", args.rope_scaling), ("rope_theta", args.rope_theta))
            if value is not None}
    if not rope:
        return {}
    if args.rope_scaling is not None and not isinstance(args.rope_scaling, dict):
        raise ConfigError("rope_scaling", f"must be a JSON object, got {args.rope_scaling!r}")
    return {"hf_overrides": {**rope, **(args.hf_overrides or {})}}


# vLLM's pooler-config keys, each the engine option of that name.
_POOLER_KEYS = ("pooling_type", "normalize")


def _pooler_values(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's --pooler-config: its pooling_type and normalize (those flags, when given too, must agree)."""
    config = args.pooler_config
    if config is None:
        return {}
    if not isinstance(config, dict) or set(config) - set(_POOLER_KEYS):
        raise ConfigError("pooler_config", f"takes pooling_type and normalize here, got {config!r}")
    values = {key: (value.upper() if key == "pooling_type" and isinstance(value, str) else value)
              for key, value in config.items()}
    for field, value in values.items():
        flag = getattr(args, field)
        if flag is not None and flag != value:
            raise ConfigError("pooler_config", f"sets {field}={value!r}, but --{field.replace('_', '-')} gives {flag!r}")
    return values


def _add_compilation_flags(group: argparse._ArgumentGroup) -> None:
    # Repeatable, as vLLM's -O: fragments merge in order (corectl.compilation).
    group.add_argument("--compilation-config", "-O", dest="compilation_config", action="append", default=None,
                       metavar="JSON|LEVEL|.KEY=VALUE",
                       help="vLLM's compilation config: cudagraph_mode (FULL_AND_PIECEWISE, FULL_DECODE_ONLY, "
                            "FULL, PIECEWISE, NONE), cudagraph_capture_sizes and max_cudagraph_capture_size are "
                            "honoured; levels (-O3) and compiler keys are accepted and do nothing (default: "
                            "decode steps in whole graphs, other steps in pieces)")
    group.add_argument("--cuda-graph-sizes", dest="cuda_graph_sizes", type=int, nargs="+", default=None,
                       metavar="N", help="vLLM's older name for compilation_config's cudagraph_capture_sizes")
    group.add_argument("--max-cudagraph-capture-size", dest="max_cudagraph_capture_size", type=int, default=None,
                       metavar="N", help="compilation_config's max_cudagraph_capture_size")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {field: getattr(args, field) for field in ENGINE_FLAGS}
    fragments = list(args.compilation_config or [])
    for key, value in (("cudagraph_capture_sizes", args.cuda_graph_sizes),
                       ("max_cudagraph_capture_size", args.max_cudagraph_capture_size)):
        if value is not None:
            fragments.append(json.dumps({key: value}))
    values.update(_vllm_engine_values(args))
    _export_hf_token(args.hf_token)
    return EngineConfig.from_kwargs(model=args.model, compilation_config=fragments or None, **values)


def _export_hf_token(token: str | bool | None) -> None:
    """vLLM's --hf-token: every download (the model, its tokenizer, adapters) runs in this process or
    its children, which read HF_TOKEN; bare (True) leaves huggingface_hub its stored login."""
    if not isinstance(token, str):
        return
    if not token.strip():
        raise ConfigError("hf_token", "must not be empty")
    os.environ["HF_TOKEN"] = token
